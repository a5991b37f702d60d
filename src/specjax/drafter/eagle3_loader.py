"""EAGLE-3 checkpoints: the public SafeAILab layout (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: `midlayer.*`,
`fc`, `norm`, `lm_head`, `d2t`, `t2d`) and the speculators layout (`layers.0.*`), one explicit name map; save and
random init.  The target's embedding is shared (an `embed_tokens.weight` copy in the checkpoint is ignored)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ConfigError, ModelConfig
from specjax.drafter.eagle3 import Eagle3Config, Eagle3Weights
from specjax.model import hub
from specjax.model.checkpoint import CheckpointError, TensorReader, read_json
from specjax.model.hf_dir import read_safetensors_dir

NAMES = {
    "fc": "fc.weight", "hidden_norm": "midlayer.hidden_norm.weight", "input_norm": "midlayer.input_layernorm.weight",
    "post_norm": "midlayer.post_attention_layernorm.weight", "q": "midlayer.self_attn.q_proj.weight",
    "k": "midlayer.self_attn.k_proj.weight", "v": "midlayer.self_attn.v_proj.weight",
    "o": "midlayer.self_attn.o_proj.weight", "gate": "midlayer.mlp.gate_proj.weight",
    "up": "midlayer.mlp.up_proj.weight", "down": "midlayer.mlp.down_proj.weight", "norm": "norm.weight",
    "lm_head": "lm_head.weight", "d2t": "d2t", "t2d": "t2d",
}
IGNORED = {"embed_tokens.weight"}


def canonical(name: str) -> str:
    """speculators names its single layer `layers.0.`; SafeAILab calls it `midlayer.`."""
    name = name.removeprefix("model.")
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def default_aux_ids(num_target_layers: int) -> tuple[int, ...]:
    """Hidden states entering layers 2, N // 2 and N - 3 (HF output_hidden_states indices)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def config_from_hf(cfg: dict, target: ModelConfig) -> Eagle3Config:
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        rope = cfg.get("rope_parameters") or {}
        return Eagle3Config(
            hidden_size=hidden, num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg.get("vocab_size", target.vocab_size)),
            draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg.get("vocab_size", target.vocab_size)),
            aux_hidden_state_ids=tuple(int(i) for i in aux) if aux else default_aux_ids(target.num_layers),
            target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            norm_before_residual=bool(cfg.get("norm_before_residual", False)))
    except KeyError as e:
        raise ConfigError(f"EAGLE-3 config.json is missing required field {e.args[0]!r}") from None


def check_target(cfg: Eagle3Config, target: ModelConfig) -> None:
    if cfg.vocab_size != target.vocab_size:
        raise ConfigError(f"EAGLE-3 vocab_size={cfg.vocab_size} does not match the target's {target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size or cfg.hidden_size != target.hidden_size:
        raise ConfigError(f"EAGLE-3 drafter hidden_size={cfg.hidden_size} (target features {cfg.target_hidden_size})"
                          f" does not match the target's hidden_size={target.hidden_size}")
    if max(cfg.aux_hidden_state_ids) > target.num_layers:
        raise ConfigError(f"EAGLE-3 taps hidden states {list(cfg.aux_hidden_state_ids)} but the target has only "
                          f"{target.num_layers} layers")


def load_eagle3(path: str, target: ModelConfig, dtype=jnp.float32):
    path = hub.resolve(path, "EAGLE-3 drafter")
    if not os.path.isdir(path):
        raise CheckpointError(f"EAGLE-3 drafter path is not a directory: {path}")
    cfg = config_from_hf(read_json(os.path.join(path, "config.json"), "EAGLE-3 config.json"), target)
    check_target(cfg, target)
    tensors = {canonical(k): v for k, v in read_safetensors_dir(path).items()}
    reader = TensorReader(tensors, path, "EAGLE-3 tensor")

    def take(role, shape, dtype_=np.float32):
        return reader.take(NAMES[role], shape, dtype_)

    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qs, kvs = cfg.num_heads * d, cfg.num_kv_heads * d
    dev = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    d2t = None
    if cfg.draft_vocab_size != cfg.vocab_size:
        d2t = jnp.asarray(take("d2t", (cfg.draft_vocab_size,), np.int64), jnp.int32)
        if NAMES["t2d"] in tensors:
            take("t2d", (cfg.vocab_size,), bool)
    weights = Eagle3Weights(
        fc=dev(take("fc", (h, len(cfg.aux_hidden_state_ids) * cfg.target_hidden_size)).T),
        hidden_norm=dev(take("hidden_norm", (h,))), input_norm=dev(take("input_norm", (h,))),
        w_q=dev(take("q", (qs, 2 * h)).T),
        w_kv=dev(np.concatenate([take("k", (kvs, 2 * h)), take("v", (kvs, 2 * h))], axis=0).T),
        w_o=dev(take("o", (h, qs)).T), post_norm=dev(take("post_norm", (h,))),
        w_gate_up=dev(np.concatenate([take("gate", (f, h)), take("up", (f, h))], axis=0).T),
        w_down=dev(take("down", (h, f)).T), norm=dev(take("norm", (h,))),
        lm_head=dev(take("lm_head", (cfg.draft_vocab_size, h)).T), d2t=d2t)
    unexpected = reader.unexpected(IGNORED)
    if unexpected:
        raise CheckpointError(f"{path}: unexpected EAGLE-3 tensors {unexpected[:8]}")
    return cfg, weights


def save_eagle3(path: str, cfg: Eagle3Config, w: Eagle3Weights, num_target_layers: int,
                dtype: str = "float32") -> None:
    """SafeAILab layout (`midlayer.*`, d2t, t2d) + a Llama-style config.json; float tensors in `dtype`."""
    from safetensors.numpy import save_file

    from specjax.drafter.loader import cast_for_save

    kvs = cfg.num_kv_heads * cfg.head_dim
    w_kv = np.asarray(w.w_kv).T
    gate, up = np.split(np.asarray(w.w_gate_up).T, 2, axis=0)
    t = {NAMES["fc"]: np.asarray(w.fc).T, NAMES["hidden_norm"]: np.asarray(w.hidden_norm),
         NAMES["input_norm"]: np.asarray(w.input_norm), NAMES["post_norm"]: np.asarray(w.post_norm),
         NAMES["q"]: np.asarray(w.w_q).T, NAMES["k"]: w_kv[:kvs], NAMES["v"]: w_kv[kvs:],
         NAMES["o"]: np.asarray(w.w_o).T, NAMES["gate"]: gate, NAMES["up"]: up, NAMES["down"]: np.asarray(w.w_down).T,
         NAMES["norm"]: np.asarray(w.norm), NAMES["lm_head"]: np.asarray(w.lm_head).T}
    t = cast_for_save(t, dtype)  # validates dtype before anything is written
    os.makedirs(path, exist_ok=True)
    if w.d2t is not None:
        d2t = np.asarray(w.d2t, np.int64)
        t[NAMES["d2t"]] = d2t
        t2d = np.zeros(cfg.vocab_size, bool)
        t2d[np.arange(len(d2t)) + d2t] = True
        t[NAMES["t2d"]] = t2d
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": cfg.hidden_size,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
              "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
              "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
              "rope_theta": cfg.rope_theta, "target_hidden_size": cfg.target_hidden_size,
              "eagle_aux_hidden_state_layer_ids": list(cfg.aux_hidden_state_ids), "hidden_act": "silu",
              "norm_before_residual": cfg.norm_before_residual, "num_target_layers": num_target_layers,
              "tie_word_embeddings": False, "torch_dtype": dtype}
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)


