"""Tau of a drafter measured with the real speculative engine (greedy generation on held-out prompts)."""

from __future__ import annotations

import numpy as np

from specjax.config import EngineConfig


def evaluate_tau(target, proposer, params, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Greedy speculative generation with the real engine on held-out prompts -> tau and per-position acceptance."""
    from specjax.engine.engine import LLMEngine
    from specjax.sampling import SamplingParams

    k = proposer.max_draft_tokens
    max_len = max(len(p) for p in prompts) + max_new_tokens + k + 2
    engine = LLMEngine(target.config, target.weights, proposer, params,
                       EngineConfig(max_model_len=-(-max_len // 64) * 64, max_num_seqs=min(8, len(prompts))))
    seqs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    taus = [t for s in seqs for t in s.stats.acceptance_lengths]
    drafted = np.zeros(k)
    accepted = np.zeros(k)
    for s in seqs:
        n = len(s.stats.drafted_per_position)
        drafted[:n] += s.stats.drafted_per_position
        accepted[:n] += s.stats.accepted_per_position
    return {"tau": float(np.mean(taus)) if taus else 0.0, "steps": len(taus),
            "per_position": [float(a / d) if d else 0.0 for a, d in zip(accepted, drafted)]}
