"""Peer comparison: the reference PyTorch implementation (PyPI `dflash`, transformers backend, CPU, float32) on
the same target weights (exported from specjax), the same drafter checkpoint and the same prompts.

The reference's own timing helper calls torch.cuda.synchronize(); on the CPU we substitute a plain clock for it
(its `_cuda_time`), which is the only change: generation itself is the package's `dflash_generate`.
"""

from __future__ import annotations

import hashlib
import os
import time


def export_cached(target, cache_root: str) -> str:
    from specjax.model.export import export_hf

    key = hashlib.sha1(f"{os.path.abspath(str(target.source))}:{os.path.getmtime(target.source)}".encode()).hexdigest()
    path = os.path.join(cache_root, key[:16])
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        export_hf(target, path)
    return path


def run_reference(target, drafter_path: str, prompts: list[list[int]], max_new_tokens: int, block_size: int,
                  stop_token_ids: list[int], cache_root: str, threads: int | None = None) -> list[dict]:
    import torch
    from dflash import model as ref
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    hf_dir = export_cached(target, cache_root)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    draft = ref.DFlashDraftModel.from_pretrained(drafter_path, dtype=torch.float32).eval()
    original = ref._cuda_time
    ref._cuda_time = time.perf_counter
    out = []
    try:
        for ids in prompts:
            t0 = time.perf_counter()
            stats = ref.dflash_generate(draft, hf, torch.tensor([ids]), max_new_tokens, stop_token_ids,
                                        block_size=block_size, return_stats=True)
            wall = time.perf_counter() - t0
            new = stats.output_ids[0, len(ids):].tolist()
            out.append({"output_ids": new, "tpot_s": stats.time_per_output_token, "ttft_s": stats.time_to_first_token,
                        "acceptance_lengths": list(stats.acceptance_lengths), "wall_s": wall})
    finally:
        ref._cuda_time = original
    return out
