"""THE lossless test: speculative output equals plain decoding token for token, whatever the drafter.

Greedy: a random DFlash drafter (block sizes 4/8/16) and a noisy oracle proposer (to exercise every accepted
length 0..K) through the batched engine with ragged prompts and a tiny page pool that forces preemption; the
readable single-request loop (spec/reference.py) is the oracle for the engine.  Sampled: with a fixed seed the
sampled tokens equal plain sampled decoding (randomness is tied to positions, see sampling.py), and
test_rejection_sampling.py checks the distribution itself.
"""

import dataclasses

import jax
import numpy as np
import pytest

from specjax.config import EngineConfig
from specjax.drafter.loader import drafter_config_for, init_drafter
from specjax.engine.engine import LLMEngine
from specjax.model.loader import load_model
from specjax.sampling import SamplingParams
from specjax.spec.lookup import LOOKUP_MAX_N
from specjax.spec.proposer import DFlashProposer, NgramProposer, NoProposer
from specjax.spec.reference import dflash_reference_proposer, reference_generate
from tests.helpers import NoisyOracle, random_prompt

MAX_LEN = 96
PROMPT_LENS = [1, 6, 13, 29, 40]
MAX_NEW = [40, 25, 33, 50, 17]


@pytest.fixture(scope="module")
def setup(tiny_dirs):
    target = load_model(tiny_dirs["qwen3"])
    dcfg = drafter_config_for(target.config, num_layers=2, block_size=16, target_layer_ids=(0, 2), mask_token_id=299,
                              mask_embedding=False)
    dweights = init_drafter(dcfg, jax.random.PRNGKey(3), std=0.1)
    rng = np.random.default_rng(11)
    prompts = [random_prompt(rng, n) for n in PROMPT_LENS]
    return target, dcfg, dweights, prompts


def run(target, proposer, pweights, prompts, params, config, **kw):
    engine = LLMEngine(target.config, target.weights, proposer, pweights, config, **kw)
    seqs = engine.generate(prompts, params)
    engine.allocator.check()
    assert engine.allocator.num_used == 0, "pages leaked"
    return seqs, engine


def big_pool(page_size=8, kv_cache_dtype="auto"):
    return EngineConfig(page_size=page_size, max_model_len=MAX_LEN, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)


def padded_engine(target, proposer, pweights, config):
    """An engine with only the largest prefill and decode shapes compiled (K = the first option) and nothing
    compiled on demand: every step runs padded up to them (batch rows, prefill tokens, page-table width)."""
    from specjax.engine.programs import StepShape

    engine = LLMEngine(target.config, target.weights, proposer, pweights, config)
    full = engine.page_buckets[-1]
    built = {StepShape("prefill", engine.prefill_batch_buckets[-1], engine.prefill_buckets[-1], full, "greedy"),
             StepShape("decode", config.max_num_seqs, engine.k_options[0], full, "greedy")}
    for shape in built:
        engine.programs.build_now(shape)
    engine.programs.on_demand = True  # adaptive K: choose among ready programs only ...
    engine.programs.request = lambda shapes: None  # ... and never compile the exact shapes
    return engine, built


@pytest.fixture(scope="module")
def ar_greedy(setup):
    target, _, _, prompts = setup
    # ignore_eos on some requests so that lengths (and page pressure) do not hinge on where EOS happens to fall
    params = [SamplingParams(max_new_tokens=n, ignore_eos=i % 2 == 1) for i, n in enumerate(MAX_NEW)]
    seqs, _ = run(target, NoProposer(), None, prompts, params, big_pool())
    return [s.output_ids for s in seqs], params


