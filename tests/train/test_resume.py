"""A resumed training run continues the interrupted one exactly: 2 steps, a crash right after the step-2 checkpoint,
then --resume for 2 more steps gives the losses, weights and optimizer state of one uninterrupted 4-step run.

The first run is cut by an exception raised from its held-out evaluation at step 2 (after the checkpoint is written),
so both runs share one configuration (4 steps: the same cosine schedule), as a killed run and its resumption do.
A resume that ignored the checkpoint's weights, optimizer state, step counter or data position would differ."""

import json
import os

import jax
import numpy as np
import pytest

from specjax.drafter.loader import drafter_config_for
from specjax.model.loader import load_model
from specjax.train.config import TrainConfig
from specjax.train.methods import DFlashMethod, Eagle3Method
from specjax.train.trainer import train_drafter
from tests.helpers import toy_store


class Crash(Exception):
    pass


class CrashAt:
    """A held-out set that stops the run (as a kill would) when it is asked for simulated tau at `step`."""

    def __init__(self, step: int, sim_every: int):
        self.steps = iter(range(0, step + 1, sim_every))  # asked at step 0, then every sim_every steps
        self.step = step

    def evaluate(self, method, params, consts):
        if next(self.steps) == self.step:
            raise Crash
        return {"all": {"tau": [1.0], "anchors": 1}}


def losses(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in rows if "loss" in r]


def checkpoint_arrays(out, method, tcfg):
    """The saved drafter's weights and optimizer state, and the step counter, of out/checkpoint."""
    ckpt = os.path.join(out, "checkpoint")
    weights = [np.asarray(a) for a in jax.tree.leaves(method.load(os.path.join(ckpt, "drafter"), tcfg))]
    with np.load(os.path.join(ckpt, "opt_state.npz")) as data:
        opt = [data[f"arr_{i}"] for i in range(len(data.files))]
    with open(os.path.join(ckpt, "trainer.json")) as fh:
        return weights, opt, json.load(fh)["step"]


def make_method(name, tcfg):
    """A tiny drafter of each kind, both over a draft vocabulary of 100 ids (the even ones)."""
    ids = tuple(range(0, 200, 2))
    if name == "dflash":
        dcfg = drafter_config_for(tcfg, num_layers=1, block_size=4, target_layer_ids=(0, 2), draft_vocab_size=100)
        return DFlashMethod(dcfg, 4, 4, 4.0, draft_ids=ids)
    from specjax.drafter.eagle3_loader import eagle3_config_for

    return Eagle3Method(eagle3_config_for(tcfg, draft_vocab_size=100, aux_ids=(1, 2, 3)), ids, tcfg.num_layers,
                        ttt_steps=2, num_draft=2)


@pytest.mark.parametrize("name, family, optimizer", [("dflash", "qwen3", "adamw"), ("eagle3", "llama", "muon")])
def test_resume_equals_an_uninterrupted_run(tiny_dirs, tmp_path, name, family, optimizer):
    target = load_model(tiny_dirs[family])
    method = make_method(name, target.config)
    store = toy_store(str(tmp_path / "data"), 10, 40, 200, 10, seed=3)  # 5 batches of 2: 4 steps stay in epoch 0
    cfg = TrainConfig(block_size=4, batch_size=2, num_anchors=4, max_len=64, steps=4, lr=1e-2, warmup_ratio=0.25,
                      log_every=1, save_every=2, sim_every=2, eval_every=100, optimizer=optimizer, seed=5)
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    train_drafter(target, store, whole, method, cfg, resume=False, eval_sets={}, show_progress=False)
    with pytest.raises(Crash):
        train_drafter(target, store, cut, method, cfg, resume=False, eval_sets={}, show_progress=False,
                      heldout=CrashAt(2, cfg.sim_every))
    assert checkpoint_arrays(cut, method, target.config)[2] == 2 and [s for s, *_ in losses(cut)] == [1, 2]
    summary = train_drafter(target, store, cut, method, cfg, resume=True, eval_sets={}, show_progress=False)
    assert summary["steps"] == 4
    assert [s for s, *_ in losses(cut)] == [1, 2, 3, 4] == [s for s, *_ in losses(whole)]
    np.testing.assert_allclose(np.array(losses(cut)), np.array(losses(whole)), rtol=1e-5, atol=1e-7)
    assert losses(whole)[3][1] != losses(whole)[1][1]  # the drafter trained: the comparison is not of constants
    (w_cut, o_cut, s_cut), (w_whole, o_whole, s_whole) = (checkpoint_arrays(d, method, target.config)
                                                          for d in (cut, whole))
    assert s_cut == s_whole == 4 and len(w_cut) == len(w_whole) and len(o_cut) == len(o_whole)
    for a, b in zip(w_cut + o_cut, w_whole + o_whole):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    final = [np.asarray(a) for a in jax.tree.leaves(method.load(os.path.join(cut, "drafter"), target.config))]
    for a, b in zip(final, w_whole):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
