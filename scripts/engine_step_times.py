"""Wall time of the engine's decode steps on one gsm8k-like prompt (3 runs x 128 tokens after a warm-up run), and
of the KV commit program alone: the per-step costs `specjax analyze kflat` does not see (the host's work, the
default 1 GiB KV pool, the separate commit).

    python scripts/engine_step_times.py [--method ar|dflash] [--k K]

Prints the p10 / median / p90 of the decode steps, and the commit program's median with XLA's scatters and with
the kernel (kernels/kv_write.cc).
"""

import argparse
import statistics
import time

import jax
from engine_hooks import decode_calls

from specjax.config import EngineConfig
from specjax.engine import runner
from specjax.llm import LLM
from specjax.sampling import SamplingParams

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
          "clips did Natalia sell altogether in April and May? Explain step by step.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="ar")
    p.add_argument("--k", type=int, default=None, help="drafts per step (dflash; default: the engine's)")
    args = p.parse_args()
    config = EngineConfig(max_model_len=4096, num_draft_tokens=args.k) if args.k else None
    llm = LLM(method=args.method, engine_config=config)
    eng = llm.engine
    prompt = llm.encode(PROMPT)
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up
    decode = []
    with decode_calls(eng) as calls:
        for _ in range(3):
            sid = eng.add_request(prompt, params)
            while not eng.seqs[sid].is_finished:
                t0 = time.perf_counter()
                eng.step()
                if eng.last_decode:  # not the prefill
                    decode.append(time.perf_counter() - t0)
    decode.sort()
    q = [decode[int(len(decode) * f)] * 1e3 for f in (0.1, 0.5, 0.9)]
    print(f"{args.method}: {len(decode)} decode steps, ms p10 / median / p90 {q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f}")
    _, (step, _), a = calls[-1]
    out = step(eng.tweights, eng.kv, eng.pweights, eng.pstate, *a)
    for kernel in (None, eng.tweights.kv_write_kernel):
        commit = runner.commit.lower(eng.kv, eng.pstate, a[0].slots, out[3], out[5], out[4], kernel=kernel).compile()
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            eng.kv, eng.pstate = jax.block_until_ready(commit(eng.kv, eng.pstate, a[0].slots, out[3], out[5], out[4]))
            times.append(time.perf_counter() - t0)
        print(f"commit ({'kernel' if kernel else 'XLA scatter'}): median {statistics.median(times[20:]) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
