"""Prefix caching: requests that share a prompt prefix reuse its KV pages (target and drafter rows) and answer
exactly as without the cache, under plain decoding, DFlash and EAGLE-3 (whose cache rows pair a position with the
token after it); pages are neither leaked nor written while shared, through preemption, abort and eviction."""

import dataclasses

import jax
import numpy as np
import pytest

from specjax.config import EngineConfig
from specjax.drafter.eagle3 import Eagle3Params
from specjax.drafter.eagle3_loader import eagle3_config_for, init_eagle3
from specjax.drafter.loader import drafter_config_for, init_drafter
from specjax.engine.engine import LLMEngine
from specjax.kv.allocator import page_hashes
from specjax.model.loader import load_model
from specjax.sampling import SamplingParams
from specjax.spec.proposer import DFlashProposer, Eagle3Proposer
from tests.helpers import random_prompt

RNG = np.random.default_rng(21)
SYSTEM = random_prompt(RNG, 37)  # a shared "system prompt": 4 full pages of 8 and 5 tokens
PROMPTS = [SYSTEM + random_prompt(RNG, n) for n in (3, 12, 1, 20)] + [SYSTEM[:30]]
CONFIG = EngineConfig(max_model_len=128, page_size=8, max_num_seqs=4, prefill_chunk=16, adaptive_k=False)
GREEDY = SamplingParams(max_new_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return load_model(tiny_dirs["qwen3"])


def proposers(target):
    dcfg = drafter_config_for(target.config, num_layers=1, block_size=4)
    ecfg = eagle3_config_for(target.config, draft_vocab_size=120, aux_ids=(1, 2, 3))
    eweights = init_eagle3(ecfg, jax.random.PRNGKey(4), draft_token_ids=np.arange(120), std=0.15)
    return {"ar": (None, None),
            "dflash": (DFlashProposer(dcfg, 4), init_drafter(dcfg, jax.random.PRNGKey(0))),
            "eagle3": (Eagle3Proposer(ecfg, 3), Eagle3Params(eweights, target.weights.embed))}


def generate_one_by_one(engine, prompts, params):
    """Each request alone, in order: every later one finds the earlier ones' pages cached."""
    out = [engine.generate([p], params)[0] for p in prompts]
    engine.allocator.check()
    assert engine.allocator.num_used == 0, "pages leaked"
    return out


@pytest.mark.parametrize("method", ["ar", "dflash", "eagle3"])
def test_cache_hits_answer_exactly_as_without_the_cache(target, method):
    proposer, pweights = proposers(target)[method]
    plain = LLMEngine(target.config, target.weights, proposer, pweights,
                      dataclasses.replace(CONFIG, prefix_caching=False))
    cached = LLMEngine(target.config, target.weights, proposer, pweights, CONFIG)
    want = generate_one_by_one(plain, PROMPTS, GREEDY)
    got = generate_one_by_one(cached, PROMPTS, GREEDY)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert plain.prefix_cache_stats["hit_tokens"] == 0 and plain.allocator.num_cached == 0
    # the system prompt's 4 full pages for every later request; the last one (30 tokens of it) hits 3 pages
    assert [s.stats.cached_tokens for s in got] == [0, 32, 32, 32, 24]
    assert cached.prefix_cache_stats["hit_tokens"] == 120
    if method != "ar":
        assert sum(s.stats.num_drafted for s in got) > 0
    # a request's own earlier answer is cached too: asking the first prompt + its answer again hits it all
    again = PROMPTS[0] + got[0].output_ids
    [second] = cached.generate([again], GREEDY)
    assert second.stats.cached_tokens == (len(again) - 1) // 8 * 8
    [second_plain] = plain.generate([again], GREEDY)
    assert second.output_ids == second_plain.output_ids


def test_batched_requests_preemption_abort_and_eviction_leak_nothing(target):
    """A pool of 14 pages (4 sequences of up to 6): requests batched together preempt each other and evict cached
    pages; one is aborted mid-way.  Outputs equal the cacheless engine's, and every page comes back."""
    proposer, pweights = proposers(target)["dflash"]
    small = dataclasses.replace(CONFIG, num_pages=14, max_model_len=64)
    prompts = [p[:40] for p in PROMPTS[:4]] * 2
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = LLMEngine(target.config, target.weights, proposer, pweights, dataclasses.replace(small,
                                                                                             prefix_caching=False))
    want = [s.output_ids for s in plain.generate(prompts, params)]
    engine = LLMEngine(target.config, target.weights, proposer, pweights, small)
    ids = [engine.add_request(p, params) for p in prompts]
    victim = engine.add_request(prompts[0], params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        engine.allocator.check()
        steps += 1
        if steps == 6:
            engine.abort(victim)
    assert [engine.seqs[i].output_ids for i in ids] == want
    assert engine.num_preemptions > 0 and sum(engine.seqs[i].stats.cached_tokens for i in ids) > 0
    assert engine.allocator.num_used == 0 and engine.allocator.num_cached > 0
    # fill the pool with other prefixes: the cached pages are evicted, least recently used first
    cached_before = len(engine.allocator.lookup(page_hashes(prompts[0], 8, 0, 4)))
    others = [random_prompt(RNG, 40) for _ in range(4)]
    engine.generate(others, params)
    engine.allocator.check()
    assert engine.allocator.num_used == 0
    assert cached_before == 4 and len(engine.allocator.lookup(page_hashes(prompts[0], 8, 0, 4))) < 4
    [again] = engine.generate([prompts[0]], params)
    assert again.output_ids == want[0]


def test_sibling_requests_share_the_first_ones_prefill(target):
    engine = LLMEngine(target.config, target.weights, config=CONFIG)
    first = engine.add_request(PROMPTS[3], GREEDY)
    siblings = [engine.add_request(PROMPTS[3], GREEDY, after=first) for _ in range(3)]
    while engine.has_unfinished():
        engine.step()
    outs = [engine.seqs[i] for i in [first, *siblings]]
    assert all(s.output_ids == outs[0].output_ids for s in outs)
    assert [s.stats.cached_tokens for s in outs] == [0] + [len(PROMPTS[3]) // 8 * 8] * 3
    engine.allocator.check()
