"""The proposer interface shared by every drafting method, and its two simplest members.

The engine asks a proposer for up to K draft tokens per sequence and tells it what was accepted; verification
is the same for all methods.  A proposer is a frozen, hashable dataclass (a static argument of the jitted step
functions) whose methods are pure functions of (params, state, inputs):

* `init_state(num_pages, page_size)`  device state, e.g. the drafter's paged K/V (shares the target's page
  tables and slots) or None.
* `observe(params, taps, positions, next_tokens)`  called with target hidden states (at `tap_indices`) of the
  tokens a step processed and, for each row, the token that follows it (EAGLE-style drafters pair the hidden
  state at p with the token at p + 1); returns rows (KVRows) that the engine writes into `state` at the slots
  of the tokens that are now part of the sequence (the prompt after prefill, the accepted rows after
  verification; rejected and padding rows get slot -1 and are never written).  None = nothing to write.
* `propose(params, state, target, bonus, start, page_table, num_draft)`  -> int32 drafts [B, num_draft]
  for the tokens after `bonus` (which sits at position `start`).
* `draftable(params)` (optional)  host bool [V]: the target ids the drafts can take, when that is not all of
  them (a draft vocabulary); the engine then also passes `propose(..., extra_ids=[B, E])`, each sequence's
  context tokens outside it (spec/context_vocab.py), which it may draft too.
* `prepare(params, target)` (optional)  called once by the engine: derived, read-only params (e.g. the draft
  vocabulary's head rows).
* `pages_in_place(kernel, dtype)`  whether every read of the paged state by `propose` goes to the in-place
  attention kernel `kernel` (model/attention.py `reads_pages_in_place`): then a step's page-table width costs
  nothing and the engine passes the widest one (fewer compiled shapes).
* `observes_next_token` (optional, default False)  whether `observe`'s row at position p depends on the token at
  p + 1 (EAGLE-3's does): the prefix cache then names a page by its tokens and the one after them (kv/allocator.py).
* Host proposers (n-gram) set `on_device = False` and implement `host_propose(token_ids, k)` instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from specjax.config import ConfigError, DrafterConfig
from specjax.drafter import dflash
from specjax.drafter.eagle3 import Eagle3Config
from specjax.model.attention import reads_pages_in_place
from specjax.model.stack import stack_layers, stackable
from specjax.model.target import init_kv_pages
from specjax.spec.context_vocab import draft_mask
from specjax.spec.lookup import copy_after


@dataclass(frozen=True)
class NoProposer:
    """Plain autoregressive decoding: nothing is drafted (K = 0)."""

    name: str = "ar"
    on_device: bool = True
    tap_indices: tuple[int, ...] = ()
    max_draft_tokens: int = 0

    def init_state(self, num_pages: int, page_size: int, dtype=jnp.float32):
        return None

    def observe(self, params, taps, positions, next_tokens):
        return None

    def propose(self, params, state, target, bonus, start, page_table, num_draft):
        return jnp.zeros((bonus.shape[0], num_draft), jnp.int32)

    def pages_in_place(self, kernel, dtype) -> bool:
        return True  # reads no pages


@dataclass(frozen=True)
class DFlashProposer:
    """Block-diffusion drafting: one drafter forward proposes the whole block (see drafter/dflash.py)."""

    cfg: DrafterConfig
    block_size: int
    name: str = "dflash"
    on_device: bool = True

    def __post_init__(self):
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2, got {self.block_size}")
        if self.cfg.has_slot_embedding and self.block_size > self.cfg.block_size:
            raise ConfigError(f"block_size={self.block_size} exceeds the drafter's {self.cfg.block_size}: its slot "
                              "embeddings exist only for the block it was trained with")

    @property
    def tap_indices(self) -> tuple[int, ...]:
        return self.cfg.hidden_state_indices

    @property
    def max_draft_tokens(self) -> int:
        return self.block_size - 1

    def init_state(self, num_pages: int, page_size: int, dtype=jnp.float32):
        return init_kv_pages(self.cfg.num_layers, num_pages, page_size, self.cfg.num_kv_heads, self.cfg.head_dim,
                             dtype)

    def observe(self, params, taps, positions, next_tokens):
        return dflash.observe(params, self.cfg, taps, positions)

    def propose(self, params, state, target, bonus, start, page_table, num_draft, extra_ids=None):
        return dflash.propose_tokens(params, self.cfg, state, target.embed, target.head_matrix, bonus, start,
                                     page_table, num_draft, self.block_size, target.attention_kernel,
                                     target.argmax_kernel, extra_ids, target.vocab_rows)

    def draftable(self, params) -> np.ndarray | None:
        """bool [V]: the draft vocabulary, or None when the drafter drafts every id."""
        return None if params.draft_ids is None else draft_mask(params.draft_ids, self.cfg.vocab_size)

    def pages_in_place(self, kernel, dtype) -> bool:
        return reads_pages_in_place(kernel, self.block_size, dtype, self.cfg.head_dim)  # one block of queries

    def prepare(self, params, target):
        """Once per engine: cut the draft vocabulary's head rows (if any) out of the target head (its GGUF blocks
        when the target head runs on the CPU kernels).  On the kernels the drafter's matrices follow the target's
        products: beside integer-activation ones they are quantized as Q8_0 for the int8 kernel (drafts only:
        their rounding moves no output)
        (dflash.with_q8_0_kernel: 0.91-0.97 ms instead of 1.20-1.39 for a block of 4, tau within 0.01 of the
        bfloat16 drafter's on every bench dataset) and its layers stacked as the target's are (model/stack.py: a
        step's arguments 73 -> 59); beside float32-activation ones a bfloat16 drafter's matrices go through the
        BF16 kernel, the same weights (dflash.with_bf16_kernel)."""
        params = dflash.with_draft_head(params, target.head_matrix)
        if target.attention_kernel is not None:  # the target was loaded onto specjax's CPU kernels
            from specjax.kernels import quant_kernels

            kernels = quant_kernels()
            if kernels is not None and target.integer_products:
                params = dflash.with_q8_0_kernel(params, kernels.targets["Q8_0_I8"])
                if stackable(params.layers):
                    params = dataclasses.replace(params, layers=stack_layers(params.layers))
            elif kernels is not None:
                params = dflash.with_bf16_kernel(params, kernels.targets["BF16"])
        return params




class HostProposer:
    """Base for proposers that draft on the host from token ids (n-gram lookup, test oracles): no device state,
    nothing to observe; `host_propose(token_ids, k)` returns up to k draft tokens for the continuation."""

    on_device = False
    tap_indices: tuple[int, ...] = ()

    def init_state(self, num_pages: int, page_size: int, dtype=jnp.float32):
        return None

    def observe(self, params, taps, positions, next_tokens):
        return None

    def pages_in_place(self, kernel, dtype) -> bool:
        return True  # reads no pages

    def host_propose(self, token_ids: list[int], k: int) -> list[int]:
        raise NotImplementedError


@dataclass(frozen=True)
class NgramProposer(HostProposer):
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n from max_n down to min_n)
    in prompt + output and propose the tokens that followed it (a repeat shorter than K continued,
    `spec.lookup.copy_after`).  Pure host work on token ids; the only device sync per step is the one
    verification already needs."""

    max_draft_tokens: int = 4
    min_n: int = 1
    max_n: int = 3
    name: str = "ngram"

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ConfigError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")
        if self.max_draft_tokens < 1:
            raise ConfigError(f"n-gram num_draft_tokens must be >= 1, got {self.max_draft_tokens}")

    def host_propose(self, token_ids, k: int) -> list[int]:
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every earlier n-gram
            hits = np.nonzero((windows == ids[-n:]).all(axis=1))[0]
            if len(hits):
                return copy_after(ids, int(hits[-1]) + n, k)  # the most recent match: what followed it
        return []


@dataclass(frozen=True)
class Eagle3Proposer:
    """EAGLE-3 chain drafting: K sequential single-layer steps feeding the drafter's own hidden state back."""

    cfg: Eagle3Config
    max_draft_tokens: int = 4
    name: str = "eagle3"
    on_device: bool = True
    observes_next_token: bool = True  # its context row at p pairs the target's hidden state at p with token p + 1

    def __post_init__(self):
        if self.max_draft_tokens < 1:
            raise ConfigError(f"eagle3 num_draft_tokens must be >= 1, got {self.max_draft_tokens}")

    @property
    def tap_indices(self) -> tuple[int, ...]:
        return self.cfg.hidden_state_indices

    def init_state(self, num_pages: int, page_size: int, dtype=jnp.float32):
        from specjax.drafter import eagle3

        return eagle3.init_cache(self.cfg, num_pages, page_size, dtype)

    def observe(self, params, taps, positions, next_tokens):
        from specjax.drafter import eagle3

        return eagle3.observe(params.drafter, self.cfg, params.embed, taps, positions, next_tokens)

    def propose(self, params, state, target, bonus, start, page_table, num_draft):
        from specjax.drafter import eagle3

        return eagle3.propose(params.drafter, self.cfg, state, target.embed, bonus, start, page_table, num_draft,
                              target.attention_kernel)

    def pages_in_place(self, kernel, dtype) -> bool:
        return reads_pages_in_place(kernel, 1, dtype, self.cfg.head_dim)  # one query per chain step
