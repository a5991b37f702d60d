"""Where a batched regeneration's time goes: seconds per step shape (prefill / decode, batch, tokens or K, pages),
real vs computed prefill tokens, and response tokens per second.

    python scripts/profile_regen.py --batch-size 32 --prompts 128 --out runs/profile-regen.json
    python scripts/profile_regen.py ... --padded   # the old behaviour: no on-demand shapes (every chunk padded)

The prompts are `specjax regenerate`'s (the four training sources interleaved, shuffled with --seed), answered
greedily with its engine settings; each step is timed to completion (block_until_ready), compiles included in the
first run of a shape and in the lookups that waited for one.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import random
import statistics
import time

import jax

from specjax.cli.common import enable_compile_cache
from specjax.config import EngineConfig
from specjax.datasets import load_train_prompts
from specjax.llm import LLM
from specjax.sampling import SamplingParams

SOURCES = ("gsm8k_train", "codealpaca", "sharegpt", "mbpp_train")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--padded", action="store_true", help="no on-demand compilation (before the prefill fix)")
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    enable_compile_cache(None)
    llm = LLM(None, method="ar", engine_config=EngineConfig(
        max_model_len=args.max_prompt_tokens + args.max_new_tokens + 1, max_num_seqs=args.batch_size,
        page_size=16, prefill_chunk=256))
    engine = llm.engine
    engine.programs.on_demand = not args.padded
    by_source = collections.defaultdict(list)
    for p in load_train_prompts(list(SOURCES), args.data_dir, None):
        by_source[p.dataset].append(p)
    rng = random.Random(args.seed)
    for lst in by_source.values():
        rng.shuffle(lst)
    mixed = [p for group in itertools.zip_longest(*by_source.values()) for p in group if p is not None]
    for i, p in enumerate(mixed[:args.prompts]):
        ids = llm.encode([{"role": "user", "content": p.turns[0]}])
        if len(ids) <= args.max_prompt_tokens:
            engine.add_request(ids, SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, seed=i))

    step_s = collections.defaultdict(list)
    prefill_real = prefill_computed = 0
    run, get = engine._run, engine.programs.get
    waits = collections.Counter()

    def timed_run(shape, program, *a):
        nonlocal prefill_real, prefill_computed
        t = time.perf_counter()
        out = run(shape, program, *a)
        jax.block_until_ready(out[0])
        step_s[shape].append(time.perf_counter() - t)
        if shape.kind == "prefill":
            prefill_real += int((a[0].slots >= 0).sum())
            prefill_computed += shape.batch * shape.n
        return out

    def timed_get(need):
        t = time.perf_counter()
        found = get(need)
        waits[found[0]] += time.perf_counter() - t
        return found

    engine._run, engine.programs.get = timed_run, timed_get
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - t0
    engine.programs.close()
    tokens = sum(len(s.output_ids) for s in engine.seqs.values())
    shapes = sorted(step_s, key=lambda s: -sum(step_s[s]))
    report = {
        "padded": args.padded, "batch_size": args.batch_size, "prompts": len(engine.seqs), "seconds": seconds,
        "response_tokens": tokens, "tokens_per_s": tokens / seconds,
        "prefill_s": sum(sum(v) for s, v in step_s.items() if s.kind == "prefill"),
        "decode_s": sum(sum(v) for s, v in step_s.items() if s.kind == "decode"),
        "prefill_tokens_real": prefill_real, "prefill_tokens_computed": prefill_computed,
        "lookup_wait_s": sum(waits.values()),
        "shapes": [{"shape": list(s), "steps": len(step_s[s]), "seconds": sum(step_s[s]),
                    "median_s": statistics.median(step_s[s])} for s in shapes],
    }
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "shapes"}))


if __name__ == "__main__":
    main()
