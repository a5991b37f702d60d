"""Sampling parameters (host, validated) and the on-device sampler (temperature, top-k, top-p, explicit keys).

Randomness is a pure function of (request seed, absolute position of the sampled token): the key for the token
at position p is fold_in(PRNGKey(seed), p).  No key is carried as hidden state, outputs do not depend on how
requests are batched, and a seeded request samples the same token at the same position whichever method
(plain decoding or any speculative method) produced the prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

# Static sampler variants: chosen per step on the host so greedy batches never pay for sorting the vocabulary.
GREEDY, SAMPLE, SAMPLE_FILTERED = "greedy", "sample", "sample_filtered"
# A variant's name + LOGPROBS: the step also returns log-probabilities (`token_logprobs`) of the tokens it samples;
# + PROMPT_LOGPROBS (prefill): of every prompt token too.  Only steps serving a request that asked for them pay for a
# log-softmax and a top-k over the vocabulary (over every row of a prompt chunk only for prompt logprobs).
LOGPROBS, PROMPT_LOGPROBS = "+logprobs", "+prompt_logprobs"
MAX_LOGPROBS = 20  # most alternatives a request may ask for (OpenAI's top_logprobs limit); every step returns these


def first_argmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """`jnp.argmax(x, axis)` as int32 (the first maximum; the first NaN if there is one) in two plain reductions.

    XLA:CPU runs argmax as a variadic (value, index) reduce that it does not vectorise: ~0.9 ms for 4 rows of
    SmolLM2's 49,152 logits on one Zen 4 core, against ~0.17 ms for a max and then the smallest index holding it.
    """
    n = x.shape[axis]
    shape = [1] * x.ndim
    shape[axis] = n
    idx = jnp.arange(n, dtype=jnp.int32).reshape(shape)
    first_max = jnp.min(jnp.where(x == jnp.max(x, axis=axis, keepdims=True), idx, n), axis=axis)
    first_nan = jnp.min(jnp.where(jnp.isnan(x), idx, n), axis=axis)  # (XLA's fused max may skip NaNs)
    return jnp.where(first_nan < n, first_nan, first_max)


def vocab_major_argmax(x: jax.Array, kernel: str | None = None) -> jax.Array:
    """`first_argmax(x, axis=0)` of a head's vocab-major logits x [V, M] -> int32 [M], on `kernel` (the registered
    target of kernels/argmax.cc, TargetWeights.argmax_kernel) where one is given and x is float32: one vectorised
    pass instead of XLA:CPU's three (39-73 us a call against 258-825 us for 1-8 rows of SmolLM2's 49,152)."""
    if kernel is not None and x.dtype == jnp.float32:
        return jax.ffi.ffi_call(kernel, jax.ShapeDtypeStruct(x.shape[1:], jnp.int32))(x)
    return first_argmax(x, axis=0)


class SamplingError(ValueError):
    """Invalid sampling parameters."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    max_new_tokens: int = 256
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # the emitted tokens' log-probabilities and this many top alternatives (None: off)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (from its second on; None: off)

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise SamplingError(f"seed must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                raise SamplingError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {v!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_filter(self) -> bool:
        return (self.top_k > 1) or self.top_p < 1


def sampler_mode(params: list[SamplingParams], prompt: bool = False) -> str:
    """The cheapest static sampler variant that serves every request of a batch, + LOGPROBS if one asks for its
    tokens' log-probabilities, or (a prefill step, `prompt`) + PROMPT_LOGPROBS if one asks for its prompt's."""
    if prompt and any(p.prompt_logprobs is not None for p in params):
        lp = PROMPT_LOGPROBS
    else:
        lp = LOGPROBS if any(p.logprobs is not None for p in params) else ""
    if all(p.is_greedy for p in params):
        return GREEDY + lp
    return (SAMPLE_FILTERED if any(p.needs_filter and not p.is_greedy for p in params) else SAMPLE) + lp


def split_mode(mode: str) -> tuple[str, bool, bool]:
    """A sampler mode -> (its variant: GREEDY / SAMPLE / SAMPLE_FILTERED, whether it returns log-probabilities of
    the sampled tokens, whether of the prompt's too)."""
    if mode.endswith(PROMPT_LOGPROBS):
        return mode.removesuffix(PROMPT_LOGPROBS), True, True
    return mode.removesuffix(LOGPROBS), mode.endswith(LOGPROBS), False


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Temperature-scaled logits with tokens outside top-k / the top-p nucleus set to -inf.

    logits [..., V]; temperature, top_k, top_p broadcast against logits[..., 0].  The nucleus keeps the smallest
    set of highest-probability tokens whose mass reaches top_p (a token is kept if the mass strictly above it is
    < top_p), the convention of HF and the reference `dflash` package.
    """
    x = logits / jnp.where(temperature > 0, temperature, 1.0)[..., None]
    sorted_desc = -jnp.sort(-x, axis=-1)  # [..., V]
    vocab = x.shape[-1]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[..., None], axis=-1)  # [..., 1]
    sorted_desc = jnp.where(sorted_desc >= kth, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_above < top_p[..., None]
    cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x >= jnp.maximum(cutoff, kth), x, -jnp.inf)


def position_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """PRNG keys for sampling the token at `positions` [B, T] of requests with `seeds` [B]."""
    base = jax.vmap(jax.random.PRNGKey)(seeds)  # [B, 2]
    return jax.vmap(lambda k, ps: jax.vmap(lambda p: jax.random.fold_in(k, p))(ps))(base, positions)


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  seeds: jax.Array, positions: jax.Array, mode: str, greedy: jax.Array | None = None) -> jax.Array:
    """One token per row: logits [B, T, V] for tokens at `positions` [B, T] -> int32 [B, T].

    Rows with temperature 0 (or top_k 1) take the argmax (`greedy` [B, T] if given: `first_argmax(logits)`
    computed from another layout of the same logits; a GREEDY program then never reads `logits`); others draw
    from the filtered softmax.
    """
    if greedy is None:
        greedy = first_argmax(logits)
    mode = split_mode(mode)[0]
    if mode == GREEDY:
        return greedy
    t, k, p = (a[:, None] for a in (temperature, top_k, top_p))
    if mode == SAMPLE_FILTERED:
        scaled = filtered_logits(logits, t, k, p)
    else:
        scaled = logits / jnp.where(t > 0, t, 1.0)[..., None]
    keys = position_keys(seeds, positions)  # [B, T, 2]
    drawn = jax.vmap(jax.vmap(jax.random.categorical))(keys, scaled).astype(jnp.int32)
    return jnp.where((t > 0) & (k != 1), drawn, greedy)


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: jax.Array | None = None,
                   top_k: jax.Array | None = None, top_p: jax.Array | None = None, mode: str = GREEDY):
    """Log-probabilities of `tokens` [B, T] under logits [B, T, V] and the MAX_LOGPROBS most likely tokens ->
    (logprobs [B, T] float32, top_ids [B, T, MAX_LOGPROBS] int32, top_logprobs [B, T, MAX_LOGPROBS] float32, the
    most likely first).

    The distribution is the one the sampler draws from: rows at temperature > 0 are scaled by it and, in a
    SAMPLE_FILTERED step, cut to top-k / top-p (tokens outside have -inf); greedy rows (and a GREEDY step, or no
    sampling arrays given) use the raw logits.  A token of -1 (padding) gets logprob 0."""
    x = logits.astype(jnp.float32)
    variant = split_mode(mode)[0]
    if variant != GREEDY and temperature is not None:
        t, k, p = (a[:, None] for a in (temperature, top_k, top_p))
        sampled = ((t > 0) & (k != 1))[..., None]
        scaled = filtered_logits(x, t, k, p) if variant == SAMPLE_FILTERED else x / jnp.where(t > 0, t, 1.0)[..., None]
        x = jnp.where(sampled, scaled, x)
    logp = jax.nn.log_softmax(x, axis=-1)
    chosen = jnp.take_along_axis(logp, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(logp, MAX_LOGPROBS)
    return jnp.where(tokens >= 0, chosen, 0.0), top_ids.astype(jnp.int32), top_lp
