"""Training on a mesh of 4 virtual CPU devices (subprocesses: the device count is fixed when jax starts):
`train-drafter --data-parallel-size 4` logs the same losses as one device, step by step, and `cache-features`
with the batch split (--data-parallel-size 4) or the target split (--tensor-parallel-size 2) caches the same taps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_data_parallel_training_matches_one_device(tiny_dirs, tmp_path):
    helpers.toy_store(str(tmp_path / "data"), 16, 70, 256, 10, seed=0)
    env = helpers.cpu_env(4)
    losses = {}
    for dp in (1, 4):
        out = str(tmp_path / f"dp{dp}")
        proc = subprocess.run(
            [sys.executable, "-m", "specjax.cli", "train-drafter", "--target", tiny_dirs["qwen3"], "--data",
             str(tmp_path / "data"), "--out", out, "--layers", "1", "--block-size", "4", "--target-layer-ids", "0,2",
             "--batch-size", "4", "--num-anchors", "4", "--steps", "4", "--log-every", "1", "--eval-prompts", "0",
             "--optimizer", "muon", "--compile-cache", "", "--data-parallel-size", str(dp)],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        devices = json.load(open(os.path.join(out, "train_config.json")))["data_parallel_devices"]
        assert len(devices) == (dp if dp > 1 else 0)
        rows = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
        losses[dp] = [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]
    assert [s for s, _, _ in losses[1]] == [1, 2, 3, 4]
    np.testing.assert_allclose(np.array(losses[4])[:, 1:], np.array(losses[1])[:, 1:], rtol=2e-4)
    assert losses[1][-1][1] != losses[1][0][1]  # the drafter trained (the comparison is not of constants)


def test_feature_cache_on_a_mesh_matches_one_device(tmp_path):
    from specjax.train.features import FeatureCache

    model = helpers.make_hf_checkpoint("qwen3", str(tmp_path / "qwen3"), num_attention_heads=8,
                                       num_key_value_heads=4)
    helpers.toy_store(str(tmp_path / "data"), 6, 70, 256, 10, seed=1)
    env = helpers.cpu_env(4)
    caches = {}
    runs = {"one": [], "dp4": ["--data-parallel-size", "4"], "tp2": ["--tensor-parallel-size", "2"]}
    for name, flags in runs.items():
        out = str(tmp_path / f"feats-{name}")
        proc = subprocess.run([sys.executable, "-m", "specjax.cli", "cache-features", "--target", model, "--data",
                               str(tmp_path / "data"), "--out", out, "--tap-indices", "1,3", "--max-len", "128",
                               "--batch-tokens", "256", "--compile-cache", "", *flags],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        cache = FeatureCache(out)
        caches[name] = cache.batch(list(range(6)), 128, (1, 3))
    assert np.abs(caches["one"]).max() > 0.1
    np.testing.assert_allclose(caches["dp4"], caches["one"], rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(caches["tp2"], caches["one"], rtol=1e-2, atol=1e-3)
