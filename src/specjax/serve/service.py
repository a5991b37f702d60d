"""EngineService: one background thread owns the engine; HTTP handlers talk to it through queues.

Handlers validate a request (read-only), then `submit` it; the engine thread adds it, steps the engine while
anything is pending, detokenizes incrementally, applies stop strings (text past a stop string is never sent:
the tail that could still start one is held back) and pushes events to the request's asyncio queue.  Aborts
(client disconnects, stop strings) free the request's pages at the next step boundary.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import jax

from specjax.engine.engine import LLMEngine
from specjax.model.tokenizer import StreamDecoder, Tokenizer
from specjax.sampling import SamplingParams
from specjax.serve.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class Event:
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    completion_tokens: int = 0  # in the request's last event
    logprobs: list | None = None  # engine/sequence.TokenLogprob of token_ids, when the request asked for them


@dataclass
class RequestState:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    decoder: StreamDecoder | None
    seq_id: int | None = None
    text: str = ""  # all text decoded so far
    sent: int = 0  # characters of `text` already sent
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    completion_tokens: int = 0
    done: bool = False
    owner: "EngineService | None" = None  # the service (engine replica) serving it
    prompt_logprobs: list | None = None  # with params.prompt_logprobs: set before the first token's event
    after: "RequestState | None" = None  # n > 1: the request whose prefill this one shares (same engine)


class EngineService:
    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer | None, metrics: Metrics, idle_sleep: float = 0.05,
                 publisher=None):
        self.engine = engine
        self.publisher = publisher  # multi-host: process 0 publishes its engine calls to the followers (lockstep.py)
        self.tokenizer = tokenizer
        self.max_model_len = engine.config.max_model_len
        self.metrics = metrics
        metrics.set_memory(engine.memory_bytes())
        self.idle_sleep = idle_sleep
        self.commands: queue.Queue = queue.Queue()
        self.by_seq: dict[int, RequestState] = {}
        self.by_request: dict[int, RequestState] = {}
        self.ids = itertools.count(1)
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self._outstanding = 0  # submitted and not finished (load balancing across replicas)
        self._outstanding_lock = threading.Lock()
        metrics.kv_pages_total.set(engine.allocator.num_pages - 1)

    # ------------------------------------------------------------------------------------------- API threads
    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="specjax-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.commands.put(("wake",))
        if self.thread is not None:
            self.thread.join(timeout=30)
        if self.publisher is not None:
            self.publisher.close()
        self.engine.programs.close()  # background compilation, if any

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if the engine cannot serve the request (read-only)."""
        self.engine.validate_request(prompt_ids, params)

    def submit(self, prompt_ids: list[int], params: SamplingParams, stop: tuple[str, ...] = (),
               after: RequestState | None = None) -> RequestState:
        """Queue a validated request; events arrive on the returned state's `events` (asyncio) queue.  `after`: a
        request with the same prompt submitted before (n > 1) whose prefill this one waits for and shares."""
        state = RequestState(next(self.ids), list(prompt_ids), params, tuple(s for s in stop if s),
                             asyncio.get_running_loop(), asyncio.Queue(),
                             StreamDecoder(self.tokenizer) if self.tokenizer is not None else None, owner=self,
                             after=after)
        with self._outstanding_lock:
            self._outstanding += 1
        self.commands.put(("add", state))
        return state

    def abort(self, state: RequestState) -> None:
        if not state.done:
            self.commands.put(("abort", state))

    def outstanding(self) -> int:
        """Requests submitted and not finished."""
        return self._outstanding

    def health(self) -> dict:
        """/health body: compiled programs and the engine's load (read without locking: a snapshot)."""
        engine = self.engine
        return {"step_programs": {"ready": len(engine.programs.ready), "compiling": engine.programs.pending(),
                                  "evicted": engine.programs.evictions},
                "running": len(engine.running), "waiting": len(engine.waiting),
                "kv_pages_used": engine.allocator.num_used}

    def count_rejected(self) -> None:
        self.metrics.rejected.inc()

    def metrics_text(self) -> bytes:
        self.metrics.set_programs(self.engine.programs)
        return self.metrics.render()

    # ------------------------------------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        try:
            while not self.stopping.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    try:
                        self._step()
                    except Exception:
                        if not self._caches_alive():
                            raise
                        log.exception("an engine step failed: its requests end with an error, serving goes on")
                        self._fail_unfinished()
        except BaseException as e:  # surface engine crashes to every waiting client instead of hanging them
            log.exception("engine thread crashed")
            self.error = e
            for state in list(self.by_request.values()):
                self._emit(state, Event("", [], True, "error"))

    def _caches_alive(self) -> bool:
        """Whether the engine's KV pools survived a failed step (a step that failed after donating them has lost
        every request's cache: the engine cannot go on)."""
        return not any(x.is_deleted() for x in jax.tree.leaves((self.engine.kv, self.engine.pstate)))

    def _fail_unfinished(self) -> None:
        """After a failed step: end every request the engine holds with an error event and free its pages."""
        for seq_id in [s.seq_id for s in (*self.engine.running, *self.engine.waiting)]:
            self._abort(seq_id)
            state = self.by_seq.get(seq_id)
            if state is not None and not state.done:
                self._finish(state, "error")
        self.metrics.kv_pages_used.set(self.engine.allocator.num_used)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                cmd = self.commands.get(timeout=self.idle_sleep) if block else self.commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if cmd[0] == "add":
                state = cmd[1]
                after = state.after.seq_id if state.after is not None else None
                state.seq_id = self.engine.add_request(state.prompt_ids, state.params, after=after)
                if self.publisher is not None:
                    self.publisher.add(state.prompt_ids, state.params, after)
                self.by_seq[state.seq_id] = state
                self.by_request[state.request_id] = state
                self.metrics.prompt_tokens.inc(len(state.prompt_ids))
            elif cmd[0] == "abort":
                state = cmd[1]
                if state.seq_id is not None and not state.done:
                    self._abort(state.seq_id)
                    self._finish(state, "abort", emit=False)

    def _step(self) -> None:
        preempted_before = self.engine.num_preemptions
        if self.publisher is not None:
            self.publisher.publish()
        outputs = self.engine.step()
        self.metrics.record_decode(self.engine.last_decode, self.engine.last_k if self.engine.last_decode else None)
        for out in outputs:
            state = self.by_seq.get(out.seq_id)
            if state is None or state.done:
                continue
            now = time.perf_counter()
            if state.first_token is None and out.new_token_ids:
                state.first_token = now
                self.metrics.ttft.observe(now - state.arrival)
                state.prompt_logprobs = self.engine.seqs[out.seq_id].prompt_logprobs
            state.completion_tokens += len(out.new_token_ids)
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            delta_text = state.decoder.push(out.new_token_ids) if state.decoder else ""
            if out.finished and state.decoder:
                delta_text += state.decoder.flush()
            state.text += delta_text
            hit = self._find_stop(state)
            if hit is not None:
                state.text = state.text[:hit]
                self._abort(out.seq_id)
                self._emit_text(state, out.new_token_ids, True, out.logprobs)
                self._finish(state, "stop")
                continue
            self._emit_text(state, out.new_token_ids, out.finished, out.logprobs)
            if out.finished:
                self._finish(state, out.finish_reason)
        self.metrics.preemptions.inc(self.engine.num_preemptions - preempted_before)
        self.metrics.kv_pages_used.set(self.engine.allocator.num_used)
        self.metrics.set_prefix_cache(self.engine.allocator, self.engine.prefix_cache_stats)
        self.metrics.running.set(len(self.engine.running))
        self.metrics.waiting.set(len(self.engine.waiting))

    def _abort(self, seq_id: int) -> None:
        self.engine.abort(seq_id)
        if self.publisher is not None:
            self.publisher.abort(seq_id)

    def _find_stop(self, state: RequestState) -> int | None:
        hits = [state.text.find(s, max(0, state.sent - len(s) + 1)) for s in state.stop]
        hits = [h for h in hits if h >= 0]
        return min(hits) if hits else None

    def _emit_text(self, state: RequestState, token_ids: list[int], final: bool, logprobs=None) -> None:
        """Send text that can no longer become part of a stop string (everything, when final), with the new tokens
        (and their log-probabilities)."""
        hold = 0 if final else max((len(s) - 1 for s in state.stop), default=0)
        upto = max(state.sent, len(state.text) - hold)
        chunk = state.text[state.sent:upto]
        state.sent = upto
        if chunk or token_ids:
            self._emit(state, Event(chunk, list(token_ids), logprobs=logprobs))

    def _finish(self, state: RequestState, reason: str | None, emit: bool = True) -> None:
        state.done = True
        with self._outstanding_lock:
            self._outstanding -= 1
        self.by_seq.pop(state.seq_id, None)
        self.by_request.pop(state.request_id, None)
        self.engine.seqs.pop(state.seq_id, None)  # the engine keeps finished sequences until someone takes them
        now = time.perf_counter()
        self.metrics.requests.labels(finish_reason=reason or "unknown").inc()
        self.metrics.e2e.observe(now - state.arrival)
        if state.first_token is not None and state.completion_tokens > 1:
            self.metrics.tpot.observe((now - state.first_token) / (state.completion_tokens - 1))
        if emit:
            self._emit(state, Event("", [], True, reason, completion_tokens=state.completion_tokens))

    @staticmethod
    def _emit(state: RequestState, event: Event) -> None:
        state.loop.call_soon_threadsafe(state.events.put_nowait, event)
