"""The engine's DFlash decode program with every row on prompt lookup's drafts (the drafter skipped) against every
row on the drafter's: the step call alone, 30 alternated bursts of 20 calls, medians in ms.

    python scripts/lookup_step_probe.py
"""

import dataclasses
import statistics
import time

import jax
import numpy as np
from engine_hooks import decode_calls

from specjax.llm import LLM
from specjax.sampling import SamplingParams

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
          "clips did Natalia sell altogether in April and May? Explain step by step.")


def main() -> None:
    llm = LLM()
    eng = llm.engine
    prompt = llm.encode(PROMPT)
    llm.generate([prompt], SamplingParams(max_new_tokens=128, ignore_eos=True))  # compiles every shape used below
    with decode_calls(eng) as calls:
        llm.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))
    _, (step, _), (inputs, sampling) = calls[-1]
    drafts = np.asarray(inputs.host_drafts)
    variants = {"lookup": dataclasses.replace(inputs, host_drafts=np.full_like(drafts, 7)),
                "drafter": dataclasses.replace(inputs, host_drafts=np.full_like(drafts, -1))}

    def burst(x, n=20):
        t0 = time.perf_counter()
        for _ in range(n):
            jax.block_until_ready(step(eng.tweights, eng.kv, eng.pweights, eng.pstate, x, sampling))
        return (time.perf_counter() - t0) / n * 1e3

    times = {name: [] for name in variants}
    for _ in range(30):
        for name, x in variants.items():
            times[name].append(burst(x))
    print({name: round(statistics.median(v), 3) for name, v in times.items()})


if __name__ == "__main__":
    main()
