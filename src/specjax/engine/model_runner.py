"""Running engine steps: the host inputs of a prefill chunk or a decode step (page tables, KV slots, sampling
parameters, drafts from prompt lookup or a host proposer), the choice of a ready step program and of K, the call
of the program and its commit (engine/runner.py holds the jitted functions), and the outputs back on host.

`ModelRunner` is a mixin of LLMEngine (engine/engine.py): it reads the engine's config, allocator, programs,
buckets, caches and controller, and hands each sequence's new tokens to `_commit` (engine/scheduler.py).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from specjax.engine import runner
from specjax.engine.buckets import pick_bucket
from specjax.engine.programs import StepShape
from specjax.engine.sequence import Sequence, StepOutput, logprob_entries
from specjax.model.target import ForwardBatch
from specjax.parallel import to_global, to_host
from specjax.sampling import sampler_mode
from specjax.spec.context_vocab import context_ids
from specjax.spec.lookup import LookupIndex

COMPILE_AHEAD = 32  # tokens: with on-demand compilation, the next page bucket's decode shape compiles this early


class ModelRunner:
    """LLMEngine's step execution (a mixin: see the module docstring)."""

    # ------------------------------------------------------------------------------------------------ shapes
    @property
    def _full_pages(self) -> int:
        """The widest page table (a bucket): one max_model_len sequence."""
        return pick_bucket(self.config.max_pages_per_seq, self.page_buckets)

    def _pages_bucket(self, num_tokens: int) -> int:
        """Page-table width (a bucket) of a step whose longest sequence spans num_tokens."""
        return pick_bucket(self.allocator.pages_for(num_tokens), self.page_buckets)

    def _decode_pages(self, num_tokens: int, at_least: int | None = None) -> int:
        """Page-table width of a decode step reaching `num_tokens`: at least `at_least` (default
        `min_decode_pages`), or the widest when it costs nothing (`decode_pages_free`)."""
        if self.decode_pages_free:
            return self._full_pages
        at_least = self.min_decode_pages if at_least is None else at_least
        return max(at_least, self._pages_bucket(min(num_tokens, self.config.max_model_len)))

    # ------------------------------------------------------------------------------------------------ inputs
    def _page_table(self, seqs: list[Sequence], batch: int, pg: int) -> np.ndarray:
        table = np.zeros((batch, pg), np.int32)  # padding -> scratch page 0
        for i, s in enumerate(seqs):
            pages = self.allocator.pages_of(s.seq_id)[:pg]
            table[i, :len(pages)] = pages
        return table

    def _slots(self, seq: Sequence, positions: np.ndarray) -> np.ndarray:
        """Flat KV slots of `positions` for `seq` (-1 where it owns no page)."""
        pages = np.asarray(self.allocator.pages_of(seq.seq_id), np.int64)
        if not len(pages):
            return np.full(positions.shape, -1, np.int32)
        z = self.config.page_size
        page_idx = positions // z
        ok = (positions >= 0) & (page_idx < len(pages))
        slots = np.where(ok, pages[np.minimum(page_idx, len(pages) - 1)] * z + positions % z, -1)
        return slots.astype(np.int32)

    def _sampling(self, seqs: list[Sequence], batch: int) -> runner.SamplingBatch:
        pad = batch - len(seqs)
        return runner.SamplingBatch(
            temperature=np.asarray([s.params.temperature for s in seqs] + [0.0] * pad, np.float32),
            top_k=np.asarray([s.params.top_k for s in seqs] + [0] * pad, np.int32),
            top_p=np.asarray([s.params.top_p for s in seqs] + [1.0] * pad, np.float32),
            seeds=np.asarray([s.seed for s in seqs] + [0] * pad, np.int32),
        )

    # ------------------------------------------------------------------------------------------------ running
    def _run(self, shape: StepShape, program, *args):
        """Run a step program on host (numpy) inputs and commit its rows; -> the step's outputs.  On one device
        the executables take the numpy arrays as they are (placed on their device: ~15 us for a step's ten, where
        `jax.device_put` of the same pytree took ~220 us)."""
        step, commit = program
        if self._inputs_sharding is not None:
            args = jax.tree.map(lambda a: to_global(a, self._inputs_sharding), args)
        out = step(self.tweights, self.kv, self.pweights, self.pstate, *args)
        if shape.kind == "prefill":
            self.kv, self.pstate = commit(self.kv, self.pstate, args[0].slots, out[1], args[0].slots, out[2])
        else:
            self.kv, self.pstate = commit(self.kv, self.pstate, args[0].slots, out[3], out[5], out[4])
        return out

    def _run_dummy(self, shape: StepShape) -> float:
        """One step of `shape` on dummy inputs (the caches are untouched); -> seconds."""
        program = self.programs.build_now(shape)
        t0 = time.perf_counter()
        out = self._run(shape, program, *self._step_args(shape))
        jax.block_until_ready(out[0])
        return time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------------ prefill
    def _prefill(self, seqs: list[Sequence]) -> list[StepOutput]:
        chunks = [seq.all_ids[seq.num_cached:min(seq.prefill_len, seq.num_cached + self.config.prefill_chunk)]
                  for seq in seqs]
        # A chunk reads only the pages of what is cached before it: none for a prompt's first chunk, whose shape
        # is the narrowest table (gathering 2048 tokens of unused pages costs more than a 64-token chunk itself).
        # A later chunk reads the full width (one shape per (batch, tokens) bucket), unless a narrower ready
        # program fits it (the one `warmup` builds for a known prompt: a faster first token).
        b = pick_bucket(len(seqs), self.prefill_batch_buckets)
        t = pick_bucket(max(len(c) for c in chunks), self.prefill_buckets)
        mode = sampler_mode([s.params for s in seqs], prompt=True)
        cached = max(s.num_cached for s in seqs)
        full = self._full_pages
        own = StepShape("prefill", b, t, full if cached else self._pages_bucket(1), mode)
        narrow = self.programs.find(StepShape("prefill", b, t, self._pages_bucket(max(cached, 1)), mode))
        # Padded to a larger (batch, tokens) bucket, or a first chunk gathering the full width: ask for this step's
        # own shape (on demand), or every later chunk pads to the first program.
        if narrow is not None and ((narrow.batch, narrow.n) != (b, t) or not cached and narrow.pages == full):
            self.programs.request([own])
        need = narrow or own
        shape, program = self.programs.get(need)
        b, t = shape.batch, shape.n
        tokens = np.zeros((b, t), np.int32)
        positions = np.zeros((b, t), np.int32)
        slots = np.full((b, t), -1, np.int32)
        last_index = np.zeros((b,), np.int32)
        next_tokens = np.zeros((b, t), np.int32)
        for i, (seq, chunk) in enumerate(zip(seqs, chunks)):
            n = len(chunk)
            tokens[i, :n] = chunk
            following = seq.all_ids[seq.num_cached + 1:seq.num_cached + n + 1]
            next_tokens[i, :n] = following + [-1] * (n - len(following))  # -1: the token sampled now
            positions[i, :n] = np.arange(seq.num_cached, seq.num_cached + n)
            slots[i, :n] = self._slots(seq, positions[i, :n])
            last_index[i] = n - 1
        table = self._page_table(seqs, b, shape.pages)
        batch = ForwardBatch(tokens, positions, slots, table)
        first, _, _, logprobs = self._run(shape, program, batch, last_index, next_tokens,
                                          self._sampling(seqs, b))
        first = to_host(first)
        logprobs = None if logprobs is None else [to_host(a) for a in logprobs]
        self.num_steps["prefill"] += 1
        outputs = []
        for i, (seq, chunk) in enumerate(zip(seqs, chunks)):
            if logprobs is not None and seq.prompt_logprobs is not None and not seq.output_ids:
                # rows of prompt positions whose next token is a prompt token, recorded once (not on recompute)
                start = len(seq.prompt_logprobs) - 1 - seq.num_cached  # first row not yet recorded
                end = min(len(chunk), len(seq.prompt_ids) - 1 - seq.num_cached)
                if 0 <= start < end:
                    rows = (a[i, start:end] for a in logprobs)
                    seq.prompt_logprobs += logprob_entries(next_tokens[i, start:end], *rows, seq.params.prompt_logprobs)
            seq.num_cached += len(chunk)
            self._register_pages(seq)
            if seq.is_prefilling or seq.output_ids:  # more chunks to go, or recomputing after preemption
                continue
            seq.first_token_time = time.perf_counter()
            first_logprob = None
            if logprobs is not None and seq.logprobs is not None:
                n = len(chunk) - 1
                first_logprob = logprob_entries([first[i]], *(a[i, n:n + 1] for a in logprobs), seq.params.logprobs)
            outputs.append(self._commit(seq, [int(first[i])], first_logprob))
        return outputs

    # ------------------------------------------------------------------------------------------------ decode
    def _decode(self, seq_ids: set[int]) -> list[StepOutput]:
        for seq in [s for s in self.running if s.seq_id in seq_ids]:
            if seq in self.running:
                self._grow_or_preempt(seq, self._step_tokens(seq))
        seqs = [s for s in self.running if s.seq_id in seq_ids]
        if not seqs:
            return []
        b = pick_bucket(len(seqs), self.batch_buckets)
        mode = sampler_mode([s.params for s in seqs])
        # Pages are reserved for the largest K (_step_tokens), but a step gathers only those its K reaches.
        longest = max(s.num_tokens for s in seqs)
        pages = {k: self._decode_pages(longest + k) for k in self.k_options}
        options = self.k_options
        if self.programs.on_demand:  # choose among the K with a ready program; the others compile meanwhile
            needs = {k: StepShape("decode", b, k, pages[k], mode) for k in self.k_options}
            options = tuple(k for k in self.k_options if self.programs.find(needs[k])) or self.k_options
            self.programs.request(needs[k] for k in self.k_options if k not in options)
            # ... and the page bucket the batch grows into within COMPILE_AHEAD tokens, before it gets there
            self.programs.request(StepShape("decode", b, k, self._decode_pages(longest + k + COMPILE_AHEAD), mode)
                                  for k in options)
        if self.controller is not None:
            k = self.controller.choose(b, len(seqs), pages, options)
        else:
            k = self.k_options[0]
        need = StepShape("decode", b, k, pages[k], mode)
        waited = self.programs.wait_s
        shape, program = self.programs.get(need)
        waited = self.programs.wait_s - waited
        for seq in seqs:
            seq.stats.program_wait_s += waited
        self.k_history[k] += 1
        self.last_k = k
        rows = shape.batch  # >= b when the step runs in a larger ready batch bucket (padding rows write nothing)
        bonus = np.zeros((rows,), np.int32)
        start = np.zeros((rows,), np.int32)
        slots = np.full((rows, k + 1), -1, np.int32)
        num_drafts = np.zeros((rows,), np.int32)
        host_drafts = np.zeros((rows, k), np.int32)  # beside prompt lookup: -1 = the drafter's block (decode_step)
        looked_up = np.zeros((rows,), bool)
        extra_ids = np.full((rows, self.context_vocab), -1, np.int32) if self.context_vocab else None
        for i, seq in enumerate(seqs):
            if extra_ids is not None:
                if seq.context_ids is None:
                    seq.context_ids = context_ids(seq.prompt_ids, self.draftable, self.context_vocab)
                extra_ids[i] = seq.context_ids
            bonus[i], start[i] = seq.output_ids[-1], seq.start
            slots[i] = self._slots(seq, seq.start + np.arange(k + 1))
            room = self.config.max_model_len - seq.num_tokens - 1  # drafts beyond this could not be stored
            num_drafts[i] = max(0, min(k, seq.params.max_new_tokens - len(seq.output_ids) - 1, room))
            if not self.proposer.on_device and num_drafts[i]:
                proposal = self.proposer.host_propose(seq.all_ids, int(num_drafts[i]))[: num_drafts[i]]
                host_drafts[i, :len(proposal)] = proposal
                num_drafts[i] = len(proposal)
            elif self.lookup_min_n and num_drafts[i]:
                if seq.lookup is None:
                    seq.lookup = LookupIndex(self.lookup_min_n)
                seq.lookup.extend(seq.prompt_ids, seq.output_ids)
                proposal = seq.lookup.propose(k)
                if len(proposal) == k:  # lookup proposes K tokens or none (spec/lookup.copy_after)
                    host_drafts[i], looked_up[i] = proposal, True
                    seq.stats.lookup_steps += 1
                else:
                    host_drafts[i] = -1
        table = self._page_table(seqs, shape.batch, shape.pages)
        inputs = runner.DecodeBatch(bonus, start, slots, table, num_drafts, host_drafts, extra_ids)
        t0 = time.perf_counter()
        num_accepted, tokens, drafts, *_, logprobs = self._run(shape, program, inputs,
                                                               self._sampling(seqs, shape.batch))
        num_accepted, tokens = to_host(num_accepted), to_host(tokens)
        logprobs = None if logprobs is None else [to_host(a) for a in logprobs]
        drafts = to_host(drafts) if self.record_drafts else None
        if self.controller is not None and self.programs.runs[shape] > 1:  # a program's first run pays set-up
            self._record_cost(need, shape, time.perf_counter() - t0)
        self.num_steps["decode"] += 1
        self.last_decode = [(s.seq_id, int(num_drafts[i]), int(num_accepted[i])) for i, s in enumerate(seqs)]
        outputs = []
        for i, seq in enumerate(seqs):
            a = int(num_accepted[i])
            seq.stats.record(int(num_drafts[i]), a)
            if self.controller is not None and num_drafts[i] == k and not looked_up[i]:  # the drafter's acceptance
                self.controller.record_acceptance(k, a)
            if seq.stats.draft_log is not None:
                seq.stats.draft_log.append([int(d) for d in drafts[i, :num_drafts[i]]])
            seq.num_cached = seq.start + a + 1  # old bonus + accepted drafts; the new bonus has no K/V yet
            entries = None
            if logprobs is not None and seq.logprobs is not None:
                entries = logprob_entries(tokens[i, :a + 1], *(x[i, :a + 1] for x in logprobs), seq.params.logprobs)
            outputs.append(self._commit(seq, [int(t) for t in tokens[i, :a + 1]], entries))
        return outputs

    def _record_cost(self, need: StepShape, shape: StepShape, seconds: float) -> None:
        """Time a decode step that needed `need` and ran as `shape` (a larger ready one while `need` compiles):
        the controller's timings of `need` restart when the program behind it changes."""
        key = (need.batch, need.n, need.pages)
        if self._cost_shape.get(key, shape) != shape:
            self.controller.forget_cost(*key)
        self._cost_shape[key] = shape
        self.controller.record_cost(*key, seconds)
