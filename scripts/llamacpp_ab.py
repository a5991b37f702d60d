"""llama.cpp's plain decoding against specjax's (plain and DFlash), on the same GGUF file, the same prompt tokens and
the same machine, prompt by prompt in turn: the comparison the project's mission names, and the README's
"faster than llama.cpp" line (docs/results/peers.md).  Use it on a new machine, or after a change to decoding speed.

    pip install llama-cpp-python==0.3.36            # a separate venv is fine; PYTHONPATH must then see specjax
    python scripts/llamacpp_ab.py [--prompts 3] [--max-new-tokens 128] [--threads 2] > out.json

Each prompt is the benchmark's chat (`specjax bench`'s first N prompts of each dataset), tokenized once by specjax;
llama.cpp (`Llama.generate` on those tokens, greedy: top_k 1, temperature 0, n_threads 2) and specjax's plain and
default DFlash engines each produce max-new-tokens tokens (no stop at EOS: every engine decodes the same count).
TPOT is the time after the first new token divided by the tokens after it; the engines run one after another, in
turn, so they never share the cores.  Also printed: how many leading tokens llama.cpp's greedy answer shares with
specjax's (llama.cpp takes int8 activations, specjax 16-bit ones by default, so long answers may part).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from specjax.datasets import load_eval
from specjax.llm import LLM, default_drafter_path
from specjax.model.loader import default_model_path
from specjax.sampling import SamplingParams

DATASETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt_bench")


def llamacpp_run(model, ids: list[int], n: int) -> tuple[float, list[int]]:
    """-> (seconds a token after the first, tokens): greedy, exactly n new tokens."""
    model.reset()
    out, t_first = [], None
    for tok in model.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if t_first is None:
            t_first = time.perf_counter()
        out.append(tok)
        if len(out) == n:
            break
    return (time.perf_counter() - t_first) / (n - 1), out


def specjax_run(llm: LLM, ids: list[int], n: int) -> tuple[float, list[int], float]:
    """-> (seconds a token after the first, tokens, tau)."""
    [res] = llm.generate([ids], SamplingParams(max_new_tokens=n, ignore_eos=True))
    return res.tpot, list(res.token_ids), res.stats.mean_acceptance_length


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=3, help="per dataset")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--datasets", default=",".join(DATASETS))
    args = p.parse_args()
    from llama_cpp import Llama

    path = default_model_path()
    cpp = Llama(model_path=path, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=2048, verbose=False)
    engines = {"ar": LLM(method="ar"), "dflash": LLM(method="dflash", drafter=default_drafter_path("dflash"))}
    n = args.max_new_tokens
    chats = [(name, [{"role": "user", "content": q.turns[0]}])
             for name in args.datasets.split(",") for q in load_eval(name)[:args.prompts]]
    ids0 = engines["ar"].encode(chats[0][1])  # warm-up: every engine compiles / loads once
    llamacpp_run(cpp, ids0, 8)
    for llm in engines.values():
        specjax_run(llm, ids0, n)
    rows = []
    for i, (name, chat) in enumerate(chats):
        ids = engines["ar"].encode(chat)
        order = ["llama.cpp", "ar", "dflash"]
        order = order[i % 3:] + order[:i % 3]
        row, out = {"dataset": name, "prompt_tokens": len(ids)}, {}
        for who in order:
            if who == "llama.cpp":
                tpot, out[who] = llamacpp_run(cpp, ids, n)
            else:
                tpot, out[who], tau = specjax_run(engines[who], ids, n)
                if who == "dflash":
                    row["tau"] = tau
            row[f"{who}_ms"] = tpot * 1e3
        row["shared_prefix_with_llama.cpp"] = shared_prefix(out["llama.cpp"], out["ar"])
        row["dflash_equals_ar"] = out["dflash"] == out["ar"]
        rows.append(row)
        print(json.dumps(row), flush=True, file=sys.stderr)
    summary = {}
    for name in args.datasets.split(","):
        rs = [r for r in rows if r["dataset"] == name]
        med = {k: statistics.median(r[k] for r in rs) for k in ("llama.cpp_ms", "ar_ms", "dflash_ms", "tau")}
        summary[name] = {**med, "ar_vs_llama.cpp": statistics.median(r["llama.cpp_ms"] / r["ar_ms"] for r in rs),
                         "dflash_vs_llama.cpp": statistics.median(r["llama.cpp_ms"] / r["dflash_ms"] for r in rs)}
    print(json.dumps({"model": path, "threads": args.threads, "max_new_tokens": n, "summary": summary,
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
