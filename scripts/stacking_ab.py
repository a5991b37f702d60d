"""Stacked layers and KV pools (model/stack.py, KVPages.stacked) against per-layer arrays, in one process: two
engines on the same weights, generations alternating in turn (either first), and the host's share of each decode
step (the step program's call, the commit's call, the wait for the tokens, the rest of the step's Python).

    python scripts/stacking_ab.py [--method ar|dflash] [--rounds 40] [--keep layers|pools] > out.json

A = the engine as loaded (stacked where the loader and engine choose it); B = per-layer weights and pools, or with
--keep, only the other of the two per layer.  Prints one JSON object: ms a token (medians), B / A per round
(median), rounds A won, the per-step phases of each, and whether both produced the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import specjax.engine.engine as engine_module
import specjax.model.loader as loader_module
from specjax.llm import LLM
from specjax.sampling import SamplingParams

PROMPTS = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
           "clips did Natalia sell altogether in April and May? Explain step by step.",
           "Write a Python function that returns the n-th Fibonacci number, with a docstring and two tests.")


def timed(llm: LLM, phases: dict) -> None:
    """Record the call of each decode step's program and of its commit (`llm`'s engine runs them through its own
    `_run`, handed wrappers that time each call) into `phases` (lists of seconds)."""
    eng, run = llm.engine, llm.engine._run

    def clocked(fn, key):
        def call(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            phases[key].append(time.perf_counter() - t0)
            return out
        return call

    def step_run(shape, program, *args):
        if shape.kind == "decode":
            program = (clocked(program[0], "call"), clocked(program[1], "commit"))
        return run(shape, program, *args)

    eng._run = step_run


def generate(llm: LLM, phases: dict, prompt: str, params: SamplingParams) -> tuple[float, list[int]]:
    """-> (seconds a token, tokens); each decode step's time and its waits for results appended to `phases`."""
    eng, to_host = llm.engine, engine_module.to_host
    waited = [0.0]

    def wait(x):
        t0 = time.perf_counter()
        out = to_host(x)
        waited[0] += time.perf_counter() - t0
        return out

    engine_module.to_host = wait
    sid = eng.add_request(llm.encode(prompt), params)
    t0 = time.perf_counter()
    while not eng.seqs[sid].is_finished:
        decodes, waited[0] = eng.num_steps["decode"], 0.0
        s0 = time.perf_counter()
        eng.step()
        if eng.num_steps["decode"] > decodes:
            phases["step"].append(time.perf_counter() - s0)
            phases["wait"].append(waited[0])
    elapsed = time.perf_counter() - t0
    engine_module.to_host = to_host
    seq = eng.seqs[sid]
    return elapsed / len(seq.output_ids), list(seq.output_ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="ar")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--keep", choices=("layers", "pools"), default=None,
                   help="B keeps this one stacked (isolates the other)")
    args = p.parse_args()
    a = LLM(method=args.method)
    if args.keep != "layers":
        loader_module.stackable = lambda layers: False
    if args.keep != "pools":
        engine_module.stacks_pools = lambda *_: False
    b = LLM(method=args.method)
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    phases = {name: {"call": [], "commit": [], "step": [], "wait": []} for name in "ab"}
    for name, llm in (("a", a), ("b", b)):
        timed(llm, phases[name])
    same = True
    for prompt in PROMPTS:  # warm-up: every program compiled, and the outputs compared
        same &= generate(a, phases["a"], prompt, params)[1] == generate(b, phases["b"], prompt, params)[1]
    for ph in phases.values():
        for k in ("call", "commit", "step", "wait"):
            ph[k].clear()
    times = {"a": [], "b": []}
    for r in range(args.rounds):
        for name in ("ab" if r % 2 == 0 else "ba"):
            times[name].append(generate(a if name == "a" else b, phases[name], PROMPTS[r % 2], params)[0])
    summary = {}
    for name in "ab":
        ph = phases[name]
        host = [s - c - m - w for s, c, m, w in zip(ph["step"], ph["call"], ph["commit"], ph["wait"])]
        summary[name] = {"ms_per_token": statistics.median(times[name]) * 1e3,
                         **{f"{k}_ms": statistics.median(ph[k]) * 1e3 for k in ("call", "commit", "wait", "step")},
                         "host_rest_ms": statistics.median(host) * 1e3}
    ratios = [tb / ta for ta, tb in zip(times["a"], times["b"])]
    print(json.dumps({"method": args.method, "keep": args.keep, "rounds": args.rounds, "same_tokens": same,
                      "speedup_a_over_b": statistics.median(ratios), "a_won": int(np.sum(np.array(ratios) > 1)),
                      **summary}, indent=1))


if __name__ == "__main__":
    main()