def test_ar_engine_equals_reference_loop(setup, ar_greedy):
    target, _, _, prompts = setup
    outs, params = ar_greedy
    for prompt, p, out in zip(prompts, params, outs):
        ref, _ = reference_generate(target.weights, target.config, prompt, p, eos_token_ids=target.config.eos_token_ids,
                                    max_model_len=MAX_LEN)
        assert out == ref
    assert max(len(o) for o in outs) >= 25


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_dflash_greedy_equals_plain_decoding(setup, ar_greedy, block_size):
    target, dcfg, dweights, prompts = setup
    outs, params = ar_greedy
    seqs, _ = run(target, DFlashProposer(dcfg, block_size), dweights, prompts, params, big_pool(page_size=4))
    assert [s.output_ids for s in seqs] == outs
    for s in seqs:
        assert all(1 <= t <= block_size for t in s.stats.acceptance_lengths)


@pytest.mark.parametrize("k", [2, 5])
def test_ngram_greedy_equals_plain_decoding(setup, ar_greedy, k):
    target, _, _, prompts = setup
    outs, params = ar_greedy
    # Repetitive prompts so that lookups hit: the random tiny model often loops as well.
    seqs, _ = run(target, NgramProposer(max_draft_tokens=k), None, prompts, params, big_pool(page_size=4))
    assert [s.output_ids for s in seqs] == outs
    assert any(t > 1 for s in seqs for t in s.stats.acceptance_lengths)


def test_dflash_with_prompt_lookup_equals_plain_decoding(setup, ar_greedy):
    """Prompt lookup standing in for the drafter's block in the rows whose context repeats (lookup_min_match = 1:
    most steps of this looping tiny model, the others the drafter's) changes no token."""
    target, dcfg, dweights, prompts = setup
    outs, params = ar_greedy
    seqs, _ = run(target, DFlashProposer(dcfg, 8), dweights, prompts, params,
                  dataclasses.replace(big_pool(page_size=4), lookup_min_match=1), record_drafts=True)
    assert [s.output_ids for s in seqs] == outs
    lookups = sum(s.stats.lookup_steps for s in seqs)
    assert 0 < lookups < sum(len(s.stats.acceptance_lengths) for s in seqs)
    # the verified drafts were lookup's: what followed the latest earlier match of the context's last tokens
    lookup = NgramProposer(max_draft_tokens=7, min_n=1, max_n=LOOKUP_MAX_N)
    hits = 0
    for seq, prompt in zip(seqs, prompts):
        ids, pos = list(prompt), 0
        for drafts, tau in zip(seq.stats.draft_log, seq.stats.acceptance_lengths):
            ids.append(seq.output_ids[pos])
            proposal = lookup.host_propose(ids, 7)
            # the log keeps the drafts a step may accept (none at the last token: no lookup there either)
            hits += len(drafts) > 0 and len(proposal) == 7 and drafts == proposal[:len(drafts)]
            ids += seq.output_ids[pos + 1:pos + tau]
            pos += tau
    assert hits == lookups


@pytest.mark.parametrize("lookup", [0, 1])
def test_dflash_tiny_page_pool_preempts_and_stays_lossless(setup, ar_greedy, lookup):
    target, dcfg, dweights, prompts = setup
    outs, params = ar_greedy
    # 2-token pages; 50 pages hold ~1 full-length sequence: requests must be preempted and recomputed (with prompt
    # lookup too: a preempted sequence keeps its n-gram index, its tokens only grow)
    config = EngineConfig(page_size=2, num_pages=50, max_model_len=MAX_LEN, max_num_seqs=4, lookup_min_match=lookup)
    seqs, _ = run(target, DFlashProposer(dcfg, 8), dweights, prompts, params, config)
    assert [s.output_ids for s in seqs] == outs
    assert sum(s.stats.num_preemptions for s in seqs) >= 1
    assert (sum(s.stats.lookup_steps for s in seqs) > 0) == bool(lookup)


def test_engine_drafts_equal_reference_loop(setup, ar_greedy):
    """Batched engine vs the cache-free single-request loop: same tokens AND same acceptance per step."""
    target, dcfg, dweights, prompts = setup
    outs, params = ar_greedy
    seqs, _ = run(target, DFlashProposer(dcfg, 8), dweights, prompts[:3], params[:3], big_pool(4))
    propose = dflash_reference_proposer(target.weights, target.config, dcfg, dweights, 8)
    for seq, prompt, p in zip(seqs, prompts, params):
        ref, taus = reference_generate(target.weights, target.config, prompt, p, propose=propose, num_draft=7,
                                       eos_token_ids=target.config.eos_token_ids, max_model_len=MAX_LEN)
        assert seq.output_ids == ref
        assert seq.stats.acceptance_lengths == taus


