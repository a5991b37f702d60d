"""Bad input gets a clear error naming the problem, and loses nothing (no pages, no queued work)."""

import argparse
import json
import os
import shutil

import jax
import jax.numpy as jnp
import pytest

from specjax.cli import main
from specjax.config import ConfigError, EngineConfig
from specjax.drafter.loader import drafter_config_for, init_drafter, load_drafter, save_drafter
from specjax.engine.engine import LLMEngine, RequestError
from specjax.llm import LLM
from specjax.model.loader import CheckpointError, load_model
from specjax.sampling import SamplingError, SamplingParams
from specjax.spec.proposer import DFlashProposer
from specjax.spec.reference import reference_generate


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return load_model(tiny_dirs["qwen3"])


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory):
    cfg = drafter_config_for(target.config, num_layers=1, block_size=8, target_layer_ids=(1, 2), mask_token_id=299)
    path = str(tmp_path_factory.mktemp("d"))
    save_drafter(path, cfg, init_drafter(cfg, jax.random.PRNGKey(0)))
    return path


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(seed="x"), "seed must be an integer"),
])
def test_invalid_sampling_parameters(kwargs, match):
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_without_side_effects(target):
    engine = LLMEngine(target.config, target.weights, config=EngineConfig(max_model_len=64, page_size=4))
    free = engine.allocator.num_free
    with pytest.raises(RequestError, match="the prompt has 64 tokens but the context holds max_model_len=64"):
        engine.add_request([1] * 64)
    with pytest.raises(RequestError, match="the prompt is empty"):
        engine.add_request([])
    with pytest.raises(RequestError, match=r"outside the vocabulary \[0, 300\)"):
        engine.add_request([1, 2, 300])
    assert not engine.has_unfinished() and engine.allocator.num_free == free
    [seq] = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))  # and it still serves
    assert len(seq.output_ids) == 3 and engine.allocator.num_free == free


def test_llm_validates_the_whole_batch_before_queueing(tiny_dirs):
    llm = LLM(tiny_dirs["qwen3"], engine_config=EngineConfig(max_model_len=32, page_size=4))
    with pytest.raises(RequestError, match="max_model_len=32"):
        llm.generate([[1, 2], [3] * 40])
    assert not llm.engine.has_unfinished()


