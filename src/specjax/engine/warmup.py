"""Warm-up: compile (and, in the foreground, run once on dummy inputs) the step shapes a workload will use
(`warmup`: known prompt lengths) or every shape the engine can produce (`warmup_all`: server start-up), timing
decode steps as the K controller's cost prior; with `background`, compile on demand on the programs' thread.

`Warmup` is a mixin of LLMEngine (engine/engine.py): it reads the engine's config, buckets, K options, controller
and programs, and uses the shape helpers and `_run_dummy` of engine/model_runner.py.
"""

from __future__ import annotations

import jax

from specjax.engine.buckets import pick_bucket
from specjax.engine.programs import StepShape
from specjax.sampling import GREEDY


class Warmup:
    """LLMEngine's ahead-of-time compilation (a mixin: see the module docstring)."""

    # ------------------------------------------------------------------------------------------------ warm-up
    def warmup(self, prompt_lens, total_len: int, batch_sizes=(1,), modes=(GREEDY,), progress=None,
               background: bool = False) -> int:
        """Compile the step shapes requests with prompts of `prompt_lens` (an int or a list) growing to
        `total_len` tokens will use (see _warm for `background` and `progress`).  Returns the shapes compiled now.
        With `background`, decode steps run at the widest page table these requests reach (one program per K, not
        one per page bucket and K), and those programs are queued for the background thread at once: they compile
        while the first prefill runs, and nothing compiles while the requests decode."""
        prompt_lens = [prompt_lens] if isinstance(prompt_lens, int) else list(prompt_lens)
        total_len = min(total_len, self.config.max_model_len)
        chunk = self.config.prefill_chunk
        tokens = {min(chunk, n - start) for n in prompt_lens for start in range(0, n, chunk)}
        prefill_t = {pick_bucket(n, self.prefill_buckets) for n in tokens}
        decode_pages = {self._decode_pages(n + k, at_least=1)
                        for n in range(min(prompt_lens) + 1, total_len + 1) for k in self.k_options}
        # A prompt's first chunk reads no cached pages (the narrowest table); later chunks read what is cached.
        # Background: one prefill program, as wide as these prompts' later chunks need (narrow: a faster first token)
        fresh = self._pages_bucket(1)
        if max(prompt_lens) <= chunk:
            prefill_pages = (fresh,)
        else:
            prefill_pages = (self._pages_bucket(max(prompt_lens)),) if background else (fresh, self._full_pages)
        if background:  # decode at the widest page table these requests reach: one program per K, not per bucket
            self.min_decode_pages = max(decode_pages)
        n = self._warm(sorted(prefill_t), sorted(decode_pages), batch_sizes, modes, progress, background,
                       prefill_pages)
        if background and self.programs.on_demand:  # the decode programs compile while the prefill runs
            b = pick_bucket(max(batch_sizes), self.batch_buckets)
            self.programs.prefetch(StepShape("decode", b, k, self.min_decode_pages, m) for m in modes
                                   for k in self.k_options)  # in the order the K controller first tries them
        return n

    def warmup_all(self, modes=(GREEDY,), progress=None, background: bool = False) -> int:
        """Compile every shape this engine can produce (server start-up): no compilation after this (with
        `background`, none on the engine thread: a step waits for its shape or runs in a larger ready one)."""
        decode_pages = (self._full_pages,) if self.decode_pages_free else self.page_buckets
        prefill_pages = (self._pages_bucket(1),) + (() if background else (self._full_pages,))
        return self._warm(self.prefill_buckets, decode_pages, self.batch_buckets, modes, progress, background,
                          prefill_pages)

    def _warm(self, prefill_t, decode_pages, batch_sizes, modes, progress, background, prefill_pages) -> int:
        """Compile the shapes for `batch_sizes` x `modes`: prefill chunks of `prefill_t` tokens, decode steps at
        every K option and page bucket of `decode_pages`.  Each is compiled and run once on dummy inputs
        (decode: twice more, timed, as the K controller's cost prior), `progress(done, total)` after each.
        With `background`, only a prefill of the largest chunk for one sequence is built now (per mode, without
        runs): the first prompt runs at once, padded, and every other shape compiles on demand on the background
        thread (`self.programs.on_demand`, see engine/programs.py), so memory grows with the shapes the workload
        uses, not with every bucket.  The controller then times real steps.  Prefill programs are built at each
        page-table width of `prefill_pages` (background: the first).
        """
        prefill_b = sorted({pick_bucket(min(x, self.prefill_batch_buckets[-1]), self.prefill_batch_buckets)
                            for x in batch_sizes})
        decode_b = sorted({pick_bucket(x, self.batch_buckets) for x in batch_sizes})
        now = []  # listed first so progress knows the total
        for mode in modes:
            if background:
                now.append(StepShape("prefill", prefill_b[0], max(prefill_t), prefill_pages[0], mode))
            else:
                now += [StepShape("prefill", b, t, pg, mode) for b in prefill_b for t in prefill_t
                        for pg in prefill_pages]
                now += [StepShape("decode", b, k, pg, mode) for b in decode_b for pg in decode_pages
                        for k in self.k_options]
        # lockstep (several processes): what is not built now compiles on first use, on this thread, in the same
        # order in every process (a background thread's timing would differ between them)
        self.programs.on_demand = background and not self.lockstep
        for i, shape in enumerate(now):
            if background:  # no dummy runs: requests are waiting (the controller times real steps)
                self.programs.build_now(shape)
            else:
                self._run_dummy(shape)  # compiles
                if shape.kind == "decode" and self.controller is not None:
                    for _ in range(2):
                        self._record_cost(shape, shape, self._run_dummy(shape))
            if progress is not None:
                progress(i + 1, len(now))
        jax.block_until_ready(self.kv)
        return len(now)
