"""Drafter training loop: data batches from a TokenStore, target features (online or from a FeatureCache),
AdamW + cosine, periodic checkpoints (resumable), tau evaluation with the real speculative engine, loss/tau curves.

Target features: online (one frozen-target forward per batch) or read from a `specjax cache-features` cache.
On the 2-core CPU with SmolLM2 the forward is about half of an online step (see train/features.py), so the
cache roughly doubles training throughput once built and is shared by the DFlash and EAGLE-3 runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.config import DrafterConfig, EngineConfig, ModelConfig
from specjax.drafter.eagle3 import Eagle3Config
from specjax.drafter.loader import load_drafter, save_drafter
from specjax.model import target as tgt
from specjax.spec.context_vocab import context_ids, draft_mask
from specjax.train.objective import dflash_loss, sample_anchors, simulated_acceptance, teacher_logits
from specjax.train.store import TokenStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    block_size: int = 16
    batch_size: int = 4  # sequences per step
    num_anchors: int = 32  # anchor blocks per sequence (paper: 512 on GPUs)
    max_len: int = 512  # longest training sequence (prompt + response), tokens
    steps: int = 2000
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None  # loss decay; None = paper values (7 for Q=16, 5 for Q=10, 4 for Q=8)
    dpace_alpha: float | None = None  # DFlash: D-PACE slot weights with this smoothing instead of the decay
    distill: float = 0.0  # DFlash: weight of the KL to the target's next-token distribution in each slot's loss
    seed: int = 0
    save_every: int = 200
    eval_every: int = 500
    log_every: int = 10
    schedule: str = "cosine"  # "cosine" (to 0 at `steps`), "constant" (warm-up, then flat: for open-ended runs) or
    # "cosine-time" (warm-up and cosine over the wall time of --max-hours, measured from the end of the first step:
    # equal-time A/Bs and machines of unknown speed finish their schedule whatever a step costs; `steps` caps it)
    optimizer: str = "adamw"  # "adamw" or "muon" (Newton-Schulz on matrices, AdamW on vectors)
    max_hours: float | None = None  # stop (and save) after this much wall time: equal-time A/Bs, long runs
    sim_every: int = 100  # simulated tau on the held-out store every this many steps (0 = never)
    grown_layers: int = 0  # DFlash: the last this many layers were appended to the init drafter (--grow-layers) ...
    grown_lr_scale: float = 1.0  # ... and train at this multiple of the learning rate (they start from zero output)
    pad_multiple: int = 64  # batch lengths padded to a multiple of this (max_len: one compiled step shape)
    keep_best: bool = False  # also keep the drafter of the best simulated tau so far (OUT/best-drafter, best.json)

    def __post_init__(self):
        if self.schedule not in ("cosine", "constant", "cosine-time"):
            raise ValueError(f"unknown schedule {self.schedule!r} (cosine, constant, cosine-time)")
        if self.schedule == "cosine-time" and not self.max_hours:
            raise ValueError("--schedule cosine-time runs over the wall time of --max-hours: give it")
        if self.pad_multiple < 1:
            raise ValueError(f"--pad-multiple must be >= 1, got {self.pad_multiple}")
        if self.keep_best and not self.sim_every:
            raise ValueError("--keep-best picks the drafter by simulated tau: give --sim-every > 0 (and --heldout)")

    @property
    def decay(self) -> float:
        if self.gamma is not None:
            return self.gamma
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, max(1.0, self.block_size / 2.3))


class SequenceBatches:
    """Epoch-shuffled batches of (tokens, loss_mask, lengths), padded to multiples of `cfg.pad_multiple` tokens."""

    def __init__(self, store: TokenStore, cfg: TrainConfig, holdout_ids: set[str] = frozenset()):
        self.cfg = cfg
        self.seqs = []
        for index, (rec, toks) in enumerate(store.sequences()):
            if rec["id"] in holdout_ids:
                continue
            toks = toks[: cfg.max_len]
            if len(toks) - rec["prompt_len"] >= 2 * cfg.block_size:  # spec: drop samples with < 2Q response tokens
                self.seqs.append((toks, rec["prompt_len"], index))
        if not self.seqs:
            raise ValueError(f"no usable training sequences in {store.path} (need >= {2 * cfg.block_size} "
                             "response tokens each)")
        self.num_tokens = sum(len(t) for t, _, _ in self.seqs)

    @property
    def batches_per_epoch(self) -> int:
        return max(1, len(self.seqs) // self.cfg.batch_size)

    def batch(self, step: int):
        """The batch of global step `step` (deterministic in (seed, step): resuming needs no data state).

        Returns tokens [B, S], loss mask [B, S], lengths [B], epoch, and the store indices of the B sequences.
        """
        epoch, i = divmod(step, self.batches_per_epoch)
        order = np.random.default_rng((self.cfg.seed, epoch)).permutation(len(self.seqs))
        picked = [self.seqs[j] for j in order[i * self.cfg.batch_size:(i + 1) * self.cfg.batch_size]]
        m = self.cfg.pad_multiple
        s = -(-max(len(t) for t, _, _ in picked) // m) * m
        tokens = np.zeros((len(picked), s), np.int32)
        mask = np.zeros((len(picked), s), bool)
        lengths = np.zeros((len(picked),), np.int32)
        for r, (t, p, _) in enumerate(picked):
            tokens[r, :len(t)] = t
            mask[r, p:len(t)] = True
            lengths[r] = len(t)
        return tokens, mask, lengths, epoch, [i for _, _, i in picked]


def effective_context_vocab(method, sim: bool = False) -> int:
    """The context vocabulary a method scores in its loss (or simulated tau): 0 without a draft vocabulary."""
    if not isinstance(method, DFlashMethod) or method.draft_ids is None:
        return 0  # (EAGLE-3 drafts from its own head: no context vocabulary)
    return method.sim_context_vocab if sim else method.context_vocab


@partial(jax.jit, static_argnames=("tcfg", "tap_indices"))
def target_features(tw: tgt.TargetWeights, tokens, tcfg: ModelConfig, tap_indices: tuple[int, ...]):
    """Frozen target taps for whole sequences [Bt, S] (causal within the sequence, nothing cached)."""
    bt, s = tokens.shape
    kv = tgt.init_kv_pages(tcfg.num_layers, 1, 1, tcfg.num_kv_heads, tcfg.head_dim, tw.embed.dtype)
    batch = tgt.ForwardBatch(tokens, jnp.broadcast_to(jnp.arange(s)[None], (bt, s)),
                             jnp.zeros((bt, s), jnp.int32), jnp.zeros((bt, 1), jnp.int32))
    _, taps, _ = tgt.forward(tw, kv, batch, tcfg, tap_indices)
    return jax.lax.stop_gradient(taps)


def batch_features(target, tokens, seq_indices, tap_indices, cache=None) -> jax.Array:
    """Taps for a training batch: from the feature cache when there is one, else one target forward."""
    if cache is not None:
        return jnp.asarray(cache.batch(seq_indices, tokens.shape[1], tap_indices))
    return target_features(target.weights, jnp.asarray(tokens), target.config, tap_indices)


def tap_statistics(target, batches: "SequenceBatches", tap_indices, num_batches: int = 2, cache=None) -> jax.Array:
    """Per-input-dimension RMS of the concatenated target taps over a few training batches."""
    total, count = 0.0, 0
    for step in range(num_batches):
        tokens, _, lengths, _, idx = batches.batch(step)
        taps = batch_features(target, tokens, idx, tap_indices, cache)
        valid = (jnp.arange(tokens.shape[1])[None, :] < jnp.asarray(lengths)[:, None])[..., None]
        total = total + jnp.sum(jnp.where(valid, taps * taps, 0.0), axis=(0, 1))
        count += int(lengths.sum())
    return jnp.sqrt(total / max(count, 1))


def scale_fc_init(fc: jax.Array, tap_rms: jax.Array) -> jax.Array:
    """Data-dependent init of the feature fusion fc [in, out]: divide each input row by that input's RMS.

    Small targets have "massive activations" (SmolLM2: one residual dimension with RMS ~3000 where the median
    is ~10); with a plain random fc that single dimension dominates every fused feature, which then carries
    almost no information about the position, and training crawls.  Scaling rows by 1/RMS starts every input
    dimension on an equal footing (the format is unchanged: fc is still a plain linear map of the raw taps).
    """
    scaled = fc / jnp.maximum(tap_rms, 1e-6)[:, None]
    target_rms = jnp.sqrt(jnp.mean(fc * fc))
    return (scaled * target_rms / jnp.sqrt(jnp.mean(scaled * scaled))).astype(fc.dtype)


def init_from_target(params, dcfg: DrafterConfig, target, layers: tuple[int, ...]):
    """Start the drafter as a copy of target layers `layers` (one per drafter layer) reading the tap that feeds
    the first of them: fc selects that tap (identity block, other taps 0), hidden_norm is that layer's input
    norm, so the first drafter layer's context K/V start as the target layer's own; the final norm is the
    target's.  Needs the drafter geometry to equal the target's; per-head q/k norms start at 1 (Llama has none)."""
    tcfg, tw = target.config, target.weights
    if tcfg.tensor_parallel != 1:
        raise ValueError("--init-target-layers needs the target on one device (its fused rows in HF order)")
    if len(layers) != dcfg.num_layers:
        raise ValueError(f"--init-target-layers names {len(layers)} layers for a {dcfg.num_layers}-layer drafter")
    if (dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim, dcfg.intermediate_size) != \
            (tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim, tcfg.intermediate_size):
        raise ValueError("--init-target-layers needs the drafter's heads / head_dim / intermediate size to equal "
                         "the target's")
    if layers[0] not in dcfg.hidden_state_indices:
        raise ValueError(f"--init-target-layers: the drafter does not tap hidden state {layers[0]} (the input of "
                         f"target layer {layers[0]}); its taps are {list(dcfg.hidden_state_indices)}")
    new_layers = []
    for drafter_layer, i in zip(params.layers, layers):
        t = tw.layers[i]
        q, kv = jnp.split(t.w_qkv.T, [tcfg.q_size], axis=-1)  # target [out, in] -> drafter [in, out]
        new_layers.append(dataclasses.replace(
            drafter_layer, attn_norm=t.attn_norm, w_q=q, w_kv=kv, w_o=t.w_o.T, mlp_norm=t.mlp_norm,
            w_gate_up=t.w_gate_up.T, w_down=t.w_down.T,
            q_norm=t.q_norm if t.q_norm is not None else drafter_layer.q_norm,
            k_norm=t.k_norm if t.k_norm is not None else drafter_layer.k_norm))
    h = dcfg.target_hidden_size
    tap = dcfg.hidden_state_indices.index(layers[0])
    fc = jnp.zeros_like(params.fc).at[tap * h:(tap + 1) * h].set(jnp.eye(h, dtype=params.fc.dtype))
    params = dataclasses.replace(params, layers=tuple(new_layers), fc=fc,
                                 hidden_norm=tw.layers[layers[0]].attn_norm, norm=tw.final_norm)
    # own copies: training donates its params, and the target's arrays (one of them used twice) must survive
    return jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), params)


def grow_layers(params, dcfg: DrafterConfig, key):
    """Append layers to a trained drafter up to `dcfg.num_layers`, each an identity at first: fresh random
    q/k/v and MLP input matrices but zero output projections (w_o, w_down), so the grown drafter drafts exactly as
    the old one until training moves them (the final norm sees the same residual stream)."""
    from specjax.drafter.loader import init_drafter

    extra = dcfg.num_layers - len(params.layers)
    if extra < 0:
        raise ValueError(f"cannot grow a {len(params.layers)}-layer drafter to {dcfg.num_layers} layers")
    if extra == 0:
        return params
    fresh = init_drafter(dataclasses.replace(dcfg, num_layers=extra), key, dtype=params.fc.dtype).layers
    new = tuple(dataclasses.replace(layer, w_o=jnp.zeros_like(layer.w_o), w_down=jnp.zeros_like(layer.w_down))
                for layer in fresh)
    return dataclasses.replace(params, layers=tuple(params.layers) + new)


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


@dataclass(frozen=True)
class DFlashMethod:
    """DFlash objective: anchored blocks, same-position labels, exp(-(k-1)/gamma) decay; optionally over a draft
    vocabulary (`draft_ids`, sorted target ids: the loss and the drafts use only those rows of the head)."""

    dcfg: DrafterConfig
    block_size: int
    num_anchors: int
    gamma: float
    name: str = "dflash"
    draft_ids: tuple[int, ...] | None = None
    init_layers: tuple[int, ...] | None = None  # copy these target layers into the drafter (see init_from_target)
    dpace_alpha: float | None = None  # D-PACE slot weights (objective.dpace_weights) instead of the fixed decay
    distill: float = 0.0  # weight of the KL to the target's own next-token distribution (objective.dflash_loss)
    teacher_tap: int | None = None  # hidden-state index of the target's last layer (its num_layers), for distill
    teacher_eps: float = 1e-6  # the target's rms_norm_eps (its final norm)
    sim_block: int | None = None  # block simulated tau drafts (anchor included; default block_size)
    # with a draft vocabulary: each sequence's last N distinct prompt tokens outside it scored beside it, as the
    # engine drafts them (EngineConfig.context_vocab): in the loss (context_vocab) and in simulated tau (sim_...)
    context_vocab: int = 0
    sim_context_vocab: int = 0

    def __post_init__(self):
        if self.distill and self.teacher_tap is None:
            raise ValueError("distillation needs teacher_tap (the target's num_layers)")
        if self.distill and self.context_vocab:
            raise ValueError("--distill covers the draft vocabulary only: it cannot train --context-vocab")
        if self.context_vocab < 0 or self.sim_context_vocab < 0:
            raise ValueError("--context-vocab and --sim-context-vocab must be >= 0")
        if self.sim_block is not None and not 2 <= self.sim_block <= self.block_size:
            raise ValueError(f"--sim-block-size {self.sim_block} must be in [2, the training block "
                             f"{self.block_size}]")

    @property
    def tap_indices(self):
        """The drafter's taps, then (when distilling) the target's last-layer output the teacher logits come from."""
        return self.dcfg.hidden_state_indices + ((self.teacher_tap,) if self.distill else ())

    def split_taps(self, taps):
        """Batch taps [.., F*H (+ H)] -> (the drafter's, the teacher's final hidden state or None)."""
        if not self.distill:
            return taps, None
        h = self.dcfg.target_hidden_size
        return taps[..., :-h], taps[..., -h:]

    @property
    def sim_span(self) -> int:
        """Block size simulated tau drafts and scores (HeldOutSet), anchor included: `dflash@K` in the engine
        drafts a block of K + 1, so tau(K) at span K + 1 is the engine's own setting."""
        return self.sim_block or self.block_size

    def init_params(self, key, target, tap_rms=None):
        from specjax.drafter.loader import init_drafter

        params = init_drafter(self.dcfg, key, dtype=target.weights.embed.dtype)
        if tap_rms is not None:  # (a teacher tap comes last and is not an input of fc)
            params = dataclasses.replace(params, fc=scale_fc_init(params.fc, tap_rms[:params.fc.shape[0]]))
        if params.mask_embedding is not None:  # start the learned mask at the typical embedding, not at noise
            params = dataclasses.replace(params, mask_embedding=jnp.mean(target.weights.embed, axis=0))
        if params.slot_embedding is not None:  # offsets at half the typical embedding norm: distinct from step 0
            rms = jnp.sqrt(jnp.mean(target.weights.embed ** 2))
            params = dataclasses.replace(params, slot_embedding=0.5 * rms * jax.random.normal(
                jax.random.fold_in(key, 1), params.slot_embedding.shape, params.slot_embedding.dtype))
        if self.init_layers:
            params = init_from_target(params, self.dcfg, target, self.init_layers)
        return params

    def constants(self, target):
        head = target.weights.output_head
        final_norm = target.weights.final_norm if self.distill else None
        if self.draft_ids is None:
            return (target.weights.embed, head, None, final_norm, None)
        ids = np.asarray(self.draft_ids)
        t2d = -np.ones(self.dcfg.vocab_size, np.int32)
        t2d[ids] = np.arange(len(ids))
        rows = target.weights.vocab_rows if self.context_vocab or self.sim_context_vocab else None  # [V, H]
        return (target.weights.embed, jnp.take(head, jnp.asarray(ids), axis=1), jnp.asarray(t2d), final_norm, rows)

    def context_ids(self, tokens, mask, size: int) -> np.ndarray | None:
        """Host int32 [Bt, size]: each row's context vocabulary (its prompt = the tokens before the first loss
        position), or None without a draft vocabulary or with size 0."""
        if self.draft_ids is None or not size:
            return None
        draftable = draft_mask(self.draft_ids, self.dcfg.vocab_size)
        tokens, mask = np.asarray(tokens), np.asarray(mask)
        return np.stack([context_ids(t[:int(np.argmax(m)) if m.any() else 0], draftable, size)
                         for t, m in zip(tokens, mask)])

    def host_inputs(self, step_seed, tokens, mask, lengths):
        anchors, keep = sample_anchors(np.random.default_rng(step_seed), mask, lengths, self.num_anchors,
                                       self.block_size)
        ids = self.context_ids(tokens, mask, self.context_vocab)
        return (jnp.asarray(anchors), jnp.asarray(keep)) + (() if ids is None else (jnp.asarray(ids),))

    def loss(self, params, consts, tokens, taps, mask, lengths, extra):
        embed, head, t2d, final_norm, rows = consts
        taps, final_hidden = self.split_taps(taps)
        teacher = None
        if final_hidden is not None:
            teacher = teacher_logits(final_hidden, final_norm, self.teacher_eps, head, extra[0], self.block_size)
        context = (extra[2], rows) if len(extra) > 2 else None
        return dflash_loss(params, self.dcfg, embed, head, tokens, taps, mask, lengths, *extra[:2], self.block_size,
                           self.gamma, t2d, self.dpace_alpha, teacher, self.distill, context)

    def simulate(self, params, consts, tokens, taps, mask, lengths, anchors, keep, context=None):
        embed, head, t2d, _, rows = consts
        return simulated_acceptance(params, self.dcfg, embed, head, tokens, self.split_taps(taps)[0], mask, lengths,
                                    anchors, keep, self.sim_span, t2d, None if context is None else (context, rows))

    def full(self, params):
        """Trainable params -> a complete drafter (the draft vocabulary attached)."""
        if self.draft_ids is None:
            return params
        return dataclasses.replace(params, draft_ids=jnp.asarray(self.draft_ids, jnp.int32))

    def save(self, path, params, dtype="float32"):
        save_drafter(path, self.dcfg, self.full(params), dtype=dtype)

    def load(self, path, tcfg):
        """A saved drafter's weights, grown to this method's layer count when it has fewer (`grow_layers`), its
        slot offsets cut to this method's block when that is smaller (the first slots keep theirs)."""
        params = dataclasses.replace(load_drafter(path, tcfg)[1], draft_ids=None)
        if params.slot_embedding is not None:
            if params.slot_embedding.shape[0] < self.dcfg.block_size:
                raise ValueError(f"{path} has slot offsets for a block of {params.slot_embedding.shape[0]}, not "
                                 f"{self.dcfg.block_size}")
            params = dataclasses.replace(params, slot_embedding=params.slot_embedding[:self.dcfg.block_size])
        return grow_layers(params, self.dcfg, jax.random.PRNGKey(len(params.layers)))

    def evaluate(self, target, params, prompts, max_new_tokens):
        from specjax.spec.proposer import DFlashProposer

        return evaluate_tau(target, DFlashProposer(self.dcfg, self.block_size), self.full(params), prompts,
                            max_new_tokens)


