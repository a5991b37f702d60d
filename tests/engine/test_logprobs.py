"""Log-probabilities of emitted and prompt tokens: against a float32 `transformers` forward of the whole sequence (the
oracle), equal with and without speculation (batched, greedy and seeded sampling), and the sampling transform they
are taken under."""

import numpy as np
import pytest

from specjax.config import EngineConfig
from specjax.engine.engine import LLMEngine
from specjax.model.loader import load_model
from specjax.sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from tests.helpers import NoisyOracle, hf_forward, load_hf_torch, random_prompt

RNG = np.random.default_rng(5)
PROMPTS = [random_prompt(RNG, n) for n in (3, 11, 21)]  # 21 > the prefill chunk of 16
CONFIG = EngineConfig(max_model_len=96, page_size=8, max_num_seqs=4, prefill_chunk=16, adaptive_k=False)


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return load_model(tiny_dirs["qwen3"])


def plain_and_speculative(target, params):
    """The same requests, batched, by plain decoding and by speculation with every accepted length 0..4 (a noisy
    oracle of plain decoding's tokens)."""
    ar = LLMEngine(target.config, target.weights, config=CONFIG).generate(PROMPTS, params)
    oracle = NoisyOracle(PROMPTS, [s.output_ids for s in ar], k=4, noise=0.3)
    spec = LLMEngine(target.config, target.weights, oracle, config=CONFIG).generate(PROMPTS, params)
    assert [s.output_ids for s in spec] == [s.output_ids for s in ar]
    assert sum(s.stats.num_accepted for s in spec) >= 10, "few drafts accepted: speculation barely tested"
    return ar, spec


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_greedy_logprobs_match_the_model_and_do_not_depend_on_speculation(tiny_dirs, target):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    ar, spec = plain_and_speculative(target, params)
    hf = load_hf_torch(tiny_dirs["qwen3"])
    for a, s, prompt in zip(ar, spec, PROMPTS):
        assert len(a.logprobs) == len(a.output_ids) == 12 and len(a.prompt_logprobs) == len(prompt)
        logits, _ = hf_forward(hf, prompt + a.output_ids)
        want = log_softmax(logits.astype(np.float64))
        ids = prompt + a.output_ids
        for result in (a, s):
            got = [e.logprob for e in result.logprobs]
            np.testing.assert_allclose(got, [want[len(prompt) - 1 + j, t] for j, t in enumerate(a.output_ids)],
                                       atol=2e-4)
            assert result.prompt_logprobs[0] is None
            np.testing.assert_allclose([e.logprob for e in result.prompt_logprobs[1:]],
                                       [want[p - 1, ids[p]] for p in range(1, len(prompt))], atol=2e-4)
            for e, row in zip(result.logprobs, want[len(prompt) - 1:]):
                assert len(e.top) == 3 and e.top[0][0] == e.token_id  # greedy: the emitted token is the most likely
                assert [t for t, _ in e.top] == list(np.argsort(-row, kind="stable")[:3])
                np.testing.assert_allclose([lp for _, lp in e.top], np.sort(row)[::-1][:3], atol=2e-4)
            assert all(len(e.top) == 2 for e in result.prompt_logprobs[1:])


def test_sampled_logprobs_are_the_sampling_distributions_and_equal_with_speculation(tiny_dirs, target):
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=7, max_new_tokens=10, ignore_eos=True,
                             logprobs=MAX_LOGPROBS),
              SamplingParams(temperature=1.3, seed=8, max_new_tokens=10, ignore_eos=True, logprobs=0),
              SamplingParams(max_new_tokens=10, ignore_eos=True)]  # no logprobs asked: none returned
    ar, spec = plain_and_speculative(target, params)
    assert ar[2].logprobs is None and spec[2].logprobs is None and ar[0].prompt_logprobs is None
    for a, s in zip(ar[:2], spec[:2]):
        np.testing.assert_allclose([e.logprob for e in a.logprobs], [e.logprob for e in s.logprobs], atol=1e-4)
    hf = load_hf_torch(tiny_dirs["qwen3"])
    # request 0: temperature 0.8, then top-k 40, then the top-0.9 nucleus; tokens outside it have -inf
    logits, _ = hf_forward(hf, PROMPTS[0] + ar[0].output_ids)
    for j, e in enumerate(ar[0].logprobs):
        x = logits[len(PROMPTS[0]) - 1 + j].astype(np.float64) / 0.8
        order = np.argsort(-x, kind="stable")
        p = np.exp(log_softmax(x[order[:40]]))
        keep = order[:40][(np.cumsum(p) - p) < 0.9]
        want = np.full_like(x, -np.inf)
        want[keep] = log_softmax(x[keep])
        assert np.isfinite(e.logprob)
        np.testing.assert_allclose(e.logprob, want[e.token_id], atol=2e-4)
        assert len(e.top) == MAX_LOGPROBS
        finite = [(t, lp) for t, lp in e.top if np.isfinite(lp)]
        assert [t for t, _ in finite] == list(keep[:MAX_LOGPROBS])
    # request 1: temperature 1.3 alone, no alternatives asked
    logits, _ = hf_forward(hf, PROMPTS[1] + ar[1].output_ids)
    want = log_softmax(logits.astype(np.float64) / 1.3)
    np.testing.assert_allclose([e.logprob for e in ar[1].logprobs],
                               [want[len(PROMPTS[1]) - 1 + j, t] for j, t in enumerate(ar[1].output_ids)], atol=2e-4)
    assert all(e.top == () for e in ar[1].logprobs)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 1.5])
def test_bad_logprob_counts_are_refused(field, value):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**{field: value})
