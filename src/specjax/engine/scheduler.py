"""Scheduling: admit waiting requests while their pages (and the running ones' next decode step) fit in the pool,
grow a running request's pages or preempt the most recently admitted others, commit new tokens up to a stop
condition, finish a request and free its pages.

`Scheduler` is a mixin of LLMEngine (engine/engine.py): it owns the engine's `waiting` / `running` queues and
`allocator` (kv/allocator.py) bookkeeping; the steps in engine/model_runner.py call `_grow_or_preempt` and
`_commit`.
"""

from __future__ import annotations

import logging
import time

from specjax.engine.sequence import Sequence, Status, StepOutput
from specjax.kv.allocator import OutOfPages

log = logging.getLogger(__name__)


class Scheduler:
    """LLMEngine's queues and page bookkeeping (a mixin: see the module docstring)."""

    def _step_tokens(self, seq: Sequence) -> int:
        """KV capacity (tokens) a running sequence needs for its next decode step."""
        return min(seq.num_tokens + max(self.k_options), self.config.max_model_len)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            need = min(seq.prefill_len + 1 + max(self.k_options), self.config.max_model_len)
            reserve = sum(max(0, self.allocator.pages_for(self._step_tokens(s)) - len(self.allocator.pages_of(
                s.seq_id))) for s in self.running)
            if self.allocator.pages_for(need) + reserve > self.allocator.num_free:
                break
            self.allocator.grow(seq.seq_id, need)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _preempt(self, victim: Sequence) -> None:
        log.info("preempting request %d (pool exhausted)", victim.seq_id)
        self.running.remove(victim)
        self.allocator.free(victim.seq_id)
        victim.num_cached = 0
        victim.status = Status.WAITING
        victim.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` pages for num_tokens, preempting the youngest other requests if needed."""
        while True:
            try:
                self.allocator.grow(seq.seq_id, num_tokens)
                return True
            except OutOfPages:
                victims = [s for s in self.running if s is not seq]
                if not victims:
                    raise
                self._preempt(victims[-1])
                if seq not in self.running:
                    return False

    # ------------------------------------------------------------------------------------------------ commit
    def _commit(self, seq: Sequence, new_ids: list[int]) -> StepOutput:
        """Append tokens up to the first stop condition; finish the sequence if one is met."""
        stop = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else set(self.eos_token_ids))
        kept, reason = [], None
        for tok in new_ids:
            kept.append(tok)
            seq.output_ids.append(tok)
            if tok in stop:
                reason = "stop"
            elif len(seq.output_ids) >= seq.params.max_new_tokens or seq.num_tokens >= self.config.max_model_len:
                reason = "length"
            if reason:
                break
        if reason:
            self.running.remove(seq)
            self._finish(seq, reason)
        return StepOutput(seq.seq_id, kept, reason is not None, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        seq.lookup = None  # its n-gram index (~0.7 KB a token)
        self.allocator.free(seq.seq_id)
