"""Controls of long runs: the wall-clock schedule (--schedule cosine-time), fixed-length batches (--pad-multiple) and
the best drafter by simulated tau (--keep-best)."""

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafter.loader import drafter_config_for
from specjax.model.loader import load_model
from specjax.train.batches import SequenceBatches
from specjax.train.config import TrainConfig
from specjax.train.features import batch_features
from specjax.train.methods import DFlashMethod
from specjax.train.optimizer import make_optimizer, time_scale, train_step
from specjax.train.store import TokenStore
from specjax.train.trainer import train_drafter
from tests.helpers import run_cli, toy_store


def test_time_scale_warms_up_then_follows_the_cosine_to_zero():
    cfg = TrainConfig(schedule="cosine-time", max_hours=1.0, warmup_ratio=0.1)
    assert time_scale(cfg, 0.0) == 0.0 and time_scale(cfg, -1.0) == 0.0
    assert time_scale(cfg, 0.05) == pytest.approx(0.5) and time_scale(cfg, 0.1) == pytest.approx(1.0)
    assert time_scale(cfg, 0.55) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert time_scale(cfg, 1.0) == pytest.approx(0.0, abs=1e-12)
    assert time_scale(cfg, 2.0) == pytest.approx(0.0, abs=1e-12)
    after = [time_scale(cfg, f) for f in np.linspace(0.1, 1.0, 50)]
    assert after == sorted(after, reverse=True)
    with pytest.raises(ValueError, match="max-hours"):
        TrainConfig(schedule="cosine-time")
    with pytest.raises(ValueError, match="unknown schedule"):
        TrainConfig(schedule="linear")
    with pytest.raises(ValueError, match="pad-multiple"):
        TrainConfig(pad_multiple=0)


def test_pad_multiple_fixes_the_batch_length(tmp_path):
    store = toy_store(str(tmp_path / "data"), 6, 70, 150, 10, seed=0)
    for multiple, width in ((64, 128), (512, 512), (1, 70)):
        batches = SequenceBatches(store, TrainConfig(block_size=4, batch_size=2, max_len=512, pad_multiple=multiple))
        tokens, mask, lengths, _, _ = batches.batch(1)
        assert tokens.shape == (2, width) and mask.shape == (2, width) and list(lengths) == [70, 70]


def test_lr_scale_scales_the_update_of_a_train_step(tiny_dirs, tmp_path):
    """cosine-time feeds its multiplier into the step: 0 leaves the drafter as it was, 0.5 moves every weight by half
    of what 1 moves it (AdamW and Muon updates are linear in the learning rate, so this is the scheduled lr)."""
    target = load_model(tiny_dirs["qwen3"])
    store = toy_store(str(tmp_path / "data"), 4, 40, 150, 10, seed=1)
    dcfg = drafter_config_for(target.config, num_layers=1, block_size=4, target_layer_ids=(0, 2))
    method = DFlashMethod(dcfg, 4, 6, 4.0)
    batches = SequenceBatches(store, TrainConfig(block_size=4, batch_size=2, max_len=64))
    tokens, mask, lengths, _, idx = batches.batch(0)
    taps = batch_features(target, tokens, idx, method.tap_indices)
    extra = method.host_inputs((0, 0), tokens, mask, lengths)
    consts = method.constants(target)
    for name in ("adamw", "muon"):
        optimizer = make_optimizer(TrainConfig(optimizer=name, schedule="constant", warmup_ratio=0.0, lr=1e-2))[0]
        params0 = method.init_params(jax.random.PRNGKey(0), target)
        moved = {}
        for scale in (0.0, 0.5, 1.0):
            params = jax.tree.map(jnp.copy, params0)  # train_step donates its params
            state = optimizer.init(params)
            for _ in range(2):  # the schedule's warm-up puts the first step at lr 0; the second moves
                params, state, *_ = train_step(params, state, consts, jnp.asarray(tokens), taps, jnp.asarray(mask),
                                               jnp.asarray(lengths), extra, jnp.float32(scale), method=method,
                                               optimizer=optimizer)
            moved[scale] = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params, params0)
        assert all(np.all(d == 0) for d in jax.tree.leaves(moved[0.0])), name
        assert max(np.abs(d).max() for d in jax.tree.leaves(moved[1.0])) > 1e-4, name
        for half, full in zip(jax.tree.leaves(moved[0.5]), jax.tree.leaves(moved[1.0])):
            np.testing.assert_allclose(half, 0.5 * full, rtol=1e-4, atol=1e-7)


