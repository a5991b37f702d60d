"""specjax's optional DFlash tensors (per-slot embeddings, draft vocabulary): checkpoint round trip, clear errors,
and lossless speculative decoding with a drafter that can only draft part of the vocabulary."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specjax.config import EngineConfig
from specjax.drafter.loader import drafter_config_for, init_drafter, load_drafter, save_drafter
from specjax.engine.engine import LLMEngine
from specjax.model.loader import CheckpointError, load_model
from specjax.sampling import SamplingParams
from specjax.spec.proposer import DFlashProposer, NoProposer
from tests.helpers import random_prompt


@pytest.fixture(scope="module")
def setup(tiny_dirs):
    target = load_model(tiny_dirs["qwen3"])
    ids = np.sort(np.random.default_rng(0).choice(target.config.vocab_size, 64, replace=False))
    cfg = drafter_config_for(target.config, num_layers=2, block_size=8, target_layer_ids=(0, 2), mask_token_id=299,
                             mask_embedding=False, slot_embedding=True, draft_vocab_size=len(ids))
    weights = dataclasses.replace(init_drafter(cfg, jax.random.PRNGKey(3), std=0.1),
                                  draft_ids=jnp.asarray(ids, jnp.int32))
    return target, cfg, weights, ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_keeps_both_extensions(setup, tmp_path, dtype):
    target, cfg, weights, ids = setup
    save_drafter(str(tmp_path / "d"), cfg, weights, dtype=dtype)
    meta = json.loads((tmp_path / "d" / "config.json").read_text())["dflash_config"]
    assert meta["slot_embedding"] is True and meta["draft_vocab_size"] == 64
    cfg2, w2 = load_drafter(str(tmp_path / "d"), target.config)
    assert cfg2 == cfg
    np.testing.assert_array_equal(np.asarray(w2.draft_ids), ids)  # integer ids stay exact in bfloat16 files
    tol = 0 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(np.asarray(w2.slot_embedding), np.asarray(weights.slot_embedding), atol=tol, rtol=tol)


def test_extension_tensors_without_their_flags_or_malformed_are_named(setup, tmp_path):
    target, cfg, weights, _ = setup
    d = str(tmp_path / "d")
    save_drafter(d, cfg, weights)
    config = json.loads(open(os.path.join(d, "config.json")).read())
    plain = {**config, "dflash_config": {k: v for k, v in config["dflash_config"].items()
                                          if k not in ("slot_embedding", "draft_vocab_size")}}
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(plain, fh)
    with pytest.raises(CheckpointError, match="draft_vocab_size: N, slot_embedding: true"):
        load_drafter(d, target.config)
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(config, fh)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    tensors["draft_token_ids"] = tensors["draft_token_ids"][::-1].copy()
    save_file(tensors, os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="draft_token_ids must be sorted"):
        load_drafter(d, target.config)


def test_draft_vocabulary_drafter_is_lossless_and_drafts_only_its_ids(setup):
    target, cfg, weights, ids = setup
    rng = np.random.default_rng(5)
    prompts = [random_prompt(rng, n) for n in (3, 17, 30)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    config = EngineConfig(page_size=4, max_model_len=96, max_num_seqs=4)
    plain = LLMEngine(target.config, target.weights, NoProposer(), None, config).generate(prompts, params)
    drafted = {}
    for vocab in (0, 32):  # without and with the prompt's tokens beside the draft vocabulary (the default)
        engine = LLMEngine(target.config, target.weights, DFlashProposer(cfg, 8), weights,
                           dataclasses.replace(config, context_vocab=vocab), record_drafts=True)
        spec = engine.generate(prompts, params)
        assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
        assert engine.allocator.num_used == 0
        drafted[vocab] = [{int(t) for d in s.stats.draft_log for t in d} for s in spec]
    assert set().union(*drafted[0]) and set().union(*drafted[0]) <= set(int(i) for i in ids)
    for prompt, tokens in zip(prompts, drafted[32]):  # a sequence drafts only its own prompt's other tokens
        assert tokens <= set(int(i) for i in ids) | set(prompt)
    assert set().union(*drafted[32]) - set(int(i) for i in ids)  # ... and did draft some of them


def test_context_vocabulary_drafts_as_a_vocabulary_with_those_ids(setup):
    """Oracle of the extra rows: the engine's drafts with a prompt's tokens beside the draft vocabulary are those of
    the same drafter whose draft vocabulary holds them too (spec/context_vocab.context_ids picks them)."""
    from specjax.spec.context_vocab import context_ids

    target, cfg, weights, ids = setup
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    config = EngineConfig(page_size=4, max_model_len=96, max_num_seqs=1, context_vocab=24)
    draftable = np.zeros(target.config.vocab_size, bool)
    draftable[ids] = True
    drafted_extra = False
    for n in (9, 40):
        prompt = random_prompt(np.random.default_rng(n), n)
        extra = [int(t) for t in context_ids(prompt, draftable, 24) if t >= 0]
        assert len(extra) == min(24, len(set(prompt) - set(int(i) for i in ids)))
        union = np.sort(np.concatenate([ids, extra]))
        wide = dataclasses.replace(weights, draft_ids=jnp.asarray(union, jnp.int32))
        wide_cfg = dataclasses.replace(cfg, draft_vocab_size=len(union))
        logs = []
        for c, w, vocab in ((cfg, weights, 24), (wide_cfg, wide, 0)):
            engine = LLMEngine(target.config, target.weights, DFlashProposer(c, 8), w,
                               dataclasses.replace(config, context_vocab=vocab), record_drafts=True)
            logs.append(engine.generate([prompt], params)[0].stats.draft_log)
        assert logs[0] == logs[1]
        drafted_extra |= any(t in extra for d in logs[0] for t in d)
    assert drafted_extra


def test_context_ids_are_the_latest_distinct_undraftable_tokens():
    from specjax.spec.context_vocab import context_ids

    draftable = np.zeros(10, bool)
    draftable[[1, 2]] = True
    np.testing.assert_array_equal(context_ids([3, 1, 4, 3, 2, 5, 4], draftable, 2), [4, 5])
    np.testing.assert_array_equal(context_ids([3, 1, 4, 3, 2, 5, 4], draftable, 5), [4, 5, 3, -1, -1])
    np.testing.assert_array_equal(context_ids([1, 2], draftable, 3), [-1, -1, -1])
    assert context_ids([7], draftable, 0).shape == (0,)


def test_slot_embeddings_forbid_a_larger_block(setup):
    from specjax.config import ConfigError

    _, cfg, _, _ = setup
    DFlashProposer(cfg, 4)  # smaller blocks use the first slots
    with pytest.raises(ConfigError, match="block_size=16 exceeds the drafter's 8"):
        DFlashProposer(cfg, 16)


def test_random_drafter_spec_with_a_draft_vocabulary(setup):
    from specjax.config import ConfigError
    from specjax.llm import build_proposer

    target = setup[0]
    proposer, weights = build_proposer("dflash", target, "random:2:100", block_size=4)
    assert proposer.cfg.num_layers == 2 and proposer.cfg.draft_vocab_size == 100
    assert weights.draft_ids.shape == (100,)
    assert build_proposer("dflash", target, "random")[0].cfg.draft_vocab_size == 0
    with pytest.raises(ConfigError, match="random\\[:LAYERS\\[:DRAFT_VOCAB\\]\\]"):
        build_proposer("dflash", target, "random:two")
