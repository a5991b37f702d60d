"""The host's cost of calling a DFlash engine's decode step and commit programs, in one process: A = the drafter's
layers one by one and the engine's arrays left uncommitted (as before session 51), B = as the engine builds them
(stacked drafter layers, committed arrays; `--commit-only`: committed only), calls alternating in either order.

    python scripts/step_call_ab.py [--commit-only] [--rounds 400]

Prints each engine's argument count and median call / commit-call milliseconds (the device's time is waited for
outside them).  Both engines must print the same tokens.
"""

import argparse
import statistics
import time

import jax

import specjax.engine.engine as engine_module
import specjax.spec.proposer as proposer_module
from specjax.config import EngineConfig
from specjax.llm import LLM
from specjax.sampling import SamplingParams

PROMPT = "Natalia sold clips to 48 of her friends in April. How many clips did she sell? Explain step by step."


def build(stack: bool, commit: bool):
    saved = (proposer_module.stackable, engine_module.committed)
    if not stack:
        proposer_module.stackable = lambda layers: False
    if not commit:
        engine_module.committed = lambda tree: tree
    try:
        llm = LLM(method="dflash", engine_config=EngineConfig(max_model_len=4096, num_draft_tokens=3))
    finally:
        proposer_module.stackable, engine_module.committed = saved
    eng, captured, run = llm.engine, {}, llm.engine._run

    def capture(shape, program, *args):
        if shape.kind == "decode" and not captured:
            captured["step"] = (program, args)
        return run(shape, program, *args)

    eng._run = capture
    [out] = llm.generate([llm.encode(PROMPT)], SamplingParams(max_new_tokens=32, ignore_eos=True))
    (step, commit_program), args = captured["step"]
    count = len(jax.tree.leaves((eng.tweights, eng.kv, eng.pweights, eng.pstate, args)))
    return eng, step, commit_program, args, count, out.token_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commit-only", action="store_true", help="B commits the arrays but keeps the layers apart")
    p.add_argument("--rounds", type=int, default=400)
    a = p.parse_args()
    engines = {"A": build(False, False), "B": build(not a.commit_only, True)}
    assert engines["A"][5] == engines["B"][5], "the two engines printed different tokens"
    times = {k: ([], []) for k in engines}
    for r in range(a.rounds):
        for k in ("A", "B") if r % 2 == 0 else ("B", "A"):
            eng, step, commit_program, args, _, _ = engines[k]
            t0 = time.perf_counter()
            out = step(eng.tweights, eng.kv, eng.pweights, eng.pstate, *args)
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            t2 = time.perf_counter()
            eng.kv, eng.pstate = commit_program(eng.kv, eng.pstate, args[0].slots, out[3], out[5], out[4])
            t3 = time.perf_counter()
            jax.block_until_ready(eng.kv)
            times[k][0].append(t1 - t0)
            times[k][1].append(t3 - t2)
    for k, (calls, commits) in times.items():
        print(f"{k}: {engines[k][4]} arguments, call {1e3 * statistics.median(calls):.3f} ms, "
              f"commit call {1e3 * statistics.median(commits):.3f} ms")


if __name__ == "__main__":
    main()
