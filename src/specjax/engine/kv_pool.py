"""KV pool sizing: the dtype of the target's KV pages, the bytes one page costs (target rows plus the proposer's
paged state), and the page count a memory budget buys.  Pure host arithmetic on shapes; nothing is allocated here
(LLMEngine allocates the pools).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import ConfigError, EngineConfig, ModelConfig
from specjax.model.target import TargetWeights, init_kv_pages


def kv_cache_dtype(choice: str, tweights: TargetWeights) -> jnp.dtype:
    """The target KV pools' dtype for EngineConfig.kv_cache_dtype `choice`.  "auto": float16 where the target runs
    as llama.cpp does by default (GGUF blocks on the integer-activation CPU kernels, every attention on the kernel,
    which reads float16 rows as cheaply as float32 ones: half the bytes, 1.03-1.07x a step), else the activations'
    dtype."""
    if choice != "auto":
        return jnp.dtype(choice)
    return jnp.dtype(jnp.float16 if tweights.attention_any_queries else tweights.embed.dtype)


def page_bytes(tcfg: ModelConfig, proposer, page_size: int, dtype, kv_dtype=None) -> int:
    """Device bytes one KV page costs: the target's K and V rows (of `kv_dtype`, default `dtype`) plus the
    proposer's paged state (of `dtype`), if any (shapes of the very pools the engine allocates, never allocated
    here)."""
    def pool_bytes(pages: int) -> int:
        shapes = jax.eval_shape(lambda: (
            init_kv_pages(tcfg.num_layers, pages, page_size, tcfg.num_kv_heads, tcfg.head_dim, kv_dtype or dtype),
            proposer.init_state(pages, page_size, dtype)))
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))

    return pool_bytes(2) - pool_bytes(1)


def one_sequence_bytes(config: EngineConfig, tcfg: ModelConfig, proposer, tweights: TargetWeights) -> int:
    """The smallest KV pool that serves `config`: one max_model_len sequence plus the scratch page."""
    return (config.max_pages_per_seq + 1) * page_bytes(tcfg, proposer, config.page_size, tweights.embed.dtype,
                                                       kv_cache_dtype(config.kv_cache_dtype, tweights))


def pool_from_budget(config: EngineConfig, tcfg: ModelConfig, proposer, tweights: TargetWeights) -> EngineConfig:
    """`config` with num_pages = the pages that fit in kv_cache_memory (scratch page included), at most what
    max_num_seqs full-length sequences can use."""
    per_page = page_bytes(tcfg, proposer, config.page_size, tweights.embed.dtype,
                          kv_cache_dtype(config.kv_cache_dtype, tweights))
    pages = min(config.kv_cache_memory // per_page, config.pool_pages)
    if pages < config.max_pages_per_seq + 1:
        need = one_sequence_bytes(config, tcfg, proposer, tweights)
        raise ConfigError(f"kv_cache_memory={config.kv_cache_memory} bytes holds {pages} KV pages of {per_page} bytes; "
                          f"one {config.max_model_len}-token sequence needs {config.max_pages_per_seq + 1} "
                          f"({need / 2 ** 20:.1f} MiB): raise the budget or lower max_model_len")
    return dataclasses.replace(config, num_pages=int(pages), kv_cache_memory=0)
