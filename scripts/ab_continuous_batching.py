"""Offline continuous-batching A/B: keep c requests in flight (a new one when one finishes), ar vs dflash
(adaptive), alternating rounds; tok/s and where the time goes (prefill vs decode steps).

    python scripts/ab_continuous_batching.py CONCURRENCY TOTAL_REQUESTS ROUNDS     # e.g. 8 32 2
"""
import collections
import sys
import time

import numpy as np

from specjax.config import EngineConfig
from specjax.datasets import load_eval
from specjax.llm import LLM, default_drafter_path
from specjax.sampling import GREEDY, SamplingParams

c, total, rounds = (int(x) for x in sys.argv[1:4])
prompts = [p.turns[0] for name in ("gsm8k", "humaneval", "mt_bench") for p in load_eval(name)[:16]]
llms = {}
for m in ("ar", "dflash"):
    cfg = EngineConfig(max_model_len=2048, max_num_seqs=32, adaptive_k=m != "ar", page_bucket_factor=4)
    llms[m] = LLM(None, default_drafter_path() if m == "dflash" else None, m, None, cfg)
    llms[m].engine.warmup_all(modes=(GREEDY,))
sp = SamplingParams(max_new_tokens=64, ignore_eos=True)
res = collections.defaultdict(list)
for r in range(rounds):
    for m in (("ar", "dflash") if r % 2 == 0 else ("dflash", "ar")):
        llm, e = llms[m], llms[m].engine
        e.k_history.clear()
        ids = [llm.encode(p) for p in prompts]
        queue, live, ntok = list(range(total)), set(), 0
        tdec = tpre = 0.0
        ndec = 0
        t0 = time.perf_counter()
        while queue or live:
            while queue and len(live) < c:
                live.add(e.add_request(ids[queue.pop() % len(ids)], sp))
            pre = any(s.is_prefilling for s in e.running) or bool(e.waiting)
            ts = time.perf_counter()
            outs = e.step()
            dt = time.perf_counter() - ts
            if pre:
                tpre += dt
            else:
                tdec += dt
                ndec += 1
            for o in outs:
                ntok += len(o.new_token_ids)
                if o.finished:
                    live.discard(o.seq_id)
        wall = time.perf_counter() - t0
        res[m].append(ntok / wall)
        print(f"round {r} {m:7s} c={c} {ntok / wall:6.1f} tok/s  steps with prefill {tpre:5.1f}s, "
              f"pure decode {tdec:5.1f}s ({1000 * tdec / max(ndec, 1):.1f} ms/step)  K {dict(e.k_history)}", flush=True)
a, d = np.median(res["ar"]), np.median(res["dflash"])
print(f"c={c}: ar {a:.1f}, dflash {d:.1f}, ratio {d / a:.3f}")
