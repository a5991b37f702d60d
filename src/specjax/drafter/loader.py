"""DFlash drafter checkpoints in the z-lab format: load, save, random init.

Format: `config.json` (Qwen3 geometry + `block_size`, `dflash_config.{mask_token_id,target_layer_ids}`,
`num_target_layers`) and `model.safetensors` with `fc`, `hidden_norm`, `norm`, `layers.{i}.*` in PyTorch
[out, in] layout.  No embedding or LM head: both are the target's, shared by reference at call time.
Optional specjax tensors, each flagged in `dflash_config` (z-lab checkpoints have none of them):
  `mask_embedding` [H]       (`mask_embedding: true`) replaces the mask row for targets that have no spare
                             token id (SmolLM2 uses all 49,152);
  `slot_embedding` [Q, H]    (`slot_embedding: true`) per-slot offsets added to the block's input rows;
  `draft_token_ids` [V_d]    (`draft_vocab_size: V_d`) int32, sorted: the target ids drafts are chosen from.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import DrafterConfig, ModelConfig, RopeConfig, default_target_layer_ids
from specjax.drafter.dflash import DFlashWeights, DrafterLayer
from specjax.model import hub
from specjax.model.checkpoint import CheckpointError, TensorReader, read_json
from specjax.model.hf_dir import read_safetensors_dir


def drafter_layer_names(i: int) -> dict[str, str]:
    p = f"layers.{i}."
    return {
        "attn_norm": p + "input_layernorm.weight", "mlp_norm": p + "post_attention_layernorm.weight",
        "q": p + "self_attn.q_proj.weight", "k": p + "self_attn.k_proj.weight", "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight", "q_norm": p + "self_attn.q_norm.weight",
        "k_norm": p + "self_attn.k_norm.weight",
        "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight", "down": p + "mlp.down_proj.weight",
    }


GLOBAL_NAMES = {"fc": "fc.weight", "hidden_norm": "hidden_norm.weight", "norm": "norm.weight",
                "mask_embedding": "mask_embedding", "slot_embedding": "slot_embedding",
                "draft_ids": "draft_token_ids"}


def canonical_name(name: str) -> str:
    """Accept both raw z-lab names and `model.`-prefixed ones (the only alias we allow)."""
    return name[len("model."):] if name.startswith("model.") else name


def load_drafter(path: str, target: ModelConfig | None = None, dtype=jnp.float32):
    """Read a z-lab DFlash checkpoint directory (or hub name) -> (DrafterConfig, DFlashWeights).  With `target`,
    check fit."""
    path = hub.resolve(path, "drafter")
    if not os.path.isdir(path):
        raise CheckpointError(f"drafter path is not a directory: {path}")
    cfg = DrafterConfig.from_hf(read_json(os.path.join(path, "config.json"), "drafter config.json"))
    if target is not None:
        cfg.check_target(target)
    tensors = {canonical_name(k): v for k, v in read_safetensors_dir(path).items()}
    return cfg, assemble_drafter(cfg, tensors, path, dtype)


def assemble_drafter(cfg: DrafterConfig, tensors: dict[str, np.ndarray], source: str, dtype=jnp.float32):
    reader = TensorReader(tensors, source, "drafter tensor")
    take = reader.take

    h, dh, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qs, kvs = cfg.num_heads * dh, cfg.num_kv_heads * dh
    dev = lambda a: jnp.asarray(a, dtype=dtype)  # noqa: E731
    layers = []
    for i in range(cfg.num_layers):
        n = drafter_layer_names(i)
        layers.append(DrafterLayer(
            attn_norm=dev(take(n["attn_norm"], (h,))),
            w_q=dev(take(n["q"], (qs, h)).T),
            w_kv=dev(np.concatenate([take(n["k"], (kvs, h)), take(n["v"], (kvs, h))], axis=0).T),
            q_norm=dev(take(n["q_norm"], (dh,))),
            k_norm=dev(take(n["k_norm"], (dh,))),
            w_o=dev(take(n["o"], (h, qs)).T),
            mlp_norm=dev(take(n["mlp_norm"], (h,))),
            w_gate_up=dev(np.concatenate([take(n["gate"], (f, h)), take(n["up"], (f, h))], axis=0).T),
            w_down=dev(take(n["down"], (h, f)).T),
        ))
    mask_embedding = dev(take(GLOBAL_NAMES["mask_embedding"], (h,))) if cfg.has_mask_embedding else None
    slot_embedding = dev(take(GLOBAL_NAMES["slot_embedding"], (cfg.block_size, h))) if cfg.has_slot_embedding \
        else None
    draft_ids = None
    if cfg.draft_vocab_size:
        ids = take(GLOBAL_NAMES["draft_ids"], (cfg.draft_vocab_size,), dtype=np.int64)
        if not (np.all(np.diff(ids) > 0) and ids[0] >= 0 and ids[-1] < cfg.vocab_size):
            raise CheckpointError(f"{source}: draft_token_ids must be sorted, distinct target ids in "
                                  f"[0, {cfg.vocab_size})")
        draft_ids = jnp.asarray(ids, jnp.int32)
    weights = DFlashWeights(
        fc=dev(take(GLOBAL_NAMES["fc"], (h, cfg.num_taps * cfg.target_hidden_size)).T),
        hidden_norm=dev(take(GLOBAL_NAMES["hidden_norm"], (h,))),
        layers=tuple(layers),
        norm=dev(take(GLOBAL_NAMES["norm"], (h,))),
        mask_embedding=mask_embedding,
        slot_embedding=slot_embedding,
        draft_ids=draft_ids,
    )
    unexpected = reader.unexpected()
    if unexpected:
        flags = {"mask_embedding": "mask_embedding: true", "slot_embedding": "slot_embedding: true",
                 "draft_token_ids": "draft_vocab_size: N"}
        named = [flags[u] for u in unexpected if u in flags]
        hint = f" (set dflash_config {', '.join(named)} to use them)" if named else ""
        raise CheckpointError(f"{source}: unexpected drafter tensors {unexpected[:8]}{hint}")
    return weights


def drafter_state_dict(cfg: DrafterConfig, weights: DFlashWeights) -> dict[str, np.ndarray]:
    """Inverse of `assemble_drafter`: z-lab tensor names -> float32 [out, in] numpy arrays."""
    out = {GLOBAL_NAMES["fc"]: np.asarray(weights.fc).T, GLOBAL_NAMES["hidden_norm"]: np.asarray(weights.hidden_norm),
           GLOBAL_NAMES["norm"]: np.asarray(weights.norm)}
    if weights.mask_embedding is not None:
        out[GLOBAL_NAMES["mask_embedding"]] = np.asarray(weights.mask_embedding)
    if weights.slot_embedding is not None:
        out[GLOBAL_NAMES["slot_embedding"]] = np.asarray(weights.slot_embedding)
    kvs = cfg.num_kv_heads * cfg.head_dim
    for i, layer in enumerate(weights.layers):
        n = drafter_layer_names(i)
        w_kv = np.asarray(layer.w_kv).T
        gate, up = np.split(np.asarray(layer.w_gate_up).T, 2, axis=0)
        out.update({
            n["attn_norm"]: np.asarray(layer.attn_norm), n["mlp_norm"]: np.asarray(layer.mlp_norm),
            n["q"]: np.asarray(layer.w_q).T, n["k"]: w_kv[:kvs], n["v"]: w_kv[kvs:], n["o"]: np.asarray(layer.w_o).T,
            n["q_norm"]: np.asarray(layer.q_norm), n["k_norm"]: np.asarray(layer.k_norm),
            n["gate"]: gate, n["up"]: up, n["down"]: np.asarray(layer.w_down).T,
        })
    out = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}
    if weights.draft_ids is not None:
        out[GLOBAL_NAMES["draft_ids"]] = np.ascontiguousarray(weights.draft_ids, dtype=np.int32)
    return out


def cast_for_save(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Float tensors in the checkpoint dtype (float32 or bfloat16); integer tensors (EAGLE-3 d2t) stay exact."""
    import ml_dtypes

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"unsupported drafter dtype {dtype!r} (float32, bfloat16)")
    target = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    return {k: np.ascontiguousarray(v, target) if np.issubdtype(v.dtype, np.floating) else v
            for k, v in tensors.items()}


