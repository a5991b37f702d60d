"""Training objectives as methods the loop calls (`DFlashMethod`, `Eagle3Method`): the drafter's init, its frozen
target constants, host-side batch inputs, loss, simulated acceptance, and save / load / engine evaluation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import DrafterConfig
from specjax.drafter.eagle3 import Eagle3Config
from specjax.drafter.loader import init_drafter, load_drafter, save_drafter
from specjax.spec.context_vocab import context_ids, draft_mask
from specjax.train.drafter_init import grow_layers, init_from_target, scale_fc_init
from specjax.train.eagle3_objective import ttt_acceptance, ttt_loss
from specjax.train.evaluate import evaluate_tau
from specjax.train.objective import dflash_loss, sample_anchors, simulated_acceptance, teacher_logits


def effective_context_vocab(method, sim: bool = False) -> int:
    """The context vocabulary a method scores in its loss (or simulated tau): 0 without a draft vocabulary."""
    if not isinstance(method, DFlashMethod) or method.draft_ids is None:
        return 0  # (EAGLE-3 drafts from its own head: no context vocabulary)
    return method.sim_context_vocab if sim else method.context_vocab


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

    ecfg: Eagle3Config
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
        embed, t2d = consts
        return ttt_loss(params, self.ecfg, embed, tokens, taps, mask, lengths, t2d, self.ttt_steps)

    def simulate(self, params, consts, tokens, taps, mask, lengths, anchors, keep):
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

