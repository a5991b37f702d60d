"""Cost of a K = 0 decode step: plain (ar) vs DFlash (its drafter context update), alternating calls in one
process, median of N, per batch size and page bucket.

    python scripts/k0_step_cost.py
"""
import numpy as np

from specjax.config import EngineConfig
from specjax.llm import LLM, default_drafter_path
from specjax.sampling import GREEDY

N = 40
engines = {}
for method in ("ar", "dflash"):
    cfg = EngineConfig(max_model_len=1024, max_num_seqs=32, num_draft_tokens=0)
    engines[method] = LLM(None, default_drafter_path() if method == "dflash" else None, method, None, cfg).engine
for b in (1, 4, 16, 32):
    for pg in (4, 16):
        ts = {m: [] for m in engines}
        for m, e in engines.items():
            e._run_decode(b, 0, pg, GREEDY)
        for _ in range(N):
            for m, e in engines.items():
                ts[m].append(e._run_decode(b, 0, pg, GREEDY))
        a, d = np.median(ts["ar"]), np.median(ts["dflash"])
        print(f"B={b:3d} pg={pg:3d} ar {1000*a:7.1f} ms  dflash K=0 {1000*d:7.1f} ms  ratio {d/a:.3f}", flush=True)