def test_drafter_target_mismatches(target, drafter_dir, tmp_path, tiny_dirs):
    load_drafter(drafter_dir, target.config)  # fits
    other = load_model(tiny_dirs["llama"])  # same hidden size, same vocab ... but check every field below
    d = tmp_path / "d"
    shutil.copytree(drafter_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    for field, value, match in [
        ("vocab_size", 512, "drafter vocab_size=512 does not match the target's vocab_size=300"),
        ("num_target_layers", 36, "drafter was built for a 36-layer target"),
    ]:
        (d / "config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(ConfigError, match=match):
            load_drafter(str(d), target.config)
    (d / "config.json").write_text(json.dumps({**cfg, "dflash_config": {**cfg["dflash_config"],
                                                                        "target_layer_ids": [1, 9]}}))
    with pytest.raises(ConfigError, match=r"taps target layers \[1, 9\] but the target has only 4 layers"):
        load_drafter(str(d), target.config)
    (d / "config.json").write_text(json.dumps({**cfg, "dflash_config": {"mask_token_id": 5}}))
    with pytest.raises(ConfigError, match="no dflash_config.target_layer_ids"):
        load_drafter(str(d), target.config)
    from specjax.config import replace
    wide = replace(target.config, hidden_size=128)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="expects target hidden_size=64 .* has hidden_size=128"):
        load_drafter(str(d), wide)
    assert other.config.num_layers == 4


def test_drafter_checkpoint_errors(drafter_dir, target, tmp_path):
    with pytest.raises(CheckpointError, match="drafter path is not a directory"):
        load_drafter(str(tmp_path / "nope"), target.config)
    d = tmp_path / "d2"
    shutil.copytree(drafter_dir, d)
    os.remove(d / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_drafter(str(d), target.config)


def test_engine_config_errors(target, drafter_dir):
    cfg, w = load_drafter(drafter_dir, target.config)
    with pytest.raises(ConfigError, match="num_draft_tokens=8 exceeds what dflash can draft"):
        LLMEngine(target.config, target.weights, DFlashProposer(cfg, 8), w, EngineConfig(num_draft_tokens=8,
                                                                                         max_model_len=64))
    with pytest.raises(ConfigError, match="cannot hold one 64-token sequence"):
        LLMEngine(target.config, target.weights, config=EngineConfig(max_model_len=64, page_size=4, num_pages=10))
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings=1024"):
        LLMEngine(target.config, target.weights, config=EngineConfig(max_model_len=4096))
    with pytest.raises(ConfigError, match="block_size must be >= 2"):
        DFlashProposer(cfg, 1)


def test_kv_pool_sized_from_a_memory_budget(target, drafter_dir):
    from specjax.cli.common import parse_bytes
    from specjax.engine.engine import page_bytes

    cfg, w = load_drafter(drafter_dir, target.config)
    proposer = DFlashProposer(cfg, 4)
    tc = target.config
    per_page = page_bytes(tc, proposer, 4, jnp.float32)  # target and drafter K/V rows of 4 tokens, float32
    assert per_page == 4 * 2 * 4 * (tc.num_layers * tc.num_kv_heads * tc.head_dim
                                    + cfg.num_layers * cfg.num_kv_heads * cfg.head_dim)
    budget = 40 * per_page + per_page // 2
    engine = LLMEngine(tc, target.weights, proposer, w, EngineConfig(max_model_len=64, page_size=4,
                                                                     kv_cache_memory=budget))
    assert engine.config.pool_pages == 40
    used = sum(sum(d.values()) for part, d in engine.memory_bytes().items() if part in ("kv_pool", "drafter_state"))
    assert used == 40 * per_page <= budget
    with pytest.raises(ConfigError, match=r"holds 10 KV pages .* needs 17 .* raise the budget or lower max_model_len"):
        LLMEngine(tc, target.weights, proposer, w, EngineConfig(max_model_len=64, page_size=4,
                                                                kv_cache_memory=10 * per_page))
    big = LLMEngine(tc, target.weights, proposer, w, EngineConfig(max_model_len=64, page_size=4, max_num_seqs=2,
                                                                  kv_cache_memory=1000 * per_page))
    assert big.config.pool_pages == 2 * 16 + 1  # never more than max_num_seqs full-length sequences use
    with pytest.raises(ConfigError, match="cannot be combined with num_pages"):
        EngineConfig(kv_cache_memory=10 ** 6, num_pages=8)
    # a float16 cache: the target's rows at half the bytes (the drafter's stay float32), so more pages fit
    per_page16 = page_bytes(tc, proposer, 4, jnp.float32, jnp.float16)
    assert per_page16 == 4 * 2 * (2 * tc.num_layers * tc.num_kv_heads * tc.head_dim
                                  + 4 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim)
    half = LLMEngine(tc, target.weights, proposer, w, EngineConfig(max_model_len=64, page_size=4,
                                                                   kv_cache_memory=budget, kv_cache_dtype="float16"))
    assert half.config.pool_pages == budget // per_page16 > 40 and half.kv.k[0].dtype == jnp.float16
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, float32, float16, bfloat16, got 'int8'"):
        EngineConfig(kv_cache_dtype="int8")
    assert parse_bytes("2GiB") == 2 ** 31 and parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
        parse_bytes("2 lots")


def test_abort_frees_pages(target):
    engine = LLMEngine(target.config, target.weights, config=EngineConfig(max_model_len=64, page_size=4))
    free = engine.allocator.num_free
    sid = engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.allocator.num_free < free
    engine.abort(sid)
    assert engine.allocator.num_free == free and not engine.has_unfinished()
    assert engine.seqs[sid].finish_reason == "abort"


def test_cli_reports_errors_cleanly(capsys, tiny_dirs):
    assert main(["generate", "hi", "--model", "/no/such/model", "--compile-cache", ""]) == 2
    assert "specjax: error: model path does not exist: /no/such/model" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", tiny_dirs["qwen3"], "--temperature", "-1", "--compile-cache", ""]) == 2
    assert "temperature must be a finite number >= 0" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", tiny_dirs["qwen3"], "--method", "dflash", "--compile-cache", ""]) == 2
    assert "method dflash needs a drafter" in capsys.readouterr().err


def test_cpu_default_kv_pool_is_a_byte_budget(target, monkeypatch):
    """With neither pages nor bytes given, a CPU engine sizes its pool from the default budget (raised to one
    full-length sequence if it holds less), and an explicit page count still wins."""
    import specjax.llm as llm_mod
    from specjax.engine.engine import page_bytes
    from specjax.spec.proposer import NoProposer

    per_page = page_bytes(target.config, NoProposer(), 4, jnp.float32)
    cfg = EngineConfig(max_model_len=64, page_size=4, max_num_seqs=8)  # worst case 8 x 16 + 1 pages
    monkeypatch.setattr(llm_mod, "CPU_KV_CACHE_MEMORY", 40 * per_page)
    assert LLM(target=target, method="ar", engine_config=cfg).engine.config.pool_pages == 40
    monkeypatch.setattr(llm_mod, "CPU_KV_CACHE_MEMORY", 3 * per_page)
    assert LLM(target=target, method="ar", engine_config=cfg).engine.config.pool_pages == 17
    pinned = EngineConfig(max_model_len=64, page_size=4, num_pages=25)
    assert LLM(target=target, method="ar", engine_config=pinned).engine.config.pool_pages == 25


def test_kv_pool_pages_are_resident_only_once_written(target, drafter_dir):
    """A CPU engine hands back the pages of its zero-filled pools (hostmem.release_zero_pages): nearly all of the
    pool's bytes at start-up, and a request served after it still reads what it wrote (and sees zeros elsewhere)."""
    cfg, w = load_drafter(drafter_dir, target.config)
    ec = EngineConfig(max_model_len=64, page_size=16, num_pages=2048)
    engine = LLMEngine(target.config, target.weights, DFlashProposer(cfg, 4), w, ec)
    pools = sum(sum(d.values()) for part, d in engine.memory_bytes().items() if part in ("kv_pool", "drafter_state"))
    assert engine.pool_bytes_released > 0.95 * pools, (engine.pool_bytes_released, pools)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    sid = engine.add_request([1, 2, 3, 4, 5], params)
    while engine.has_unfinished():
        engine.step()
    dense, _ = reference_generate(target.weights, target.config, [1, 2, 3, 4, 5], params)  # no KV cache at all
    assert engine.seqs[sid].output_ids == dense
