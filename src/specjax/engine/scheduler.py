"""Scheduling: admit waiting requests while their pages (and the running ones' next decode step) fit in the pool,
grow a running request's pages or preempt the most recently admitted others, commit new tokens up to a stop
condition, finish a request and free its pages.

With prefix caching, an admitted request first shares the cached pages of its prompt's longest cached prefix
(its prefill starts after them; at least its last prompt token is computed, for the logits of its first token), and
every page whose rows are final is registered in the cache as soon as they are (`_register_pages`).  Target and
drafter rows live at the same slots of the same pages, so a shared page brings both.  A request that asks for
prompt logprobs computes its whole prompt.  A request with `after` (the n > 1 siblings of one prompt) waits until
that request's prefill is done, then shares its pages.

`Scheduler` is a mixin of LLMEngine (engine/engine.py): it owns the engine's `waiting` / `running` queues and
`allocator` (kv/allocator.py) bookkeeping; the steps in engine/model_runner.py call `_grow_or_preempt`,
`_register_pages` and `_commit`.
"""

from __future__ import annotations

import logging
import time

from specjax.engine.sequence import Sequence, Status, StepOutput
from specjax.kv.allocator import OutOfPages, page_hashes

log = logging.getLogger(__name__)


class Scheduler:
    """LLMEngine's queues and page bookkeeping (a mixin: see the module docstring)."""

    def _step_tokens(self, seq: Sequence) -> int:
        """KV capacity (tokens) a running sequence needs for its next decode step."""
        return min(seq.num_tokens + max(self.k_options), self.config.max_model_len)

    def _admit(self) -> None:
        deferred = []  # requests waiting for their sibling's prefill: they keep their place in the queue
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self._waits_for_sibling(seq):
                deferred.append(self.waiting.popleft())
                continue
            hit = self._cache_hit(seq)
            need = min(seq.prefill_len + 1 + max(self.k_options), self.config.max_model_len)
            reserve = sum(max(0, self.allocator.pages_for(self._step_tokens(s)) - len(self.allocator.pages_of(
                s.seq_id))) for s in self.running)
            in_use = sum(page in self.allocator.refs for page in hit)  # shared pages that take nothing from the pool
            if self.allocator.pages_for(need) - in_use + reserve > self.allocator.num_free:
                break
            if hit:
                self.allocator.share(seq.seq_id, hit)
                seq.num_registered = len(hit)
                seq.num_cached = len(hit) * self.allocator.page_size
                seq.stats.cached_tokens += seq.num_cached
                self.prefix_cache_stats["hit_tokens"] += seq.num_cached
            self.allocator.grow(seq.seq_id, need)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
        self.waiting.extendleft(reversed(deferred))

    def _waits_for_sibling(self, seq: Sequence) -> bool:
        sibling = self.seqs.get(seq.after) if seq.after is not None else None
        return (sibling is not None and not sibling.is_finished and self.config.prefix_caching
                and (sibling.status == Status.WAITING or sibling.is_prefilling))

    # ------------------------------------------------------------------------------------------------ prefix cache
    def _hash_pages(self, seq: Sequence, count: int) -> None:
        """Extend seq.page_hashes to its first `count` full pages."""
        have = len(seq.page_hashes)
        if count > have:
            seq.page_hashes += page_hashes(seq.all_ids, self.allocator.page_size, have, count,
                                           getattr(self.proposer, "observes_next_token", False),
                                           seq.page_hashes[-1] if have else b"")

    def _cache_hit(self, seq: Sequence) -> list[int]:
        """The cached pages `seq` can share at admission (none when caching is off, for prompt logprobs, or when it
        owns pages already)."""
        if (not self.config.prefix_caching or seq.params.prompt_logprobs is not None
                or self.allocator.pages_of(seq.seq_id)):
            return []
        self.prefix_cache_stats["queried_tokens"] += seq.prefill_len
        limit = (seq.prefill_len - 1) // self.allocator.page_size  # the last prompt token is always computed
        self._hash_pages(seq, limit)
        return self.allocator.lookup(seq.page_hashes[:limit])

    def _register_pages(self, seq: Sequence) -> None:
        """Register `seq`'s pages whose rows are all final (every position below num_cached) in the prefix cache."""
        # rows of committed tokens only (a stop token may end a step's accepted drafts early); a page's hash names
        # the token after it too where the proposer's rows depend on it
        lookahead = getattr(self.proposer, "observes_next_token", False)
        final = min(seq.num_cached, seq.num_tokens - int(lookahead))
        full = final // self.allocator.page_size
        if not self.config.prefix_caching or full <= seq.num_registered:
            return
        self._hash_pages(seq, full)
        for i in range(seq.num_registered, full):
            self.allocator.register(seq.seq_id, i, seq.page_hashes[i])
        seq.num_registered = full

    def _preempt(self, victim: Sequence) -> None:
        log.info("preempting request %d (pool exhausted)", victim.seq_id)
        self.running.remove(victim)
        self.allocator.free(victim.seq_id)
        victim.num_cached = victim.num_registered = 0
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
    def _commit(self, seq: Sequence, new_ids: list[int], logprobs: list | None = None) -> StepOutput:
        """Append tokens (and their `logprobs`, when the request asked for them) up to the first stop condition;
        finish the sequence if one is met."""
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
        self._register_pages(seq)  # before a finished sequence's pages are freed
        kept_logprobs = None
        if seq.logprobs is not None and logprobs is not None:
            kept_logprobs = logprobs[:len(kept)]
            seq.logprobs += kept_logprobs
        if reason:
            self.running.remove(seq)
            self._finish(seq, reason)
        return StepOutput(seq.seq_id, kept, reason is not None, reason, kept_logprobs)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        seq.lookup = None  # its n-gram index (~0.7 KB a token)
        self.allocator.free(seq.seq_id)
