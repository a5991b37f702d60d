"""HF safetensors directories: config.json (+ generation_config.json's stop ids), single-file or sharded
safetensors (bf16 read as float32), tokenizer.json -> LoadedModel.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig, replace
from specjax.model.assemble import assemble_target
from specjax.model.checkpoint import CheckpointError, LoadedModel, read_json
from specjax.model.tokenizer import Tokenizer


def read_safetensors_dir(path: str) -> dict[str, np.ndarray]:
    """All tensors of a single-file or sharded (`model.safetensors.index.json`) safetensors checkpoint."""
    from safetensors import SafetensorError

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted(set(read_json(index, "safetensors index")["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        fpath = os.path.join(path, name)
        if not os.path.isfile(fpath):
            raise CheckpointError(f"safetensors shard listed in the index is missing: {fpath}")
        try:
            tensors.update(load_safetensors_any_dtype(fpath))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read safetensors file {fpath}: {e}") from None
    return tensors


def load_safetensors_any_dtype(path: str) -> dict[str, np.ndarray]:
    """Read a safetensors file as numpy, upcasting bf16 (which numpy lacks) to float32 via ml_dtypes."""
    import ml_dtypes
    from safetensors import safe_open

    out = {}
    with safe_open(path, framework="numpy") as fh:
        for key in fh.keys():
            out[key] = fh.get_tensor(key)
    return {k: (v.astype(np.float32) if v.dtype == ml_dtypes.bfloat16 else v) for k, v in out.items()}


def load_hf_dir(path: str, dtype=jnp.float32, mesh=None) -> LoadedModel:
    cfg = ModelConfig.from_hf(read_json(os.path.join(path, "config.json"), "config.json"))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):  # generation_config often lists extra stop ids (e.g. Llama-3 <|eot_id|>)
        eos = read_json(gen_path, "generation_config.json").get("eos_token_id")
        extra = eos if isinstance(eos, list) else [eos] if eos is not None else []
        cfg = _with_eos(cfg, list(cfg.eos_token_ids) + [int(e) for e in extra])
    cfg, weights = assemble_target(cfg, read_safetensors_dir(path), path, dtype, mesh)
    tokenizer = Tokenizer.from_hf_dir(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
    return LoadedModel(cfg, weights, tokenizer, path, mesh)


def _with_eos(cfg: ModelConfig, eos: list[int]) -> ModelConfig:
    return replace(cfg, eos_token_ids=tuple(dict.fromkeys(eos)))
