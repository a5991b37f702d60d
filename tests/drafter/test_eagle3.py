"""EAGLE-3: parity with a plain numpy statement of the same math, checkpoint round trip and errors, lossless."""

import json
import shutil

import jax
import numpy as np
import pytest

from specjax.config import ConfigError, EngineConfig
from specjax.drafter.eagle3 import Eagle3Params
from specjax.drafter.eagle3_loader import eagle3_config_for, init_eagle3, load_eagle3, save_eagle3
from specjax.engine.engine import LLMEngine
from specjax.model.loader import CheckpointError, load_model
from specjax.sampling import SamplingParams
from specjax.spec.proposer import Eagle3Proposer
from specjax.spec.reference import full_forward
from tests.helpers import adam_losses, random_prompt
from tests.reference import eagle3_numpy


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    target = load_model(tiny_dirs["llama"])
    vocab_ids = np.sort(np.random.default_rng(0).choice(300, size=120, replace=False))  # a reduced draft vocab
    cfg = eagle3_config_for(target.config, draft_vocab_size=120, aux_ids=(1, 2, 3))
    weights = init_eagle3(cfg, jax.random.PRNGKey(4), draft_token_ids=vocab_ids, std=0.15)
    path = str(tmp_path_factory.mktemp("eagle3"))
    save_eagle3(path, cfg, weights, target.config.num_layers)
    cfg2, weights2 = load_eagle3(path, target.config)
    assert cfg2 == cfg
    return target, cfg2, weights2, path


def test_engine_drafts_match_numpy_reference_every_step(setup):
    target, cfg, weights, _ = setup
    prompt = random_prompt(np.random.default_rng(2), 9)
    engine = LLMEngine(target.config, target.weights, Eagle3Proposer(cfg, 3),
                       Eagle3Params(weights, target.weights.embed),
                       EngineConfig(page_size=4, max_model_len=64, max_num_seqs=1), record_drafts=True)
    # the drafter's view of the target's embedding stays the same array (counted once), committed with the rest
    assert engine.pweights.embed is engine.tweights.embed and engine.tweights.embed.committed
    [seq] = engine.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))
    tokens = prompt + seq.output_ids
    s = len(prompt)  # the first decode step's bonus position
    _, taps = full_forward(target.weights, target.config, tokens, cfg.hidden_state_indices)
    for drafts, tau in zip(seq.stats.draft_log, seq.stats.acceptance_lengths):
        ref = eagle3_numpy.draft(weights, cfg, target.weights.embed, np.asarray(taps), tokens[:s + 1], len(drafts))
        assert drafts == ref, f"step at s={s}"
        s += tau
    assert all(0 <= d < 300 for ds in seq.stats.draft_log for d in ds)


