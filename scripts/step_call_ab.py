"""The host's cost of calling a DFlash engine's decode step and commit programs, in one process: A = the drafter's
layers one by one and the engine's arrays left uncommitted (as before session 51), B = as the engine builds them
(stacked drafter layers, committed arrays; `--commit-only`: committed only), calls alternating in either order.

    python scripts/step_call_ab.py [--commit-only] [--rounds 400]

Prints each engine's argument count and median call / commit-call milliseconds (the device's time is waited for
outside them).  Both engines must print the same tokens.
"""

import argparse
import collections
import os
import statistics
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_hooks import decode_calls  # noqa: E402
from stacking_ab import timed  # noqa: E402

import specjax.engine.engine as engine_module  # noqa: E402
import specjax.spec.proposer as proposer_module  # noqa: E402
from specjax.config import EngineConfig  # noqa: E402
from specjax.llm import LLM  # noqa: E402
from specjax.sampling import SamplingParams  # noqa: E402

PROMPT = "Natalia sold clips to 48 of her friends in April. How many clips did she sell? Explain step by step."


def build(stack: bool, commit: bool):
    """-> (engine, its first decode step's (shape, program, inputs), tokens, argument count, phases); the engine's
    `_run` then times each call of the step and commit programs into phases["call"] / phases["commit"]."""
    saved = (proposer_module.stackable, engine_module.committed)
    if not stack:
        proposer_module.stackable = lambda layers: False
    if not commit:
        engine_module.committed = lambda tree: tree
    try:
        llm = LLM(method="dflash", engine_config=EngineConfig(max_model_len=4096, num_draft_tokens=3))
    finally:
        proposer_module.stackable, engine_module.committed = saved
    eng = llm.engine
    with decode_calls(eng) as captured:
        [out] = llm.generate([llm.encode(PROMPT)], SamplingParams(max_new_tokens=32, ignore_eos=True))
    phases = collections.defaultdict(list)
    timed(llm, phases)
    count = len(jax.tree.leaves((eng.tweights, eng.kv, eng.pweights, eng.pstate, captured[0][2])))
    return eng, captured[0], out.token_ids, count, phases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commit-only", action="store_true", help="B commits the arrays but keeps the layers apart")
    p.add_argument("--rounds", type=int, default=400)
    a = p.parse_args()
    engines = {"A": build(False, False), "B": build(not a.commit_only, True)}
    assert engines["A"][2] == engines["B"][2], "the two engines printed different tokens"
    for r in range(a.rounds):
        for k in ("A", "B") if r % 2 == 0 else ("B", "A"):
            eng, (shape, program, args), *_ = engines[k]
            jax.block_until_ready(eng._run(shape, program, *args))  # the engine's own call of step and commit
            jax.block_until_ready(eng.kv)
    for k, (_, _, _, count, phases) in engines.items():
        print(f"{k}: {count} arguments, call {1e3 * statistics.median(phases['call']):.3f} ms, "
              f"commit call {1e3 * statistics.median(phases['commit']):.3f} ms")


if __name__ == "__main__":
    main()
