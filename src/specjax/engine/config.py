"""The engine's knobs: `EngineConfig` (KV pool geometry, batching limits, shape buckets, drafting options) and the
KV cache dtypes it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from specjax.model.config import ConfigError

KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs: KV pool geometry, batching limits and the shape buckets compiled for them."""

    page_size: int = 16
    """Tokens per KV page."""
    num_pages: int = 0
    """Pages in the pool, scratch page included; 0 = enough for max_num_seqs full-length sequences (or, with
    kv_cache_memory, as many as fit in it)."""
    kv_cache_memory: int = 0
    """Bytes for the KV pool (target + drafter pages); 0 = size it from num_pages.  Excludes num_pages."""
    max_model_len: int = 2048
    """Longest sequence (prompt + output) the engine accepts; capped by the model's max positions."""
    max_num_seqs: int = 8
    """Most sequences decoded together (largest batch bucket)."""
    prefill_chunk: int = 256
    """Most prompt tokens of one sequence processed in one prefill step."""
    min_prefill_bucket: int = 16
    """Smallest prefill token bucket (buckets double up to prefill_chunk)."""
    num_draft_tokens: int | None = None
    """Drafts verified per step (K); None = the proposer's maximum (block_size - 1 for DFlash; the `LLM` class
    picks a platform default for fixed-K DFlash instead, `llm.default_num_draft`)."""
    adaptive_k: bool = False
    """Choose K per step from k_options with a measured cost model (K = 0 = plain decoding)."""
    k_options: tuple[int, ...] | None = None
    """K values compiled for adaptive speculation; None = (0, K // 4, K // 2, K)."""
    max_prefill_seqs: int = 4
    """Most sequences prefilled (one chunk each) in one step, alongside the decode step of the others."""
    page_bucket_factor: int = 2
    """Growth factor of the KV-page buckets decode steps gather (4 = fewer shapes to compile, more padding)."""
    max_step_programs: int = 0
    """With background compilation (`warmup(..., background=True)`, as `serve` does): most compiled step shapes
    kept, the least recently used beyond it freed (each holds ~35-75 MB of host memory on a 30-layer CPU target);
    0 = keep every one compiled."""
    program_cache: str | None = None
    """Directory of compiled step programs saved by earlier runs and loaded without tracing (engine/program_store.py;
    one device, one process; jax's persistent compilation cache must be off in this process); None = none."""
    lookup_min_match: int | None = None
    """Prompt lookup assists a device drafter (DFlash, EAGLE-3): a step whose context ends in an n-gram of at least
    this many tokens seen before in the prompt or output (the longest match up to spec/lookup.py's LOOKUP_MAX_N,
    most recent first) verifies the K tokens that followed it instead of the drafter's block; 0 = off; None = off,
    except that the `LLM` class picks a platform default for DFlash and EAGLE-3 (`llm.default_lookup_min_match`).
    Lossless either way (any draft is verified); it pays where text repeats, see docs/results/bench.md."""
    context_vocab: int = 32
    """A DFlash drafter with a draft vocabulary also drafts each sequence's last `context_vocab` distinct prompt
    tokens that its vocabulary lacks (names, identifiers the answer copies; drafter/dflash.py `propose_tokens`);
    0 = only its draft vocabulary.  Lossless either way; no effect on drafters of the whole vocabulary."""
    prefix_caching: bool = True
    """Reuse the KV pages (target and drafter rows) of prompt prefixes computed before: full pages are named by a
    hash of their tokens and everything before them, kept after their request ends, and evicted least recently used
    when the pool needs them (kv/allocator.py).  Outputs are unchanged: only the prefill of a hit is skipped."""
    kv_cache_dtype: str = "auto"
    """dtype of the target's KV pools: "float32", "float16", "bfloat16", or "auto" (engine.kv_cache_dtype: float16
    on the integer-activation GGUF kernels, as llama.cpp's default cache, else the activations' dtype).  A 16-bit
    cache holds twice the tokens per byte and is read in half the time; outputs differ from a float32 cache's as
    any rounding does, and speculative decoding stays lossless against plain decoding over the same cache."""

    def __post_init__(self):
        for name in ("page_size", "max_model_len", "max_num_seqs", "prefill_chunk", "min_prefill_bucket"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine {name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages < 0:
            raise ConfigError(f"engine num_pages must be >= 0, got {self.num_pages}")
        if self.kv_cache_memory < 0 or (self.kv_cache_memory and self.num_pages):
            raise ConfigError(f"kv_cache_memory={self.kv_cache_memory} must be >= 0 and cannot be combined with "
                              f"num_pages={self.num_pages}: give the pool in bytes or in pages")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 0:
            raise ConfigError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if self.lookup_min_match is not None and self.lookup_min_match < 0:
            raise ConfigError(f"lookup_min_match must be >= 0 (0 = off), got {self.lookup_min_match}")
        if self.context_vocab < 0:
            raise ConfigError(f"context_vocab must be >= 0 (0 = off), got {self.context_vocab}")
        if self.page_bucket_factor < 2:
            raise ConfigError(f"page_bucket_factor must be >= 2, got {self.page_bucket_factor}")
        if self.max_step_programs < 0:
            raise ConfigError(f"max_step_programs must be >= 0 (0 = no cap), got {self.max_step_programs}")
        if self.max_prefill_seqs < 1:
            raise ConfigError(f"max_prefill_seqs must be >= 1, got {self.max_prefill_seqs}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.k_options is not None and (not self.k_options or min(self.k_options) < 0):
            raise ConfigError(f"k_options must be non-empty and >= 0, got {self.k_options}")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def pool_pages(self) -> int:
        return self.num_pages or self.max_num_seqs * self.max_pages_per_seq + 1