def eagle3_config_for(target: ModelConfig, draft_vocab_size: int | None = None,
                      aux_ids: tuple[int, ...] | None = None, intermediate_size: int | None = None) -> Eagle3Config:
    return Eagle3Config(hidden_size=target.hidden_size, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
                        head_dim=target.head_dim, intermediate_size=intermediate_size or target.intermediate_size,
                        vocab_size=target.vocab_size, draft_vocab_size=draft_vocab_size or target.vocab_size,
                        aux_hidden_state_ids=aux_ids or default_aux_ids(target.num_layers),
                        target_hidden_size=target.hidden_size, rms_norm_eps=target.rms_norm_eps,
                        rope_theta=target.rope.theta)


def init_eagle3(cfg: Eagle3Config, key, draft_token_ids=None, std: float = 0.02, dtype=jnp.float32) -> Eagle3Weights:
    """Random EAGLE-3 drafter.  `draft_token_ids` (sorted target ids, length draft_vocab_size) defines d2t."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    keys = iter(jax.random.split(key, 8))
    normal = lambda shape: (std * jax.random.normal(next(keys), shape)).astype(dtype)  # noqa: E731
    ones = lambda n: jnp.ones((n,), dtype)  # noqa: E731
    d2t = None
    if cfg.draft_vocab_size != cfg.vocab_size:
        ids = np.asarray(draft_token_ids if draft_token_ids is not None else np.arange(cfg.draft_vocab_size))
        if len(ids) != cfg.draft_vocab_size:
            raise ConfigError(f"draft_token_ids has {len(ids)} ids, expected {cfg.draft_vocab_size}")
        d2t = jnp.asarray(np.sort(ids) - np.arange(len(ids)), jnp.int32)
    return Eagle3Weights(
        fc=normal((len(cfg.aux_hidden_state_ids) * cfg.target_hidden_size, h)), hidden_norm=ones(h),
        input_norm=ones(h), w_q=normal((2 * h, cfg.num_heads * d)), w_kv=normal((2 * h, 2 * cfg.num_kv_heads * d)),
        w_o=normal((cfg.num_heads * d, h)), post_norm=ones(h), w_gate_up=normal((h, 2 * f)), w_down=normal((f, h)),
        norm=ones(h), lm_head=normal((h, cfg.draft_vocab_size)), d2t=d2t)


def is_eagle3_dir(path: str) -> bool:
    p = os.path.join(path, "config.json")
    if not os.path.isfile(p):
        return False
    with open(p) as fh:
        cfg = json.load(fh)
    return any("Eagle3" in a or "eagle3" in a.lower() for a in cfg.get("architectures") or []) or \
        "draft_vocab_size" in cfg