def test_noisy_oracle_exercises_every_accept_length_and_stays_lossless(setup, ar_greedy):
    target, _, _, prompts = setup
    outs, params = ar_greedy
    oracle = NoisyOracle(prompts, outs, k=5)
    seqs, _ = run(target, oracle, None, prompts, params, EngineConfig(page_size=2, num_pages=50, max_model_len=MAX_LEN,
                                                                       max_num_seqs=3))
    assert [s.output_ids for s in seqs] == outs
    seen = {t for s in seqs for t in s.stats.acceptance_lengths}
    assert seen >= {1, 2, 3, 6}, seen


# One batch, every row its own seed and sampling parameters, a greedy row among them: the batch runs the filtered
# sampler variant, each row under its own transform.
MIXED = [SamplingParams(temperature=0.8, max_new_tokens=30, seed=123),
         SamplingParams(temperature=1.3, top_p=0.85, top_k=20, max_new_tokens=30, seed=7),
         SamplingParams(max_new_tokens=30, ignore_eos=True),
         SamplingParams(temperature=1.0, top_k=5, max_new_tokens=30, seed=99),
         SamplingParams(temperature=0.5, top_p=0.5, max_new_tokens=30, seed=2026)]
# Temperature only (the unfiltered sampler variant, OpenAI's default request), a temperature and seed per row.
UNFILTERED = [SamplingParams(temperature=t, max_new_tokens=30, seed=s)
              for t, s in zip([0.8, 1.0, 1.3, 0.6, 1.1], [123, 5, 77, 2026, 31])]


def test_seeded_sampling_equals_plain_sampling(setup):
    """With fixed seeds, speculative sampling commits exactly the tokens plain sampling draws, row by row, whatever
    the drafts: DFlash's, prompt lookup's, and a noisy oracle's that are often right (long accepted runs)."""
    target, dcfg, dweights, prompts = setup
    plain = {}
    for name, params in (("mixed", MIXED), ("unfiltered", UNFILTERED)):
        seqs, _ = run(target, NoProposer(), None, prompts, params, big_pool())
        plain[name] = [s.output_ids for s in seqs]
        assert len({tuple(p) for p in plain[name]}) == len(prompts)
        oracle = NoisyOracle(prompts, plain[name], k=6)
        noisy, _ = run(target, oracle, None, prompts, params, big_pool(4))
        assert [s.output_ids for s in noisy] == plain[name], name
        assert max(max(s.stats.acceptance_lengths) for s in noisy) >= 4
    spec, _ = run(target, DFlashProposer(dcfg, 8), dweights, prompts, MIXED, big_pool(4))
    assert [s.output_ids for s in spec] == plain["mixed"]
    lookup, _ = run(target, DFlashProposer(dcfg, 8), dweights, prompts, MIXED,
                    dataclasses.replace(big_pool(4), lookup_min_match=1))  # any draft is verified the same way
    assert [s.output_ids for s in lookup] == plain["mixed"] and any(s.stats.lookup_steps for s in lookup)


@pytest.mark.parametrize("adaptive", [False, True])
def test_steps_padded_into_larger_ready_shapes_stay_lossless(setup, ar_greedy, adaptive):
    """With only the largest prefill and decode shapes compiled (and nothing compiled on demand), every step runs
    padded up to them: batch rows, prefill tokens and page-table width.  (Adaptive K can only choose K = 0.)"""
    target, dcfg, dweights, prompts = setup
    outs, params = ar_greedy
    config = EngineConfig(page_size=4, max_model_len=MAX_LEN, max_num_seqs=8, num_draft_tokens=5, adaptive_k=adaptive)
    engine, built = padded_engine(target, DFlashProposer(dcfg, 8), dweights, config)  # K = 0 (adaptive) or 5
    seqs = engine.generate(prompts, params)
    assert [s.output_ids for s in seqs] == outs
    assert engine.programs.foreground_builds == 0 and set(engine.programs.ready) == built
    assert set(engine.programs.runs) == built and engine.num_steps["decode"] > 10
    assert engine.allocator.num_used == 0


