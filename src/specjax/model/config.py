"""The target model's configuration: `ModelConfig` (geometry, RoPE as `RopeConfig`, special tokens) and its
translation from / to HF config.json; `ConfigError`, raised by every configuration tree; `replace`.

Plain Python (no JAX device state).  Configs are frozen dataclasses with tuple fields so they can be passed to
`jax.jit` as static arguments.
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


def replace(cfg, **changes):
    """dataclasses.replace, re-running validation."""
    return dataclasses.replace(cfg, **changes)
