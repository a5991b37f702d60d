"""Runs tensor-parallel cases in a process started with N virtual CPU devices (XLA_FLAGS must be set before jax
starts, so tests/parallel/test_tensor_parallel.py runs this file as a subprocess).  Reads a JSON list of cases
on stdin, writes one JSON result per case on stdout."""

from __future__ import annotations

import collections
import json
import re
import sys

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(program) -> dict[str, int]:
    text = program.as_text()
    return dict(collections.Counter(m for m in re.findall(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", text)))


def run_case(case: dict) -> dict:
    from specjax.config import ConfigError, EngineConfig
    from specjax.llm import LLM
    from specjax.sampling import SamplingParams

    try:
        llm = LLM(case["model"], case.get("drafter"), case["method"], case.get("block_size"),
                  EngineConfig(page_size=2, num_pages=case.get("num_pages", 0), max_model_len=64, max_num_seqs=4,
                               adaptive_k=False, page_bucket_factor=case.get("page_bucket_factor", 2)),
                  tensor_parallel_size=case["tp"])
    except ConfigError as e:
        return {"error": str(e)}
    res = llm.generate(case["prompts"], SamplingParams(max_new_tokens=case["max_new_tokens"], ignore_eos=True))
    engine = llm.engine
    out = {"tokens": [r.token_ids for r in res], "preemptions": engine.num_preemptions,
           "kv_spec": list(engine.kv.k[0].sharding.spec) if engine.mesh is not None else None,
           "memory": engine.memory_bytes()}
    decode = [p for s, p in engine.programs.ready.items() if s.kind == "decode"]
    out["decode_collectives"] = collectives(decode[0][0]) if decode else {}
    out["commit_collectives"] = collectives(decode[0][1]) if decode else {}
    return out


def main() -> None:
    import jax

    jax.config.update("jax_enable_x64", False)
    for case in json.load(sys.stdin):
        print(json.dumps(run_case(case)), flush=True)


if __name__ == "__main__":
    main()