def save_drafter(path: str, cfg: DrafterConfig, weights: DFlashWeights, dtype: str = "float32") -> None:
    """Write config.json + model.safetensors (float32 or bfloat16) in the z-lab format."""
    from safetensors.numpy import save_file

    tensors = cast_for_save(drafter_state_dict(cfg, weights), dtype)
    os.makedirs(path, exist_ok=True)
    config = cfg.to_hf()
    config["torch_dtype"] = dtype
    tmp = os.path.join(path, "model.safetensors.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)


def drafter_config_for(target: ModelConfig, num_layers: int = 1, block_size: int = 16,
                       target_layer_ids: tuple[int, ...] | None = None, num_taps: int = 5,
                       intermediate_size: int | None = None, mask_token_id: int | None = None,
                       mask_embedding: bool | None = None, slot_embedding: bool = False,
                       draft_vocab_size: int = 0) -> DrafterConfig:
    """A drafter geometry matching `target` (Qwen3-style heads; head_dim and RoPE taken from the target)."""
    ids = target_layer_ids or default_target_layer_ids(target.num_layers, min(num_taps, target.num_layers))
    if mask_embedding is None:
        mask_embedding = mask_token_id is None  # no spare row named: own a learned mask embedding
    return DrafterConfig(
        hidden_size=target.hidden_size, num_layers=num_layers, num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
        intermediate_size=intermediate_size or target.intermediate_size, block_size=block_size,
        mask_token_id=0 if mask_token_id is None else mask_token_id, target_layer_ids=tuple(sorted(set(ids))),
        num_target_layers=target.num_layers, vocab_size=target.vocab_size, target_hidden_size=target.hidden_size,
        rms_norm_eps=target.rms_norm_eps,
        rope=RopeConfig(theta=target.rope.theta, scaling_type=target.rope.scaling_type, factor=target.rope.factor,
                        low_freq_factor=target.rope.low_freq_factor, high_freq_factor=target.rope.high_freq_factor,
                        original_max_position=target.rope.original_max_position),
        has_mask_embedding=mask_embedding, has_slot_embedding=slot_embedding, draft_vocab_size=draft_vocab_size,
    )


def init_drafter(cfg: DrafterConfig, key: jax.Array, std: float = 0.02, dtype=jnp.float32) -> DFlashWeights:
    """Random drafter (normal(0, std) matrices, unit norms): a valid drafter for lossless tests and training."""
    h, dh, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qs, kvs = cfg.num_heads * dh, cfg.num_kv_heads * dh
    keys = iter(jax.random.split(key, 6 * cfg.num_layers + 3))
    normal = lambda shape: (std * jax.random.normal(next(keys), shape)).astype(dtype)  # noqa: E731
    ones = lambda n: jnp.ones((n,), dtype)  # noqa: E731
    layers = tuple(DrafterLayer(
        attn_norm=ones(h), w_q=normal((h, qs)), w_kv=normal((h, 2 * kvs)), q_norm=ones(dh), k_norm=ones(dh),
        w_o=normal((qs, h)), mlp_norm=ones(h), w_gate_up=normal((h, 2 * f)), w_down=normal((f, h)),
    ) for _ in range(cfg.num_layers))
    return DFlashWeights(fc=normal((cfg.num_taps * cfg.target_hidden_size, h)), hidden_norm=ones(h), layers=layers,
                         norm=ones(h), mask_embedding=normal((h,)) if cfg.has_mask_embedding else None,
                         slot_embedding=normal((cfg.block_size, h)) if cfg.has_slot_embedding else None)


def is_drafter_dir(path: str) -> bool:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return False
    with open(cfg_path, encoding="utf-8") as fh:
        return "dflash_config" in json.load(fh)


__all__ = ["load_drafter", "save_drafter", "init_drafter", "drafter_config_for", "is_drafter_dir"]
