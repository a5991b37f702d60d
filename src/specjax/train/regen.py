"""Regenerate training responses with the TARGET itself (batched, through the real engine), resumably.

DFlash drafters are trained on the target's own outputs ("for better target alignment", paper §4.2).  Every
finished request is written to the TokenStore at once, so a crash or Ctrl-C loses only the requests in flight.
"""

from __future__ import annotations

import logging
import time

from specjax.datasets import Prompt
from specjax.sampling import SamplingParams
from specjax.train.store import TokenStore

log = logging.getLogger(__name__)


def regenerate(llm, prompts: list[Prompt], store: TokenStore, max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0, max_prompt_tokens: int = 512, progress=None) -> dict:
    """Answer every prompt not yet in `store` with the target; returns counts and throughput."""
    engine = llm.engine
    pending = {}
    skipped = 0
    for i, p in enumerate(prompts):
        if p.id in store.ids:
            continue
        ids = llm.encode([{"role": "user", "content": p.turns[0]}])
        if len(ids) > max_prompt_tokens or len(ids) + 1 >= engine.config.max_model_len:
            skipped += 1
            continue
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed + i)
        pending[engine.add_request(ids, params)] = p
    total, done, new_tokens = len(pending), 0, 0
    t0 = time.perf_counter()
    while pending:
        for out in engine.step():
            if not out.finished:
                continue
            seq = engine.seqs.pop(out.seq_id)
            p = pending.pop(out.seq_id)
            store.append(p.id, p.dataset, seq.prompt_ids + seq.output_ids, len(seq.prompt_ids), seq.finish_reason)
            done += 1
            new_tokens += len(seq.output_ids)
            if progress:
                progress(done, total, new_tokens, time.perf_counter() - t0)
    elapsed = time.perf_counter() - t0
    return {"generated": done, "skipped_long_prompts": skipped, "new_tokens": new_tokens, "seconds": elapsed,
            "tokens_per_s": new_tokens / max(elapsed, 1e-9), "stored_sequences": len(store),
            "stored_tokens": store.num_tokens}
