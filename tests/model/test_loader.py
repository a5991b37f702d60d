"""Checkpoint loading: GGUF files of every family, sharded safetensors, and clear errors for bad inputs."""

import json
import os
import shutil

import numpy as np
import pytest

from specjax.config import ConfigError
from specjax.model.loader import CheckpointError, load_model, permute_llama_qk, unpermute_llama_qk
from specjax.spec.reference import full_forward
from tests.helpers import FAMILIES, random_prompt, write_gguf_from_hf


def test_llama_qk_permutation_roundtrip():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    assert np.array_equal(unpermute_llama_qk(permute_llama_qk(w, 6), 6), w)
    assert not np.array_equal(permute_llama_qk(w, 6), w)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_matches_hf_checkpoint(tiny_dirs, tmp_path, family):
    path = str(tmp_path / f"{family}.gguf")
    write_gguf_from_hf(tiny_dirs[family], path)
    hf, gg = load_model(tiny_dirs[family]), load_model(path)
    assert gg.config.qk_norm == (family == "qwen3") and gg.config.qkv_bias == (family == "qwen2")
    assert gg.config.tie_word_embeddings == hf.config.tie_word_embeddings
    ids = random_prompt(np.random.default_rng(0), 17)
    np.testing.assert_allclose(full_forward(gg.weights, gg.config, ids)[0], full_forward(hf.weights, hf.config, ids)[0],
                               atol=1e-5)
    text = "hello, GGUF tokenizer 123"
    assert gg.tokenizer.decode(gg.tokenizer.encode(text)) == text


def test_sharded_safetensors(tiny_dirs, tmp_path):
    from safetensors.numpy import load_file, save_file

    src, dst = tiny_dirs["qwen3"], tmp_path / "sharded"
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    os.remove(dst / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(dst / fname))
        weight_map.update({k: fname for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = [5, 6, 7]
    np.testing.assert_array_equal(full_forward(load_model(str(dst)).weights, load_model(str(dst)).config, ids)[0],
                                  full_forward(load_model(src).weights, load_model(src).config, ids)[0])


def copy_dir(tiny_dirs, tmp_path, family="qwen3"):
    dst = tmp_path / "m"
    shutil.copytree(tiny_dirs[family], dst)
    return dst


def test_missing_path():
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model("/nonexistent/model")


def test_missing_config(tiny_dirs, tmp_path):
    d = copy_dir(tiny_dirs, tmp_path)
    os.remove(d / "config.json")
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_model(str(d))


def test_corrupt_config(tiny_dirs, tmp_path):
    d = copy_dir(tiny_dirs, tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(str(d))


def test_corrupt_safetensors(tiny_dirs, tmp_path):
    d = copy_dir(tiny_dirs, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        load_model(str(d))


def test_missing_weights_file(tiny_dirs, tmp_path):
    d = copy_dir(tiny_dirs, tmp_path)
    os.remove(d / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(str(d))


def test_missing_and_misshapen_tensors(tiny_dirs, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = copy_dir(tiny_dirs, tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    bad = dict(tensors)
    del bad["model.layers.1.mlp.up_proj.weight"]
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(str(d))
    bad = dict(tensors)
    bad["model.norm.weight"] = np.ones(7, np.float32)
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \(7,\), expected \(64,\)"):
        load_model(str(d))


def test_unsupported_architecture(tiny_dirs, tmp_path):
    d = copy_dir(tiny_dirs, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type='gpt_neox' is not supported"):
        load_model(str(d))


def test_corrupt_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUF" + b"\x00" * 12)
    with pytest.raises(CheckpointError, match="cannot read GGUF"):
        load_model(str(p))


def test_non_gguf_file(tmp_path):
    p = tmp_path / "weights.bin"
    p.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="must be a .gguf"):
        load_model(str(p))
