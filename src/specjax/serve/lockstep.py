"""Multi-host serving: process 0 runs the HTTP server and its engine; every other process runs the same engine and
follows it.  Before each engine step, process 0 publishes the engine calls it made since the previous step
(add_request, abort) in the jax.distributed key-value store; the others replay them and step, so every process
runs the same step programs with the same inputs (the collectives inside them need all processes).  The engines
choose nothing by timing when several processes run (engine.lockstep), so replaying the calls is enough."""

from __future__ import annotations

import dataclasses
import json
import logging

from specjax.sampling import SamplingParams

log = logging.getLogger(__name__)

PREFIX = "specjax/step/"


def kv_client():
    """The jax.distributed key-value client of this process (a multi-process run must be initialized)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("multi-host serving needs jax.distributed to be initialized (--coordinator-address ...)")
    return client


class Publisher:
    """Process 0's side: `record` each engine call, `publish` them before every step, `close` to release the
    followers."""

    def __init__(self, client):
        self.client, self.step, self.calls = client, 0, []

    def add(self, prompt_ids: list[int], params: SamplingParams, after: int | None = None) -> None:
        self.calls.append(["add", list(prompt_ids), dataclasses.asdict(params), after])

    def abort(self, seq_id: int) -> None:
        self.calls.append(["abort", seq_id])

    def publish(self) -> None:
        self.client.key_value_set(f"{PREFIX}{self.step}", json.dumps(self.calls))
        if self.step >= 2:  # followers have read it (they are at most one step behind: each step is collective)
            self.client.key_value_delete(f"{PREFIX}{self.step - 2}")
        self.step, self.calls = self.step + 1, []

    def close(self) -> None:
        self.calls.append(["stop"])
        self.publish()


def follow(engine, client, poll_ms: int = 60_000) -> int:
    """A follower's loop: replay process 0's calls and step, until it stops.  Returns the steps run."""
    step = 0
    while True:
        try:
            message = client.blocking_key_value_get(f"{PREFIX}{step}", poll_ms)
        except Exception as e:  # noqa: BLE001 - a timeout is an idle server: wait again
            if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                continue
            raise
        for call in json.loads(message):
            if call[0] == "stop":
                return step
            if call[0] == "add":
                params = dict(call[2], stop_token_ids=tuple(call[2]["stop_token_ids"]))
                engine.add_request(call[1], SamplingParams(**params), after=call[3])
            elif call[0] == "abort":
                engine.abort(call[1])
        if engine.has_unfinished():
            engine.step()
        for seq_id in [i for i, s in engine.seqs.items() if s.is_finished]:
            del engine.seqs[seq_id]
        step += 1
