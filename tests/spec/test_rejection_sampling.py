"""Speculative sampling reproduces the target distribution (statistical tests with fixed seeds).

Unit level: `accept` on fixed logits, 100k seeds, checking the first token's marginal, the residual after a
rejection and the next token after an acceptance, with and without top-k/top-p.  End to end: the engine with a
proposer whose drafts are often accepted, against the exact joint distribution of the first tokens computed by
enumerating the target's prefixes.  Thresholds come from a parametric bootstrap of the total-variation distance
under the null, so they neither need scipy nor depend on a guessed constant.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import EngineConfig
from specjax.drafter.eagle3 import Eagle3Params
from specjax.drafter.eagle3_loader import eagle3_config_for, init_eagle3
from specjax.drafter.loader import drafter_config_for, init_drafter
from specjax.engine.engine import LLMEngine
from specjax.model.loader import load_hf_dir
from specjax.sampling import SAMPLE, SAMPLE_FILTERED, SamplingParams, first_argmax
from specjax.spec.proposer import DFlashProposer, Eagle3Proposer, HostProposer, NgramProposer
from specjax.spec.reference import full_forward
from specjax.spec.verify import accept
from tests.helpers import make_hf_checkpoint


def tv(p, q):
    return 0.5 * np.abs(np.asarray(p) - np.asarray(q)).sum()


def tv_threshold(p, n, rng, quantile=0.999, reps=400):
    """The `quantile` of TV(empirical of n draws from p, p): what chance alone produces."""
    draws = rng.multinomial(n, p, size=reps) / n
    return float(np.quantile(0.5 * np.abs(draws - p).sum(-1), quantile))


def np_filtered_probs(logits, temperature, top_k, top_p):
    """Independent numpy statement of the sampling distribution (temperature, then top-k, then top-p)."""
    x = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros_like(x, bool)
    keep[order[:top_k] if top_k else order] = True
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    sorted_p = p[order]
    mass_above = np.cumsum(sorted_p) - sorted_p
    nucleus = np.zeros_like(keep)
    nucleus[order[mass_above < top_p]] = True
    p = np.where(keep & nucleus, p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.2, 5, 0.9)])
def test_accept_reproduces_target_distribution(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    v, k, n = 8, 2, 100_000
    logits = rng.normal(size=(k + 1, v)).astype(np.float32) * 1.5
    drafts = np.array([int(np.argsort(-logits[0])[1]), int(np.argmax(logits[1]))])  # a plausible, imperfect draft
    mode = SAMPLE_FILTERED if top_k or top_p < 1 else SAMPLE
    run = jax.jit(jax.vmap(lambda seed: accept(
        jnp.asarray(logits)[None], jnp.asarray(drafts)[None], jnp.asarray([k]), jnp.asarray([10]),
        jnp.asarray([temperature]), jnp.asarray([top_k]), jnp.asarray([top_p]), seed[None], mode)))
    num_accepted, tokens = run(jnp.arange(n, dtype=jnp.int32))
    a, toks = np.asarray(num_accepted)[:, 0], np.asarray(tokens)[:, 0]
    p0, p1 = (np_filtered_probs(logits[j], temperature, top_k, top_p) for j in (0, 1))

    first = toks[:, 0]  # the first committed token: the accepted draft or the residual sample
    assert tv(np.bincount(first, minlength=v) / n, p0) < tv_threshold(p0, n, rng)
    rejected = a == 0  # residual: p0 without the draft, renormalised
    residual = np.where(np.arange(v) == drafts[0], 0.0, p0) / (1 - p0[drafts[0]])
    emp = np.bincount(first[rejected], minlength=v) / rejected.sum()
    assert emp[drafts[0]] == 0
    assert tv(emp, residual) < tv_threshold(residual, int(rejected.sum()), rng)
    assert abs(rejected.mean() - (1 - p0[drafts[0]])) < 5 * np.sqrt(p0[drafts[0]] * (1 - p0[drafts[0]]) / n)
    after = a >= 1  # draft 0 accepted: the next committed token follows p1 (accepted draft or residual)
    emp = np.bincount(toks[after, 1], minlength=v) / after.sum()
    assert tv(emp, p1) < tv_threshold(p1, int(after.sum()), rng)


def test_top_k_one_equals_greedy():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, 1, 50)).astype(np.float32))
    _, toks = accept(logits, jnp.zeros((4, 0), jnp.int32), jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32),
                     jnp.full(4, 0.9), jnp.ones(4, jnp.int32), jnp.ones(4), jnp.arange(4), SAMPLE_FILTERED)
    np.testing.assert_array_equal(np.asarray(toks)[:, 0], np.asarray(logits).argmax(-1)[:, 0])


def test_first_argmax_equals_numpy_argmax_with_ties_infinities_and_nan():
    rng = np.random.default_rng(2)
    x = rng.integers(-3, 4, size=(6, 5, 300)).astype(np.float32)  # many ties: the first maximum must win
    x[0, 0] = -np.inf
    x[1, 1, 7] = np.inf
    x[1, 2, [9, 40]] = np.nan  # the first NaN wins, as in numpy and jnp.argmax
    x[2, 3, :] = np.nan
    for axis in (-1, 0, 1):
        got = np.asarray(jax.jit(first_argmax, static_argnums=1)(jnp.asarray(x), axis))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, x.argmax(axis))


class ArgmaxChain(HostProposer):
    """Host proposer drafting the target's own argmax chain: at T > 0 these drafts are accepted often but not
    always, so the end-to-end test covers acceptance, rejection with residual, and the bonus token."""

    name = "argmax-chain"

    def __init__(self, weights, cfg, k):
        self.weights, self.cfg, self.max_draft_tokens = weights, cfg, k

    def host_propose(self, token_ids, k):
        seq = list(token_ids)
        for _ in range(k):
            logits, _ = full_forward(self.weights, self.cfg, seq)
            seq.append(int(np.argmax(logits[-1])))
        return seq[len(token_ids):]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["argmax-chain", "ngram", "dflash", "eagle3"])
def test_engine_sampling_matches_exact_target_distribution(tmp_path, method):
    path = make_hf_checkpoint("llama", str(tmp_path / "v16"), seed=4, vocab_size=16, bos_token_id=0, eos_token_id=15)
    target = load_hf_dir(path)
    w, cfg = target.weights, target.config
    params = dict(temperature=0.9, top_p=0.95, max_new_tokens=3, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5]

    # Exact joint distribution of the first three tokens by enumerating every prefix.
    def probs(seq, pos):
        logits, _ = full_forward(w, cfg, seq)
        return np_filtered_probs(logits[-1], params["temperature"], 0, params["top_p"])

    v = cfg.vocab_size
    exact = np.zeros((v, v, v))
    p1 = probs(prompt, len(prompt))
    for a in range(v):
        if p1[a] == 0:
            continue
        p2 = probs(prompt + [a], 0)
        for b in range(v):
            if p2[b] > 0:
                exact[a, b] = p1[a] * p2[b] * probs(prompt + [a, b], 0)
    assert abs(exact.sum() - 1) < 1e-5

    n = 2000
    pweights = None
    if method == "argmax-chain":
        proposer = ArgmaxChain(w, cfg, k=3)
    elif method == "ngram":
        proposer = NgramProposer(max_draft_tokens=3)
    elif method == "eagle3":
        ecfg = eagle3_config_for(cfg, aux_ids=(1, 2, 3))
        proposer = Eagle3Proposer(ecfg, 3)
        pweights = Eagle3Params(init_eagle3(ecfg, jax.random.PRNGKey(0), std=0.3), w.embed)
    else:
        dcfg = drafter_config_for(cfg, num_layers=1, block_size=4, target_layer_ids=(1, 2), mask_token_id=14)
        proposer, pweights = DFlashProposer(dcfg, 4), init_drafter(dcfg, jax.random.PRNGKey(0), std=0.3)
    engine = LLMEngine(cfg, w, proposer, pweights, EngineConfig(page_size=4, max_model_len=32, max_num_seqs=16))
    seqs = engine.generate([prompt] * n, [SamplingParams(seed=i, **params) for i in range(n)])
    samples = np.array([s.output_ids for s in seqs])
    taus = [t for s in seqs for t in s.stats.acceptance_lengths]
    # After the prefill token two remain: one draft per step; it is accepted (tau 2) and rejected (tau 1).
    assert set(taus) == {1, 2}

    rng = np.random.default_rng(0)
    for i, axes in enumerate([(1, 2), (0, 2), (0, 1)]):
        p = exact.sum(axis=axes)
        emp = np.bincount(samples[:, i], minlength=v) / n
        assert tv(emp, p) < tv_threshold(p, n, rng), f"token {i + 1}"
    pair = exact.sum(axis=2).reshape(-1)
    emp = np.bincount(samples[:, 0] * v + samples[:, 1], minlength=v * v) / n
    assert tv(emp, pair) < tv_threshold(pair, n, rng), "tokens 1-2 jointly"
    assert len(set(itertools.chain.from_iterable(samples.tolist()))) > 3