def test_speculators_layout_and_errors(setup, tmp_path):
    from safetensors.numpy import load_file, save_file

    target, cfg, weights, path = setup
    alias = tmp_path / "spec"
    shutil.copytree(path, alias)
    tensors = load_file(str(alias / "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    renamed["embed_tokens.weight"] = np.zeros((300, 64), np.float32)  # a copy of the target's table: ignored
    save_file(renamed, str(alias / "model.safetensors"))
    cfg2, w2 = load_eagle3(str(alias), target.config)
    np.testing.assert_array_equal(np.asarray(w2.w_q), np.asarray(weights.w_q))
    del renamed["layers.0.mlp.up_proj.weight"]
    save_file(renamed, str(alias / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing EAGLE-3 tensor 'midlayer.mlp.up_proj.weight'"):
        load_eagle3(str(alias), target.config)
    conf = json.loads((alias / "config.json").read_text())
    (alias / "config.json").write_text(json.dumps({**conf, "vocab_size": 128256}))
    with pytest.raises(ConfigError, match="EAGLE-3 vocab_size=128256 does not match the target's 300"):
        load_eagle3(str(alias), target.config)


@pytest.mark.parametrize("lookup", [0, 1])
def test_eagle3_is_lossless_greedy_and_seeded(setup, lookup):
    """Plain and with prompt lookup standing in for the chain where the context repeats (a CPU's default)."""
    target, cfg, weights, _ = setup
    rng = np.random.default_rng(7)
    prompts = [random_prompt(rng, n) for n in (3, 11, 20)]
    for params in (SamplingParams(max_new_tokens=30, ignore_eos=True),
                   SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)):
        base = LLMEngine(target.config, target.weights, config=EngineConfig(page_size=4, max_model_len=64))
        expected = [s.output_ids for s in base.generate(prompts, params)]
        engine = LLMEngine(target.config, target.weights, Eagle3Proposer(cfg, 4),
                           Eagle3Params(weights, target.weights.embed),
                           EngineConfig(page_size=4, num_pages=30, max_model_len=64, max_num_seqs=3,
                                        lookup_min_match=lookup))
        seqs = engine.generate(prompts, params)
        assert [s.output_ids for s in seqs] == expected
        assert (sum(s.stats.lookup_steps for s in seqs) > 0) == bool(lookup)
        assert engine.allocator.num_used == 0


def test_ttt_rows_equal_the_teacher_forced_inference_chain(setup):
    """Row (p, step k) of training-time test == chain row k + 1 started after real position p - k, with the true
    tokens fed in (numpy reference), for every k and several p."""
    import jax.numpy as jnp

    from specjax.train.eagle3_objective import ttt_logits

    target, cfg, weights, _ = setup
    tokens = random_prompt(np.random.default_rng(8), 20)
    _, taps = full_forward(target.weights, target.config, tokens, cfg.hidden_state_indices)
    steps = 4
    logits = [np.asarray(x)[0] for x in ttt_logits(weights, cfg, target.weights.embed, jnp.asarray([tokens]),
                                                     jnp.asarray(taps)[None], steps)]
    for p in (6, 11, 16):
        for k in range(steps):
            p0 = p - k  # last real row of the chain
            _, ref = eagle3_numpy.draft(weights, cfg, target.weights.embed, np.asarray(taps), tokens[:p0 + 2], k + 1,
                                        forced=tokens[p0 + 2:p0 + 2 + k], return_logits=True)
            np.testing.assert_allclose(logits[k][p], ref[k], atol=2e-4, rtol=1e-4, err_msg=f"p={p} k={k}")


def test_ttt_acceptance_equals_leading_matches_of_the_inference_chain(setup):
    """Simulated acceptance (held-out tau during training) at every anchor == the leading drafts of the numpy
    inference chain that equal the true continuation; one anchor is rigged to accept exactly 2 of 3."""
    import jax.numpy as jnp

    from specjax.train.eagle3_objective import ttt_acceptance

    target, cfg, weights, _ = setup
    steps, a0 = 3, 9
    rng = np.random.default_rng(10)
    seqs = [random_prompt(rng, 22), random_prompt(rng, 15)]
    _, taps0 = full_forward(target.weights, target.config, seqs[0], cfg.hidden_state_indices)
    drafts = eagle3_numpy.draft(weights, cfg, target.weights.embed, np.asarray(taps0), seqs[0][:a0 + 1], steps)
    seqs[0][a0 + 1:a0 + 3] = drafts[:2]  # taps before a0 (all the chain reads) are unchanged by this
    seqs[0][a0 + 3] = (drafts[2] + 1) % 300
    tokens = np.zeros((2, 24), np.int32)
    taps = np.zeros((2, 24, taps0.shape[-1]), np.float32)
    mask = np.zeros((2, 24), bool)
    for i, t in enumerate(seqs):
        tokens[i, :len(t)] = t
        taps[i, :len(t)] = np.asarray(full_forward(target.weights, target.config, t, cfg.hidden_state_indices)[1])
        mask[i, 4:len(t)] = True
    lengths = np.array([len(t) for t in seqs], np.int32)
    anchors = np.zeros((2, 20), np.int32)
    keep = np.zeros((2, 20), bool)
    for i, n in enumerate(lengths):
        valid = np.arange(4, n - steps)  # a <= length - (steps + 1)
        anchors[i, :len(valid)], keep[i, :len(valid)] = valid, True
    t2d = -np.ones(300, np.int32)
    t2d[np.arange(120) + np.asarray(weights.d2t)] = np.arange(120)
    accepted, counted = (np.asarray(x) for x in ttt_acceptance(
        weights, cfg, target.weights.embed, jnp.asarray(tokens), jnp.asarray(taps), jnp.asarray(mask),
        jnp.asarray(lengths), jnp.asarray(anchors), jnp.asarray(keep), jnp.asarray(t2d), steps))
    np.testing.assert_array_equal(counted, keep)
    assert accepted[0, list(anchors[0]).index(a0)] == 2
    for i, t in enumerate(seqs):
        for j in np.nonzero(keep[i])[0]:
            a = int(anchors[i, j])
            ref = eagle3_numpy.draft(weights, cfg, target.weights.embed, taps[i], t[:a + 1], steps)
            n = 0
            while n < steps and ref[n] == t[a + 1 + n]:
                n += 1
            assert accepted[i, j] == n, f"seq {i} anchor {a}"


def test_ttt_loss_decreases(setup):
    import jax.numpy as jnp

    from specjax.train.eagle3_objective import ttt_loss

    target, cfg, weights, _ = setup
    rng = np.random.default_rng(1)
    tokens = np.stack([random_prompt(rng, 24) for _ in range(2)]).astype(np.int32)
    taps = np.stack([np.asarray(full_forward(target.weights, target.config, list(t), cfg.hidden_state_indices)[1])
                     for t in tokens])
    t2d = -np.ones(300, np.int32)
    ids = np.arange(120) + np.asarray(weights.d2t)
    t2d[ids] = np.arange(120)
    mask = np.ones_like(tokens, bool)
    lengths = np.full(2, 24, np.int32)
    args = (target.weights.embed, jnp.asarray(tokens), jnp.asarray(taps), jnp.asarray(mask), jnp.asarray(lengths),
            jnp.asarray(t2d))
    import dataclasses

    weights = dataclasses.replace(weights, d2t=None)  # integer map: not a trainable leaf
    losses = adam_losses(lambda w_: ttt_loss(w_, cfg, *args, steps=3), weights, 25)
    assert losses[-1] < 0.7 * losses[0], losses


def test_bfloat16_checkpoint_round_trips(setup, tmp_path):
    import ml_dtypes

    target, cfg, weights, _ = setup
    save_eagle3(str(tmp_path), cfg, weights, target.config.num_layers, dtype="bfloat16")
    cfg2, w2 = load_eagle3(str(tmp_path), target.config)
    assert cfg2 == cfg
    for name in ("fc", "w_q", "lm_head", "norm"):
        expected = np.asarray(getattr(weights, name)).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(getattr(w2, name)), expected)
    np.testing.assert_array_equal(np.asarray(w2.d2t), np.asarray(weights.d2t))  # integer maps stay exact
    with pytest.raises(ValueError, match="unsupported drafter dtype"):
        save_eagle3(str(tmp_path), cfg, weights, target.config.num_layers, dtype="float16")
