"""Compile once per shape bucket: after warm-up (ahead, or in the background), generation compiles nothing."""

import jax
import pytest

from specjax.config import EngineConfig
from specjax.drafter.loader import drafter_config_for, init_drafter
from specjax.engine import runner
from specjax.engine.engine import LLMEngine
from specjax.model.loader import load_model
from specjax.sampling import GREEDY, SamplingParams
from specjax.spec.proposer import DFlashProposer


@pytest.fixture(scope="module")
def parts(tiny_dirs):
    target = load_model(tiny_dirs["llama"])
    dcfg = drafter_config_for(target.config, num_layers=1, block_size=4, target_layer_ids=(1, 2), mask_token_id=299)
    return target, dcfg, init_drafter(dcfg, jax.random.PRNGKey(0))


def make_engine(parts):
    target, dcfg, dw = parts
    return LLMEngine(target.config, target.weights, DFlashProposer(dcfg, 4), dw,
                     EngineConfig(page_size=4, max_model_len=128, max_num_seqs=1, prefill_chunk=32))


def jit_cache_sizes():
    return runner.prefill_step._cache_size(), runner.decode_step._cache_size(), runner.commit._cache_size()


PROMPT, NEW = list(range(3, 50)), 60


@pytest.mark.parametrize("background", [False, True])
def test_no_compile_after_warmup(parts, background):
    engine = make_engine(parts)
    seen = []  # the progress callback sees every shape built now, in order, with the total known from the start
    n = engine.warmup(len(PROMPT), len(PROMPT) + NEW, modes=(GREEDY,), progress=lambda d, t: seen.append((d, t)),
                      background=background)
    assert n >= 2 and seen == [(i, n) for i in range(1, n + 1)]
    if background:
        assert n == 2 and engine.programs.pending() > 0
        assert engine.programs.wait_idle(300)
    built, sizes = set(engine.programs.ready), jit_cache_sizes()
    assert len(built) >= 4  # prefill chunks of 16 and 32 tokens, decode at 16 and 32 pages
    [seq] = engine.generate([PROMPT], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert len(seq.output_ids) == NEW
    assert engine.programs.foreground_builds == 0 and set(engine.programs.ready) == built
    assert jit_cache_sizes() == sizes


def test_without_warmup_each_shape_compiles_once_when_first_needed(parts):
    engine = make_engine(parts)
    engine.generate([PROMPT], SamplingParams(max_new_tokens=20, ignore_eos=True))
    first = engine.programs.foreground_builds
    assert first == len(engine.programs.ready) > 0
    engine.generate([PROMPT], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert engine.programs.foreground_builds == first