@dataclass(frozen=True)
class Eagle3Method:
    """EAGLE-3 training-time test: 7 unrolled steps, weights 0.8^k, CE over the draft vocabulary."""

    ecfg: "Eagle3Config"
    draft_ids: tuple[int, ...]  # sorted target ids of the draft vocabulary
    num_target_layers: int
    ttt_steps: int = 7
    num_draft: int = 4
    name: str = "eagle3"

    @property
    def tap_indices(self):
        return self.ecfg.hidden_state_indices

    @property
    def sim_span(self) -> int:
        """Simulated tau scores a chain of ttt_steps drafts like a DFlash block of that many drafts plus the bonus."""
        return self.ttt_steps + 1

    def d2t(self):
        ids = np.asarray(self.draft_ids)
        return jnp.asarray(ids - np.arange(len(ids)), jnp.int32)

    def init_params(self, key, target, tap_rms=None):
        from specjax.drafter.eagle3_loader import init_eagle3

        w = init_eagle3(self.ecfg, key, draft_token_ids=np.asarray(self.draft_ids), dtype=target.weights.embed.dtype)
        if tap_rms is not None:
            # EAGLE-3 also feeds fc's raw output into the residual stream: keep its scale near the target's (~1/dim)
            w = dataclasses.replace(w, fc=scale_fc_init(w.fc, tap_rms))
        return dataclasses.replace(w, d2t=None)  # the integer map is a constant, not a trainable leaf

    def constants(self, target):
        t2d = -np.ones(self.ecfg.vocab_size, np.int32)
        t2d[np.asarray(self.draft_ids)] = np.arange(len(self.draft_ids))
        return (target.weights.embed, jnp.asarray(t2d))

    def host_inputs(self, step_seed, tokens, mask, lengths):
        return ()

    def loss(self, params, consts, tokens, taps, mask, lengths, extra):
        from specjax.train.eagle3_objective import ttt_loss

        embed, t2d = consts
        return ttt_loss(params, self.ecfg, embed, tokens, taps, mask, lengths, t2d, self.ttt_steps)

    def simulate(self, params, consts, tokens, taps, mask, lengths, anchors, keep):
        from specjax.train.eagle3_objective import ttt_acceptance

        embed, t2d = consts
        return ttt_acceptance(params, self.ecfg, embed, tokens, taps, mask, lengths, anchors, keep, t2d,
                              self.ttt_steps)

    def full(self, params):
        return dataclasses.replace(params, d2t=self.d2t() if len(self.draft_ids) < self.ecfg.vocab_size else None)

    def save(self, path, params, dtype="float32"):
        from specjax.drafter.eagle3_loader import save_eagle3

        save_eagle3(path, self.ecfg, self.full(params), num_target_layers=self.num_target_layers, dtype=dtype)

    def load(self, path, tcfg):
        from specjax.drafter.eagle3_loader import load_eagle3

        return dataclasses.replace(load_eagle3(path, tcfg)[1], d2t=None)

    def evaluate(self, target, params, prompts, max_new_tokens):
        from specjax.drafter.eagle3 import Eagle3Params
        from specjax.spec.proposer import Eagle3Proposer

        return evaluate_tau(target, Eagle3Proposer(self.ecfg, self.num_draft),
                            Eagle3Params(self.full(params), target.weights.embed), prompts, max_new_tokens)


