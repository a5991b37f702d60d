"""Jitted step functions (module level, static configs): prefill, speculative decode, and the KV commit.

Both steps serve every method: the proposer is a static, hashable argument (spec/proposer.py) and plain
decoding is the NoProposer with K = 0.  One decode step = propose K drafts -> verify [bonus, drafts] in one
target forward -> accept on the device -> proposer context rows for the accepted tokens.  Steps only READ the
caches; `commit` then writes the new rows into the donated pools in place (see model/attention.py for why the
two are separate calls).  The host syncs once per step to read (num_accepted, tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.model import target as tgt
from specjax.model.attention import write_rows
from specjax.sampling import split_mode, token_logprobs
from specjax.spec.verify import accept


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingBatch:
    temperature: jax.Array  # [B] float32 (0 = greedy)
    top_k: jax.Array  # [B] int32 (0 = off)
    top_p: jax.Array  # [B] float32
    seeds: jax.Array  # [B] int32


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DecodeBatch:
    bonus: jax.Array  # [B] last committed token, at position `start`, not yet in the KV cache
    start: jax.Array  # [B] its position (= number of tokens already in the target KV cache)
    slots: jax.Array  # [B, K + 1] KV slots of positions start .. start + K (-1 = beyond capacity / padding)
    page_table: jax.Array  # [B, Pg]
    num_drafts: jax.Array  # [B] drafts each sequence may accept (<= K)
    host_drafts: jax.Array  # [B, K] drafts from a host proposer, or prompt lookup's beside a device one (decode_step)
    extra_ids: jax.Array | None = None  # [B, E] context tokens the proposer may draft beyond `draftable` (-1 = none)


@partial(jax.jit, static_argnames=("tcfg", "proposer", "mode"))
def prefill_step(tw, kv, pw, pstate, batch: tgt.ForwardBatch, last_index, next_tokens, sampling: SamplingBatch, *,
                 tcfg: ModelConfig, proposer, mode: str):
    """Run prompt chunks [B, T]; sample the token after each row's `last_index` (used only for final chunks).

    `next_tokens` [B, T] is the token following each position (the next prompt token; -1 where it is the token
    being sampled now, which is substituted on the device).  Returns (first_tokens [B], target rows, proposer
    rows, logprobs): both sets of rows go to batch.slots.  `logprobs` is None unless `mode` asks for them: then
    `token_logprobs` [B, T] of each row's next token: the sampled token's (its row) under the request's sampling
    transform, and with PROMPT_LOGPROBS the prompt's under the raw logits (zeros without).
    """
    hidden, taps, rows = tgt.forward(tw, kv, batch, tcfg, proposer.tap_indices)
    last_hidden = jnp.take_along_axis(hidden, last_index[:, None, None], axis=1)  # [B, 1, D]
    last_pos = jnp.take_along_axis(batch.positions, last_index[:, None], axis=1)[:, 0]  # [B]
    no_drafts = jnp.zeros((hidden.shape[0], 0), jnp.int32)
    logits, greedy = tgt.logits_and_greedy(tw, last_hidden)
    _, tokens = accept(logits, no_drafts, jnp.zeros_like(last_pos), last_pos, sampling.temperature, sampling.top_k,
                       sampling.top_p, sampling.seeds, mode, greedy)
    sampled_now = next_tokens < 0  # [B, T]: the row whose next token is the one sampled now (final chunks)
    next_tokens = jnp.where(sampled_now, tokens[:, :1], next_tokens)
    logprobs = None
    _, sampled_logprobs, prompt_logprobs = split_mode(mode)
    if sampled_logprobs:
        last = token_logprobs(logits, tokens[:, :1], sampling.temperature, sampling.top_k, sampling.top_p, mode)
        # the model's own distribution over the prompt (rows of zeros without PROMPT_LOGPROBS)
        prompt = (token_logprobs(tgt.logits(tw, hidden), next_tokens) if prompt_logprobs
                  else tuple(jnp.zeros(next_tokens.shape + a.shape[2:], a.dtype) for a in last))
        logprobs = tuple(jnp.where(sampled_now.reshape(sampled_now.shape + (1,) * (a.ndim - 2)), b, a)
                         for a, b in zip(prompt, last))
    return tokens[:, 0], rows, proposer.observe(pw, taps, batch.positions, next_tokens), logprobs


@partial(jax.jit, static_argnames=("tcfg", "proposer", "num_draft", "mode", "lookup"))
def decode_step(tw, kv, pw, pstate, inputs: DecodeBatch, sampling: SamplingBatch, *, tcfg: ModelConfig,
                proposer, num_draft: int, mode: str, lookup: bool = False):
    """One speculative step for the whole batch.  `lookup` (a device proposer beside prompt lookup): rows of
    inputs.host_drafts >= 0 are verified instead of the proposer's drafts, which are computed only if a row is -1.

    Returns (num_accepted [B], tokens [B, K+1], drafts [B, K], target rows, proposer rows, proposer slots,
    logprobs); the step commits tokens[:, :num_accepted + 1].  `logprobs` is None unless `mode` asks for them:
    then `token_logprobs` of `tokens` under the request's sampling transform (each row is the distribution the
    token was drawn from: the same as plain decoding's at that position).  Target rows go to inputs.slots (rows
    past the accepted length are garbage that later steps overwrite); proposer rows only to the accepted positions.
    """
    extra = {} if inputs.extra_ids is None else {"extra_ids": inputs.extra_ids}  # (only with `draftable`)
    if num_draft == 0:
        drafts = jnp.zeros((inputs.bonus.shape[0], 0), jnp.int32)
    elif proposer.on_device and lookup:
        looked_up = inputs.host_drafts[:, :1] >= 0
        drafts = jax.lax.cond(
            looked_up.all(), lambda: inputs.host_drafts,
            lambda: jnp.where(looked_up, inputs.host_drafts, proposer.propose(
                pw, pstate, tw, inputs.bonus, inputs.start, inputs.page_table, num_draft, **extra)))
    elif proposer.on_device:
        drafts = proposer.propose(pw, pstate, tw, inputs.bonus, inputs.start, inputs.page_table, num_draft, **extra)
    else:
        drafts = inputs.host_drafts
    block = jnp.concatenate([inputs.bonus[:, None], drafts], axis=1)  # [B, K + 1]
    positions = inputs.start[:, None] + jnp.arange(num_draft + 1)[None, :]
    batch = tgt.ForwardBatch(block, positions, inputs.slots, inputs.page_table)
    hidden, taps, rows = tgt.forward(tw, kv, batch, tcfg, proposer.tap_indices)
    logits, greedy = tgt.logits_and_greedy(tw, hidden)
    num_accepted, tokens = accept(logits, drafts, inputs.num_drafts, inputs.start, sampling.temperature,
                                  sampling.top_k, sampling.top_p, sampling.seeds, mode, greedy)
    # Only the rows now part of the sequence (the old bonus and the accepted drafts) become proposer context.
    kept = jnp.arange(num_draft + 1)[None, :] <= num_accepted[:, None]
    logprobs = None
    if split_mode(mode)[1]:
        logprobs = token_logprobs(logits, tokens, sampling.temperature, sampling.top_k, sampling.top_p, mode)
    # tokens[:, j] is the target's token for position start + j + 1: the token following row j.
    return (num_accepted, tokens, drafts, rows, proposer.observe(pw, taps, positions, tokens),
            jnp.where(kept, inputs.slots, -1), logprobs)


@partial(jax.jit, donate_argnames=("kv", "pstate"), static_argnames=("kernel",))
def commit(kv, pstate, slots, rows, proposer_slots, proposer_rows, *, kernel: str | None = None):
    """Write a step's new K/V rows into the target and proposer pools, in place (`kernel`:
    TargetWeights.kv_write_kernel, every pool in one call)."""
    return write_rows(kv, slots, rows, kernel), write_rows(pstate, proposer_slots, proposer_rows, kernel)
