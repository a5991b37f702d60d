"""Compile once per shape bucket: after warm-up, steady-state generation triggers no new trace."""

import jax

from specjax.config import EngineConfig
from specjax.drafter.loader import drafter_config_for, init_drafter
from specjax.engine import runner
from specjax.engine.engine import LLMEngine
from specjax.model.loader import load_model
from specjax.sampling import GREEDY, SamplingParams
from specjax.spec.proposer import DFlashProposer


def test_no_retrace_after_warmup(tiny_dirs):
    target = load_model(tiny_dirs["llama"])
    dcfg = drafter_config_for(target.config, num_layers=1, block_size=4, target_layer_ids=(1, 2), mask_token_id=299)
    dw = init_drafter(dcfg, jax.random.PRNGKey(0))
    engine = LLMEngine(target.config, target.weights, DFlashProposer(dcfg, 4), dw,
                       EngineConfig(page_size=4, max_model_len=128, max_num_seqs=1, prefill_chunk=32))
    prompt, new = list(range(3, 50)), 60
    seen = []  # the progress callback sees every shape, in order, with the total known from the start
    n = engine.warmup(len(prompt), len(prompt) + new, modes=(GREEDY,), progress=lambda d, t: seen.append((d, t)))
    assert n > 1 and seen == [(i, n) for i in range(1, n + 1)]
    sizes = (runner.prefill_step._cache_size(), runner.decode_step._cache_size(), runner.commit._cache_size())
    [seq] = engine.generate([prompt], SamplingParams(max_new_tokens=new, ignore_eos=True))
    assert len(seq.output_ids) == new
    assert (runner.prefill_step._cache_size(), runner.decode_step._cache_size(),
            runner.commit._cache_size()) == sizes
