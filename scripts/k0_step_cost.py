"""Cost of a K = 0 decode step: plain (ar) vs DFlash (its drafter context update), in one process, calls
alternating and the order flipped every iteration; median of N per batch size, with a bootstrap 90% interval
of the ratio of medians.

    python scripts/k0_step_cost.py [N]
"""
import sys

import numpy as np

from specjax.config import EngineConfig
from specjax.llm import LLM, default_drafter_path
from specjax.sampling import GREEDY

N = int(sys.argv[1]) if len(sys.argv) > 1 else 80
PAGES = 4
engines = {}
for method in ("ar", "dflash"):
    cfg = EngineConfig(max_model_len=1024, max_num_seqs=32, num_draft_tokens=0)
    engines[method] = LLM(None, default_drafter_path() if method == "dflash" else None, method, None, cfg).engine
rng = np.random.default_rng(0)
for b in (1, 8, 32):
    times = {m: [] for m in engines}
    for e in engines.values():
        for _ in range(2):
            e._run_decode(b, 0, PAGES, GREEDY)
    for i in range(N):
        for m, e in (list(engines.items()) if i % 2 == 0 else list(engines.items())[::-1]):
            times[m].append(e._run_decode(b, 0, PAGES, GREEDY))
    a, d = np.array(times["ar"]), np.array(times["dflash"])
    boot = [np.median(rng.choice(d, len(d))) / np.median(rng.choice(a, len(a))) for _ in range(2000)]
    print(f"B={b:3d}  ar {1000 * np.median(a):7.2f} ms  dflash K=0 {1000 * np.median(d):7.2f} ms  "
          f"ratio {np.median(d) / np.median(a):.3f} (90%: {np.percentile(boot, 5):.3f}-{np.percentile(boot, 95):.3f})",
          flush=True)
