"""The update step: the optimizer chain (AdamW or Muon, global-norm clipping, the grown layers' lr multiple), its
learning-rate schedules (by step, or by wall time: `time_scale`), and the jitted `train_step`."""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
import optax

from specjax.train.config import TrainConfig

MUON_MATRICES = ("fc", "w_q", "w_kv", "w_o", "w_gate_up", "w_down")


def muon_matrices(params):
    """Muon orthogonalizes the drafters' projection matrices ([in, out]); embeddings, heads and norms get AdamW."""
    def dims(path, leaf):
        name = getattr(path[-1], "name", None)
        return optax.contrib.MuonDimensionNumbers(0, 1) if name in MUON_MATRICES and leaf.ndim == 2 else None
    return jax.tree_util.tree_map_with_path(dims, params)


def scale_last_layers(count: int, scale: float) -> optax.GradientTransformation:
    """Multiply the updates of the last `count` entries of the params' `layers` by `scale` (the rest unchanged): a
    grown layer's zero output projections can only move by about lr per step under Muon's normalized updates, so
    at a fine-tuning lr it would stay near the identity for the whole run."""
    def update(updates, state, params=None):
        first = len(updates.layers) - count

        def scaled(path, u):
            in_layers = len(path) > 1 and getattr(path[0], "name", None) == "layers"
            return u * scale if in_layers and path[1].idx >= first else u
        return jax.tree_util.tree_map_with_path(scaled, updates), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def time_scale(cfg: TrainConfig, fraction: float) -> float:
    """Learning-rate multiplier of the cosine-time schedule at `fraction` of its wall time: linear warm-up over
    `warmup_ratio`, then cosine to 0 (the same shape as the step schedule, in time)."""
    f = min(max(fraction, 0.0), 1.0)
    if f < cfg.warmup_ratio:
        return f / cfg.warmup_ratio
    rest = (f - cfg.warmup_ratio) / max(1e-9, 1.0 - cfg.warmup_ratio)
    return 0.5 * (1.0 + float(np.cos(np.pi * rest)))


def make_optimizer(cfg: TrainConfig):
    """The optimizer chain and its step schedule (cosine-time: a constant lr, scaled per step by the caller's
    `lr_scale` from `time_scale`: the updates of AdamW and Muon are linear in the learning rate)."""
    warmup = max(1, int(cfg.warmup_ratio * cfg.steps))
    if cfg.schedule == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(2, cfg.steps), end_value=0.0)
    elif cfg.schedule == "constant":
        schedule = optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), optax.constant_schedule(cfg.lr)],
                                        [warmup])
    else:  # cosine-time (TrainConfig checked the name)
        schedule = optax.constant_schedule(cfg.lr)
    if cfg.optimizer == "adamw":
        opt = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay)
    elif cfg.optimizer == "muon":
        # consistent_rms=0.2 scales each orthogonalized update to AdamW's typical RMS (Liu et al. 2025), so one
        # --lr means the same step size for both optimizers and an A/B changes only the update's direction
        opt = optax.contrib.muon(schedule, weight_decay=cfg.weight_decay, adam_b2=0.95, consistent_rms=0.2,
                                 muon_weight_dimension_numbers=muon_matrices)
    else:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r} (adamw, muon)")
    chain = [optax.clip_by_global_norm(cfg.grad_clip), opt]
    if cfg.grown_layers and cfg.grown_lr_scale != 1.0:
        chain.append(scale_last_layers(cfg.grown_layers, cfg.grown_lr_scale))
    return optax.chain(*chain), schedule


@partial(jax.jit, static_argnames=("method", "optimizer"), donate_argnames=("params", "opt_state"))
def train_step(params, opt_state, consts, tokens, taps, loss_mask, lengths, extra, lr_scale, *, method, optimizer):
    """One update of the drafter on one batch -> (params, opt_state, loss, aux, gradient norm); `lr_scale` multiplies
    the update (the cosine-time schedule's `time_scale`, else 1).  Donates params and opt_state."""
    (loss, aux), grads = jax.value_and_grad(
        lambda p: method.loss(p, consts, tokens, taps, loss_mask, lengths, extra), has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
    return optax.apply_updates(params, updates), opt_state, loss, aux, optax.tree.norm(grads)
