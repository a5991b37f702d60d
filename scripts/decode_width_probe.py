"""Does a decode step's page-table width cost anything on the in-place attention kernel?  Times decode steps of the
embedded default (the shipped DFlash drafter, K = 3) over 400 cached tokens with a 32-page table and with the widest
one, alternating, batch 1 and 8; and a prompt's first prefill chunk (64 tokens, nothing cached) at the narrowest
table and at the widest (gathered: its width is what it costs); JSON on stdout
(docs/results/startup/decode-width-probe.json)."""

import json
import time

import jax
import numpy as np

from specjax.engine import runner
from specjax.engine.engine import GREEDY
from specjax.engine.programs import StepShape
from specjax.llm import LLM

CACHED, PAGES, REPS = 400, 32, 30


def main() -> None:
    engine = LLM().engine
    k, z, full = engine.k_options[-1], engine.config.page_size, engine._full_pages
    res = {"cached_tokens": CACHED, "k": k, "widest_pages": full, "decode_pages_free": engine.decode_pages_free}
    for b in (1, 8):
        shapes = [StepShape("decode", b, k, pg, GREEDY) for pg in (PAGES, full)]
        programs = {s: engine.programs.build_now(s) for s in shapes}
        pages = np.arange(1, 1 + b * PAGES, dtype=np.int32).reshape(b, PAGES)  # distinct pages per sequence
        times = {s: [] for s in shapes}
        for _ in range(REPS):
            for s in shapes:
                table = np.zeros((b, s.pages), np.int32)
                table[:, :PAGES] = pages
                pos = CACHED + np.arange(k + 1)
                slots = (table[:, pos // z] * z + pos % z).astype(np.int32)
                inputs = runner.DecodeBatch(np.full(b, 5, np.int32), np.full(b, CACHED, np.int32), slots, table,
                                            np.full(b, k, np.int32), np.zeros((b, k), np.int32))
                t0 = time.perf_counter()
                jax.block_until_ready(engine._run(s, programs[s], inputs, engine._sampling([], b)))
                times[s].append(time.perf_counter() - t0)
        for s in shapes:
            res[f"batch{b}_pages{s.pages}_ms"] = round(1000 * float(np.median(times[s][5:])), 2)
    for s in (StepShape("prefill", 1, 64, 1, GREEDY), StepShape("prefill", 1, 64, full, GREEDY)):
        engine.programs.build_now(s)
        res[f"fresh_prefill64_pages{s.pages}_ms"] = round(
            1000 * float(np.median([engine._run_dummy(s) for _ in range(REPS)][5:])), 2)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