@partial(jax.jit, static_argnames=("method", "optimizer"), donate_argnames=("params", "opt_state"))
def train_step(params, opt_state, consts, tokens, taps, loss_mask, lengths, extra, lr_scale, *, method, optimizer):
    (loss, aux), grads = jax.value_and_grad(
        lambda p: method.loss(p, consts, tokens, taps, loss_mask, lengths, extra), has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
    return optax.apply_updates(params, updates), opt_state, loss, aux, optax.tree.norm(grads)


def save_checkpoint(out_dir: str, step: int, method, params, opt_state, cfg: TrainConfig) -> None:
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
        import shutil
        shutil.rmtree(ckpt + ".old")


def load_checkpoint(out_dir: str, method, tcfg: ModelConfig, opt_state_template):
    ckpt = os.path.join(out_dir, "checkpoint")
    params = method.load(os.path.join(ckpt, "drafter"), tcfg)
    with np.load(os.path.join(ckpt, "opt_state.npz")) as data:
        leaves = [jnp.asarray(data[f"arr_{i}"]) for i in range(len(data.files))]
    treedef = jax.tree_util.tree_structure(opt_state_template)
    with open(os.path.join(ckpt, "trainer.json")) as fh:
        meta = json.load(fh)
    return params, jax.tree_util.tree_unflatten(treedef, leaves), meta["step"]


def evaluate_tau(target, proposer, params, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Greedy speculative generation with the real engine on held-out prompts -> tau and per-position acceptance."""
    from specjax.engine.engine import LLMEngine
    from specjax.sampling import SamplingParams

    k = proposer.max_draft_tokens
    max_len = max(len(p) for p in prompts) + max_new_tokens + k + 2
    engine = LLMEngine(target.config, target.weights, proposer, params,
                       EngineConfig(max_model_len=-(-max_len // 64) * 64, max_num_seqs=min(8, len(prompts))))
    seqs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    taus = [t for s in seqs for t in s.stats.acceptance_lengths]
    drafted = np.zeros(k)
    accepted = np.zeros(k)
    for s in seqs:
        n = len(s.stats.drafted_per_position)
        drafted[:n] += s.stats.drafted_per_position
        accepted[:n] += s.stats.accepted_per_position
    return {"tau": float(np.mean(taus)) if taus else 0.0, "steps": len(taus),
            "per_position": [float(a / d) if d else 0.0 for a, d in zip(accepted, drafted)]}


def plot_curves(log_path: str, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(log_path)]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval" in r]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], color="tab:blue", lw=0.8, label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("weighted CE loss", color="tab:blue")
    if evals:
        ax2 = ax.twinx()
        for name in sorted({k for r in evals for k in r["eval"]}):
            pts = [(r["step"], r["eval"][name]["tau"]) for r in evals if name in r["eval"]]
            ax2.plot(*zip(*pts), "o-", label=f"tau {name}")
        ax2.set_ylabel("tau (held-out, greedy)")
        ax2.legend(loc="center right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def last_hours(log_path: str) -> float:
    """Cumulative training hours recorded in a learning-curve log (0 if none): resumed runs continue from it."""
    hours = 0.0
    if os.path.exists(log_path):
        with open(log_path) as fh:
            for line in fh:
                try:
                    hours = max(hours, float(json.loads(line).get("hours", 0.0)))
                except (json.JSONDecodeError, AttributeError):
                    continue
    return hours


def train_drafter(target, store: TokenStore, out_dir: str, method, cfg: TrainConfig, resume: bool,
                  eval_sets: dict[str, list[list[int]]], eval_max_new_tokens: int = 96, save_dtype: str = "float32",
                  show_progress: bool = True, features=None, init_from: str | None = None, heldout=None,
                  log_path: str | None = None, mesh=None, feature_target=None) -> dict:
    """Train (or resume) a drafter for `target`; writes out_dir/{drafter,checkpoint,log.jsonl,curve.png}.

    With `cfg.keep_best`, also out_dir/best-drafter and best.json: the drafter of the highest simulated tau (all
    held-out sources, the longest K) seen by this run, for runs that outlast their data (many epochs overfit).

    `features`: an optional FeatureCache over `store` holding the method's taps (checked before training).
    `init_from`: start from this drafter checkpoint's weights (fresh optimizer state) instead of a random init.
    `heldout`: a HeldOutSet for simulated tau every `cfg.sim_every` steps.  `log_path`: a learning-curve log
    that is always appended to, with cumulative wall-clock hours, so one curve spans many runs (default
    out_dir/log.jsonl, reset by a fresh run, appended to by --resume and --init).  `mesh`: data parallelism,
    each batch split over the mesh's devices (the drafter, optimizer state and frozen target arrays replicated;
    XLA reduces the gradients), the same losses as one device up to float rounding.  `feature_target`: the target
    whose forward gives the online taps and runs the evaluations, when it is not `target` (e.g. the same GGUF on
    the CPU kernels, as inference runs it: its taps are what the drafter reads there); `target` gives the frozen
    embedding and head.
    """
    from tqdm import tqdm

    from specjax.parallel import mesh_size, replicate, shard_batch

    if cfg.keep_best and heldout is None:
        raise ValueError("--keep-best picks the drafter by simulated tau on held-out answers: give --heldout")
    if cfg.batch_size % mesh_size(mesh):
        raise ValueError(f"--batch-size {cfg.batch_size} must be a multiple of the {mesh_size(mesh)} data-parallel "
                         "devices")
    os.makedirs(out_dir, exist_ok=True)
    batches = SequenceBatches(store, cfg)
    optimizer, schedule = make_optimizer(cfg)
    tcfg = target.config
    if features is not None:
        features.check(store, method.tap_indices, tcfg.hidden_size, cfg.max_len)
    served = feature_target if feature_target is not None else target
    tap_rms = None if init_from else tap_statistics(served, batches, method.tap_indices, cache=features)
    params = method.load(init_from, tcfg) if init_from else method.init_params(jax.random.PRNGKey(cfg.seed), target,
                                                                                tap_rms)
    opt_state = optimizer.init(params)
    step0, summary = 0, {}
    shared_log = log_path is not None  # an explicit learning-curve log is always appended to, never reset
    log_path = log_path or os.path.join(out_dir, "log.jsonl")
    if resume and os.path.isdir(os.path.join(out_dir, "checkpoint")):
        params, opt_state, step0 = load_checkpoint(out_dir, method, tcfg, opt_state)
        if cfg.keep_best and os.path.exists(os.path.join(out_dir, "best.json")):
            with open(os.path.join(out_dir, "best.json")) as fh:
                summary["best"] = json.load(fh)  # a resumed run keeps the best of the runs before it
        log.info("resumed from step %d", step0)
    elif os.path.exists(log_path) and not init_from and not shared_log:
        os.remove(log_path)
    hours0 = last_hours(log_path)
    with open(os.path.join(out_dir, "train_config.json"), "w") as fh:
        json.dump({"method": method.name, "train": dataclasses.asdict(cfg), "data": store.path,
                   "features": features.path if features is not None else "online", "init_from": init_from,
                   "feature_kernels": served.kernel_activations,
                   "context_vocab": effective_context_vocab(method),
                   "sim_context_vocab": effective_context_vocab(method, True),
                   "data_sequences": len(batches.seqs), "data_tokens": batches.num_tokens,
                   "data_parallel_devices": [str(d) for d in (mesh.devices.flat if mesh is not None else [])]},
                  fh, indent=1)
    consts = method.constants(target)
    eval_consts = consts  # evaluation runs on one device (the engine and the held-out set live there)
    params, opt_state, consts = replicate((params, opt_state, consts), mesh)
    bar = tqdm(total=cfg.steps, initial=step0, unit="step", dynamic_ncols=True, disable=not show_progress)
    t_start, tokens_seen = time.perf_counter(), 0

    def write(row):
        with open(log_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def on_one_device(p):
        return p if mesh is None else jax.device_put(p, jax.devices()[0])

    def simulate(step):
        sim = heldout.evaluate(method, on_one_device(params), eval_consts)
        write({"step": step, "hours": hours0 + (time.perf_counter() - t_start) / 3600, "sim": sim,
               "sim_block": method.sim_span, "sim_context_vocab": effective_context_vocab(method, True)})
        bar.write(f"step {step}: simulated tau(K={len(sim['all']['tau'])}) = {sim['all']['tau'][-1]:.3f}, "
                  f"tau(3) = {sim['all']['tau'][min(2, len(sim['all']['tau']) - 1)]:.3f}")
        summary["sim"] = sim
        tau = sim["all"]["tau"][-1]
        if cfg.keep_best and tau > summary.get("best", {}).get("tau", -1.0):
            summary["best"] = {"step": step, "tau": tau, "hours": hours0 + (time.perf_counter() - t_start) / 3600}
            method.save(os.path.join(out_dir, "best-drafter"), on_one_device(params), dtype=save_dtype)
            with open(os.path.join(out_dir, "best.json"), "w") as fh:
                json.dump(summary["best"], fh)

    if heldout is not None and cfg.sim_every and step0 == 0:
        simulate(0)
    done = step0  # steps completed (a run with --steps at or below the checkpoint's only saves the drafter)
    deadline = t_start + cfg.max_hours * 3600 if cfg.max_hours is not None else None
    t_first = None  # end of this run's first step: the cosine-time schedule runs from there to the deadline
    for step in range(step0, cfg.steps):
        tokens, mask, lengths, epoch, idx = batches.batch(step)
        extra = method.host_inputs((cfg.seed, step), tokens, mask, lengths)
        taps = batch_features(served, tokens, idx, method.tap_indices, features)
        inputs = shard_batch((jnp.asarray(tokens), taps, jnp.asarray(mask), jnp.asarray(lengths), extra), mesh)
        scale = 1.0
        if cfg.schedule == "cosine-time":
            now = time.perf_counter()
            scale = time_scale(cfg, 0.0 if t_first is None else (now - t_first) / max(1e-9, deadline - t_first))
        params, opt_state, loss, aux, gnorm = train_step(params, opt_state, consts, *inputs,
                                                         jnp.float32(scale), method=method, optimizer=optimizer)
        tokens_seen += int(lengths.sum())
        done = step + 1
        if t_first is None and cfg.schedule == "cosine-time":
            jax.block_until_ready(loss)  # once: the schedule's clock starts after the first step's compile
            t_first = time.perf_counter()
        elapsed = time.perf_counter() - t_start
        out_of_time = deadline is not None and time.perf_counter() >= deadline
        last = step + 1 == cfg.steps or out_of_time
        if (step + 1) % cfg.log_every == 0 or last:
            loss_v, acc_v = float(loss), float(aux["acc"])
            row = {"step": step + 1, "epoch": epoch, "loss": loss_v, "acc": acc_v, "grad_norm": float(gnorm),
                   "lr": float(schedule(step)) * scale,
                   "acc_per_slot": [round(float(a), 4) for a in aux["acc_per_slot"]],
                   "tokens_per_s": tokens_seen / elapsed, "elapsed_s": elapsed, "hours": hours0 + elapsed / 3600}
            write(row)
            bar.set_postfix(loss=f"{loss_v:.3f}", acc=f"{acc_v:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
        bar.update(1)
        if (step + 1) % cfg.save_every == 0 or last:
            save_checkpoint(out_dir, step + 1, method, params, opt_state, cfg)
        if heldout is not None and cfg.sim_every and ((step + 1) % cfg.sim_every == 0 or last):
            simulate(step + 1)
        if eval_sets and ((step + 1) % cfg.eval_every == 0 or last):
            ev = {name: method.evaluate(served, on_one_device(params), prompts, eval_max_new_tokens)
                  for name, prompts in eval_sets.items()}
            write({"step": step + 1, "hours": hours0 + (time.perf_counter() - t_start) / 3600, "eval": ev})
            bar.write(f"step {step + 1}: " + ", ".join(f"tau[{k}]={v['tau']:.2f}" for k, v in ev.items()))
            summary["eval"] = ev
            plot_curves(log_path, os.path.join(out_dir, "curve.png"))
        if out_of_time:
            bar.write(f"stopping at step {step + 1}: --max-hours {cfg.max_hours} reached")
            break
    bar.close()
    method.save(os.path.join(out_dir, "drafter"), params, dtype=save_dtype)
    if os.path.exists(log_path):  # a run of 0 steps (re-saving a drafter) has nothing to plot
        plot_curves(log_path, os.path.join(out_dir, "curve.png"))
    if heldout is not None and cfg.sim_every:
        from specjax.train.simtau import plot_sim_curves

        plot_sim_curves({method.name: log_path}, os.path.join(out_dir, "sim-curve.png"),
                        "simulated tau on held-out target answers")
    summary.update({"steps": done, "wall_s": time.perf_counter() - t_start, "tokens_seen": tokens_seen,
                    "data_sequences": len(batches.seqs), "data_tokens": batches.num_tokens})
    return summary
