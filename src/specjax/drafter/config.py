"""A DFlash drafter's configuration (`DrafterConfig`, the z-lab format) and its translation from / to HF
config.json; `default_target_layer_ids`, the target layers it taps by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specjax.model.config import ConfigError, ModelConfig, RopeConfig


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