def test_train_drafter_cosine_time_warms_up_over_the_wall_time(tiny_dirs, tmp_path):
    toy_store(str(tmp_path / "data"), 8, 60, 150, 10, seed=0)
    out, curve = str(tmp_path / "run"), str(tmp_path / "curve.jsonl")
    args = ["train-drafter", "--target", tiny_dirs["qwen3"], "--data", str(tmp_path / "data"), "--layers", "1",
            "--block-size", "4", "--target-layer-ids", "0,2", "--batch-size", "2", "--num-anchors", "8",
            "--eval-prompts", "0", "--draft-vocab-size", "100", "--compile-cache", "", "--out", out, "--log", curve,
            "--schedule", "cosine-time", "--pad-multiple", "512", "--log-every", "1", "--lr", "1e-3"]
    _, err = run_cli(args, ok=False)
    assert "--schedule cosine-time runs over the wall time of --max-hours" in err
    _, err = run_cli(args + ["--max-hours", "0.5"] + ["--pad-multiple", "0"], ok=False)
    assert "--pad-multiple must be >= 1" in err
    # an hour-long schedule capped at 6 steps: the first step runs at lr 0, the next ones climb the time warm-up
    stdout, _ = run_cli(args + ["--max-hours", "1", "--steps", "6"])
    lrs = [r["lr"] for r in map(json.loads, open(curve)) if "loss" in r]
    assert len(lrs) == 6 and lrs[0] == 0.0 and lrs == sorted(lrs) and 0.0 < lrs[-1] < 1e-3
    assert json.loads(stdout.strip().splitlines()[-1])["steps"] == 6
    assert json.load(open(os.path.join(out, "train_config.json")))["train"]["pad_multiple"] == 512


class ScriptedHeldOut:
    """A held-out set whose simulated tau follows a script, recording the drafter it was shown each time."""

    def __init__(self, taus):
        self.taus, self.seen = list(taus), []

    def evaluate(self, method, params, consts):
        self.seen.append(jax.tree.map(np.array, params))
        return {"all": {"tau": [1.0, self.taus[len(self.seen) - 1]], "anchors": 1}}


def test_keep_best_keeps_the_drafter_of_the_best_simulated_tau(tiny_dirs, tmp_path):
    target = load_model(tiny_dirs["qwen3"])
    store = toy_store(str(tmp_path / "data"), 6, 40, 150, 10, seed=2)
    method = DFlashMethod(drafter_config_for(target.config, num_layers=1, block_size=4, target_layer_ids=(0, 2)),
                          4, 6, 4.0)
    cfg = TrainConfig(block_size=4, batch_size=2, max_len=64, steps=6, sim_every=2, schedule="constant",
                      warmup_ratio=0.0, lr=1e-2, keep_best=True, save_every=100)
    heldout = ScriptedHeldOut([1.0, 1.5, 2.0, 1.8])  # steps 0, 2, 4, 6: the best is step 4, not the last
    out = str(tmp_path / "run")
    summary = train_drafter(target, store, out, method, cfg, resume=False, eval_sets={}, heldout=heldout,
                            show_progress=False)
    assert summary["best"]["step"] == 4 and summary["best"]["tau"] == 2.0
    assert json.load(open(os.path.join(out, "best.json")))["step"] == 4
    best = jax.tree.leaves(method.load(os.path.join(out, "best-drafter"), target.config))
    last = jax.tree.leaves(method.load(os.path.join(out, "drafter"), target.config))
    for b, want in zip(best, jax.tree.leaves(heldout.seen[2])):
        np.testing.assert_array_equal(np.asarray(b), want)
    assert any(not np.array_equal(np.asarray(b), np.asarray(o)) for b, o in zip(best, last))
    with pytest.raises(ValueError, match="--heldout"):
        train_drafter(target, store, out, method, cfg, resume=False, eval_sets={}, show_progress=False)
    with pytest.raises(ValueError, match="--sim-every"):
        TrainConfig(keep_best=True, sim_every=0)
    # a resumed run remembers the best of the run before it: a lower tau does not replace it
    cfg2 = dataclasses.replace(cfg, steps=8)
    summary = train_drafter(target, TokenStore(store.path), out, method, cfg2, resume=True, eval_sets={},
                            heldout=ScriptedHeldOut([1.9]), show_progress=False)
    assert summary["best"]["step"] == 4
