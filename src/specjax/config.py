"""Frozen, hashable configuration trees: target model, drafter, engine; HF config.json translation.

Everything here is plain Python (no JAX device state). Configs are frozen dataclasses with tuple fields so
they can be passed to `jax.jit` as static arguments.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")


class ConfigError(ValueError):
    """A model/drafter/engine configuration is invalid or unsupported."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (NeoX / rotate-half layout)."""

    theta: float = 10000.0
    scaling_type: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: tuple[float, ...] | None = None  # GGUF `rope_freqs.weight`: per-frequency divisors

    def __post_init__(self):
        if self.scaling_type not in ("default", "llama3", "linear"):
            raise ConfigError(f"unsupported rope scaling type {self.scaling_type!r} "
                              "(supported: default, llama3, linear)")
        if self.theta <= 0:
            raise ConfigError(f"rope theta must be positive, got {self.theta}")

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [head_dim // 2] in float32, with llama3/linear scaling applied (as HF does)."""
        inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        if self.scaling_type == "linear":
            inv = inv / self.factor
        elif self.scaling_type == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(is_medium, smoothed, scaled)
        if self.freq_factors is not None:
            if len(self.freq_factors) != len(inv):
                raise ConfigError(f"rope_freqs has {len(self.freq_factors)} entries, expected {len(inv)}")
            inv = inv / np.asarray(self.freq_factors, dtype=np.float64)
        return inv.astype(np.float32)

    @staticmethod
    def from_hf(cfg: dict) -> "RopeConfig":
        """Read both the transformers-5 `rope_parameters` dict and the legacy `rope_theta` + `rope_scaling`."""
        params = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", legacy.get("rope_type", legacy.get("type", "default"))))
        merged = {**legacy, **params}
        if kind in (None, "default"):
            return RopeConfig(theta=float(theta))
        if kind == "linear":
            return RopeConfig(theta=float(theta), scaling_type="linear", factor=float(merged["factor"]))
        if kind == "llama3":
            return RopeConfig(
                theta=float(theta),
                scaling_type="llama3",
                factor=float(merged["factor"]),
                low_freq_factor=float(merged["low_freq_factor"]),
                high_freq_factor=float(merged["high_freq_factor"]),
                original_max_position=int(merged["original_max_position_embeddings"]),
            )
        raise ConfigError(f"unsupported rope scaling type {kind!r} (supported: default, llama3, linear)")

    def to_hf(self) -> dict:
        if self.scaling_type == "default":
            return {"rope_type": "default", "rope_theta": self.theta}
        if self.scaling_type == "linear":
            return {"rope_type": "linear", "rope_theta": self.theta, "factor": self.factor}
        return {
            "rope_type": "llama3",
            "rope_theta": self.theta,
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position,
        }


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of a decoder-only target (Llama, Qwen2, Qwen3 families)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3 when attention_bias is set
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Devices the weights are split over (specjax/parallel.py); the fused projections' rows are grouped by it.
    # Not part of the checkpoint: from_hf gives 1, to_hf drops it.
    tensor_parallel: int = 1

    def __post_init__(self):
        if self.family not in SUPPORTED_FAMILIES:
            raise ConfigError(f"unsupported model family {self.family!r} (supported: {', '.join(SUPPORTED_FAMILIES)})")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.tensor_parallel < 1:
            raise ConfigError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        split = {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                 "intermediate_size": self.intermediate_size}
        bad = [f"{k}={v}" for k, v in split.items() if v % self.tensor_parallel]
        if bad:
            raise ConfigError(f"tensor parallel size {self.tensor_parallel} does not divide {', '.join(bad)} of "
                              f"this {self.family} model: choose a size that divides num_kv_heads="
                              f"{self.num_kv_heads}, num_heads and intermediate_size")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @staticmethod
    def from_hf(cfg: dict) -> "ModelConfig":
        """Translate a HF `config.json` dict; unsupported features raise ConfigError naming them."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_FAMILIES:
            raise ConfigError(
                f"config.json model_type={model_type!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r} is not supported (only silu)")
        if cfg.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported")
        if cfg.get("use_sliding_window"):
            raise ConfigError("sliding-window attention (use_sliding_window=true) is not supported")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
            return ModelConfig(
                family=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=RopeConfig.from_hf(cfg),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
                qk_norm=model_type == "qwen3",
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing required field {e.args[0]!r}") from None

    def to_hf(self) -> dict:
        """The HF config.json for this geometry (used by `specjax export` and tests)."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.family]
        out = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": self.rope.to_hf(),
            "rope_theta": self.rope.theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.family != "qwen2":
            out["attention_bias"] = self.qkv_bias
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return out


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """z-lab `build_target_layer_ids`: uniform between the 2nd and the 3rd-to-last layer (round half to even)."""
    if num_taps == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps))


@dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter in the z-lab format (Qwen3 geometry, no embedding/LM head of its own)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    has_mask_embedding: bool = False  # drafter-owned mask embedding (targets without a spare token row)
    has_slot_embedding: bool = False  # specjax extension: learned per-slot input offsets [block_size, H]
    draft_vocab_size: int = 0  # specjax extension: drafts come from this many target ids (0 = the whole vocab)

    def __post_init__(self):
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ConfigError("dflash_config.target_layer_ids is empty")
        if list(self.target_layer_ids) != sorted(self.target_layer_ids):
            raise ConfigError(f"target_layer_ids must be sorted, got {list(self.target_layer_ids)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(f"draft_vocab_size={self.draft_vocab_size} must be in [0, {self.vocab_size}]")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def hidden_state_indices(self) -> tuple[int, ...]:
        """HF `output_hidden_states` indices of the taps: the OUTPUT of layer i is index i + 1."""
        return tuple(i + 1 for i in self.target_layer_ids)

    def check_target(self, target: ModelConfig) -> None:
        """Raise a ConfigError naming the mismatch if this drafter cannot run on `target`."""
        if self.vocab_size != target.vocab_size:
            raise ConfigError(
                f"drafter vocab_size={self.vocab_size} does not match the target's vocab_size={target.vocab_size}"
            )
        if self.target_hidden_size != target.hidden_size:
            raise ConfigError(
                f"drafter expects target hidden_size={self.target_hidden_size} (fc input {self.num_taps}x"
                f"{self.target_hidden_size}) but the target has hidden_size={target.hidden_size}"
            )
        if self.hidden_size != target.hidden_size:
            raise ConfigError(
                f"drafter hidden_size={self.hidden_size} differs from the target's {target.hidden_size}: the "
                "drafter shares the target's embedding and LM head, so they must match"
            )
        if max(self.target_layer_ids) >= target.num_layers:
            raise ConfigError(
                f"drafter taps target layers {list(self.target_layer_ids)} but the target has only "
                f"{target.num_layers} layers"
            )
        if self.num_target_layers != target.num_layers:
            raise ConfigError(
                f"drafter was built for a {self.num_target_layers}-layer target; this target has {target.num_layers}"
            )

    @staticmethod
    def from_hf(cfg: dict) -> "DrafterConfig":
        dcfg = cfg.get("dflash_config") or {}
        if "target_layer_ids" not in dcfg:
            raise ConfigError("drafter config.json has no dflash_config.target_layer_ids (required)")
        if "mask_token_id" not in dcfg:
            raise ConfigError("drafter config.json has no dflash_config.mask_token_id (required)")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            return DrafterConfig(
                hidden_size=hidden,
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                block_size=int(cfg.get("block_size", dcfg.get("block_size", 16))),
                mask_token_id=int(dcfg["mask_token_id"]),
                target_layer_ids=tuple(int(i) for i in dcfg["target_layer_ids"]),
                num_target_layers=int(cfg["num_target_layers"]),
                vocab_size=int(cfg["vocab_size"]),
                target_hidden_size=int(dcfg.get("target_hidden_size", hidden)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=RopeConfig.from_hf(cfg),
                has_mask_embedding=bool(dcfg.get("mask_embedding", False)),
                has_slot_embedding=bool(dcfg.get("slot_embedding", False)),
                draft_vocab_size=int(dcfg.get("draft_vocab_size", 0)),
            )
        except KeyError as e:
            raise ConfigError(f"drafter config.json is missing required field {e.args[0]!r}") from None

    def to_hf(self) -> dict:
        """config.json in the z-lab format, loadable by the reference `dflash` package."""
        dcfg = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.target_hidden_size != self.hidden_size:
            dcfg["target_hidden_size"] = self.target_hidden_size
        if self.has_mask_embedding:
            dcfg["mask_embedding"] = True
        if self.has_slot_embedding:
            dcfg["slot_embedding"] = True
        if self.draft_vocab_size:
            dcfg["draft_vocab_size"] = self.draft_vocab_size
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": dcfg,
            "num_target_layers": self.num_target_layers,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": self.rope.to_hf(),
            "rope_theta": self.rope.theta,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "torch_dtype": "float32",
        }


def replace(cfg, **changes):
    """dataclasses.replace, re-running validation."""
    return dataclasses.replace(cfg, **changes)


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
