"""Checkpoints of a training run (out_dir/checkpoint: the drafter, the optimizer state's leaves, the step and the
settings; replaced atomically) and the best drafter by simulated tau (out_dir/best-drafter, best.json)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.train.config import TrainConfig


def save_checkpoint(out_dir: str, step: int, method, params, opt_state, cfg: TrainConfig) -> None:
    """Write out_dir/checkpoint (float32 drafter, optimizer state, `step` completed), replacing the last one only
    once the new one is whole."""
    ckpt = os.path.join(out_dir, "checkpoint")
    tmp = ckpt + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    method.save(os.path.join(tmp, "drafter"), params)
    leaves = jax.tree_util.tree_leaves(opt_state)
    np.savez(os.path.join(tmp, "opt_state.npz"), *[np.asarray(x) for x in leaves])
    with open(os.path.join(tmp, "trainer.json"), "w") as fh:
        json.dump({"step": step, "train_config": dataclasses.asdict(cfg)}, fh)
    if os.path.isdir(ckpt):
        os.replace(ckpt, ckpt + ".old")
    os.replace(tmp, ckpt)
    if os.path.isdir(ckpt + ".old"):
        shutil.rmtree(ckpt + ".old")


def load_checkpoint(out_dir: str, method, tcfg: ModelConfig, opt_state_template):
    """(params, optimizer state, steps completed) of out_dir/checkpoint; the optimizer state takes the tree
    structure of `opt_state_template` (the state `optimizer.init` gives the same method and settings)."""
    ckpt = os.path.join(out_dir, "checkpoint")
    params = method.load(os.path.join(ckpt, "drafter"), tcfg)
    with np.load(os.path.join(ckpt, "opt_state.npz")) as data:
        leaves = [jnp.asarray(data[f"arr_{i}"]) for i in range(len(data.files))]
    treedef = jax.tree_util.tree_structure(opt_state_template)
    with open(os.path.join(ckpt, "trainer.json")) as fh:
        meta = json.load(fh)
    return params, jax.tree_util.tree_unflatten(treedef, leaves), meta["step"]


def save_best(out_dir: str, method, params, best: dict, dtype: str = "float32") -> None:
    """Keep `params` as the best drafter so far (out_dir/best-drafter) and `best` (step, tau, hours) in best.json."""
    method.save(os.path.join(out_dir, "best-drafter"), params, dtype=dtype)
    with open(os.path.join(out_dir, "best.json"), "w") as fh:
        json.dump(best, fh)


def load_best(out_dir: str) -> dict | None:
    """best.json of an earlier run in out_dir (a resumed run keeps the best of the runs before it), or None."""
    path = os.path.join(out_dir, "best.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)