@pytest.mark.parametrize("activations,kv_cache_dtype", [("int16", "float32"), ("int16", "auto"), ("int8", "auto")])
def test_integer_kernel_target_stays_lossless_batched_padded_and_preempted(tiny_dirs, tmp_path, activations,
                                                                           kv_cache_dtype):
    """The default CPU runtime of a GGUF target: every product on the int16-activation kernels (and on the int8
    ones, the explicit choice), where a one-ulp
    difference upstream can move an activation across a rounding boundary (docs/results/kflat.md).
    So every row must be computed the same way whatever shares its step: batched plain decoding equals each
    request decoded alone, and DFlash batched (block 8: up to 40 verified rows, wider than the float32 kernels
    take), with only the largest shapes compiled (every step padded), and a noisy oracle with preemption equal it.
    (Not the cache-free reference loop: its dense XLA attention rounds differently from the paged kernel's.)  Over
    a float32 cache and the default float16 one (the kernel rounds each step's own rows as the pool stores them)."""
    from tests.helpers import kernels_expected, write_gguf_from_hf

    path = str(tmp_path / "llama-Q4_1.gguf")  # head_dim 16: every attention on the kernel (qwen3's 24 is not)
    write_gguf_from_hf(tiny_dirs["llama"], path, "Q4_1")
    target = load_model(path, quant_kernels=True, activations=activations)
    if target.kernel_activations != activations:
        assert not kernels_expected(), "the CPU kernels did not build on a machine that has what they need"
        pytest.skip("the CPU kernels cannot run here")
    dcfg = drafter_config_for(target.config, num_layers=2, block_size=8, target_layer_ids=(0, 2), mask_token_id=299,
                              mask_embedding=False)
    dweights = init_drafter(dcfg, jax.random.PRNGKey(3), std=0.1)
    rng = np.random.default_rng(12)
    prompts = [random_prompt(rng, n) for n in PROMPT_LENS]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    ar, engine = run(target, NoProposer(), None, prompts, params, big_pool(kv_cache_dtype=kv_cache_dtype))
    assert engine.kv.k[0].dtype == ("float16" if kv_cache_dtype == "auto" else kv_cache_dtype)  # llama.cpp's cache
    assert engine.decode_pages_free  # decode steps read the pages in place: on the kernel, 16-bit pools too
    outs = [s.output_ids for s in ar]
    alone = EngineConfig(page_size=8, max_model_len=MAX_LEN, max_num_seqs=1, kv_cache_dtype=kv_cache_dtype)
    for i in (1, 3):
        [seq], _ = run(target, NoProposer(), None, prompts[i:i + 1], params[i:i + 1], alone)
        assert seq.output_ids == outs[i]
    spec, _ = run(target, DFlashProposer(dcfg, 8), dweights, prompts, params,
                  big_pool(page_size=4, kv_cache_dtype=kv_cache_dtype))
    assert [s.output_ids for s in spec] == outs
    config = EngineConfig(page_size=4, max_model_len=MAX_LEN, max_num_seqs=8, num_draft_tokens=7,
                          kv_cache_dtype=kv_cache_dtype)
    engine, built = padded_engine(target, DFlashProposer(dcfg, 8), dweights, config)
    assert [s.output_ids for s in engine.generate(prompts, params)] == outs
    assert set(engine.programs.runs) == built
    config = EngineConfig(page_size=2, num_pages=50, max_model_len=MAX_LEN, max_num_seqs=4,
                          kv_cache_dtype=kv_cache_dtype)
    seqs, _ = run(target, NoisyOracle(prompts, outs, k=5), None, prompts, params, config)
    assert [s.output_ids for s in seqs] == outs
    assert sum(s.stats.num_preemptions for s in seqs) >= 1
