"""How glibc's malloc arenas change an engine decode step: each round runs one process per arena setting (the
embedded target, plain decoding, `LLM` with its allocator tuning), which captures the engine's compiled decode step
and its inputs, calls it back to back for a few seconds (as `LLMEngine._run` does: called from Python, then waited
for) and reports the median step; the report is each setting's median over rounds and the median over rounds of
one arena's step divided by the setting's (docs/results/kflat.md, session 48).

    python scripts/malloc_arena_ab.py [--arenas 1,2,4,0] [--rounds 6] [--seconds 4] [--out FILE]

0 = glibc's default (8 arenas per core); N = mallopt(M_ARENA_MAX, N) before anything else allocates.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys


def child(arenas: int, seconds: float) -> None:
    import ctypes

    if arenas:
        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX
    import time

    import jax
    from engine_hooks import decode_calls

    from specjax.config import EngineConfig
    from specjax.llm import LLM
    from specjax.sampling import SamplingParams

    llm = LLM(method="ar", engine_config=EngineConfig(max_model_len=2048, max_num_seqs=1))
    engine = llm.engine
    with decode_calls(engine) as captured:
        llm.generate(["Explain how a bicycle works."], SamplingParams(max_new_tokens=8, ignore_eos=True))
    _, (step, _), step_args = captured[0]
    calls, totals = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        out = step(engine.tweights, engine.kv, engine.pweights, engine.pstate, *step_args)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        calls.append(t1 - t0)
        totals.append(time.perf_counter() - t0)
    print(json.dumps({"call_ms": statistics.median(calls) * 1e3, "step_ms": statistics.median(totals) * 1e3}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arenas", default="1,2,4,0")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--out", default=None)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args.child, args.seconds)
        return
    settings = [int(a) for a in args.arenas.split(",")]
    rounds = []
    for r in range(args.rounds):
        row = {}
        for a in settings:
            out = subprocess.run([sys.executable, __file__, "--child", str(a), "--seconds", str(args.seconds)],
                                 capture_output=True, text=True, check=True, env=os.environ).stdout
            row[a] = json.loads(out.strip().splitlines()[-1])
        rounds.append(row)
        print(f"round {r}: " + "  ".join(f"{a}: {row[a]['step_ms']:.2f} ms" for a in settings), flush=True)
    report = {"rounds": rounds, "settings": {}}
    for a in settings:
        steps = [row[a]["step_ms"] for row in rounds]
        vs_one = [row[1]["step_ms"] / row[a]["step_ms"] for row in rounds] if 1 in settings else []
        report["settings"][a] = {"step_ms": statistics.median(steps),
                                 "call_ms": statistics.median(row[a]["call_ms"] for row in rounds),
                                 "speedup_vs_one_arena": statistics.median(vs_one) if vs_one else None,
                                 "faster_than_one_arena": sum(x > 1 for x in vs_one)}
        row = report["settings"][a]
        print(f"arenas {a}: step {row['step_ms']:.2f} ms, call {row['call_ms']:.2f} ms, "
              f"vs one arena {row['speedup_vs_one_arena']}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
