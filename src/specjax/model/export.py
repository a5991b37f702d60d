"""`specjax export`: write a loaded target as a HF transformers directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with the chat template), e.g. to run the reference PyTorch `dflash`
package on exactly the weights specjax uses (a GGUF target is exported dequantised, in float32)."""

from __future__ import annotations

import json
import os

import numpy as np

from specjax.model.assemble import HF_GLOBAL_NAMES, hf_layer_names
from specjax.model.checkpoint import LoadedModel
from specjax.model.target import fused_row_order, gate_up_parts, qkv_parts


def target_state_dict(model: LoadedModel) -> dict[str, np.ndarray]:
    cfg, w = model.config, model.weights
    qs, kvs = cfg.q_size, cfg.kv_size
    qkv_hf = np.argsort(fused_row_order(qkv_parts(cfg), cfg.tensor_parallel))  # back to HF row order
    gate_up_hf = np.argsort(fused_row_order(gate_up_parts(cfg), cfg.tensor_parallel))
    out = {HF_GLOBAL_NAMES["embed"]: np.asarray(w.embed), HF_GLOBAL_NAMES["final_norm"]: np.asarray(w.final_norm)}
    if w.lm_head is not None:
        out[HF_GLOBAL_NAMES["lm_head"]] = np.asarray(w.lm_head)
    for i, layer in enumerate(w.layers):
        n = hf_layer_names(i)
        qkv = np.asarray(layer.w_qkv)[qkv_hf]
        gate, up = np.split(np.asarray(layer.w_gate_up)[gate_up_hf], 2, axis=0)
        out.update({n["attn_norm"]: np.asarray(layer.attn_norm), n["q"]: qkv[:qs], n["k"]: qkv[qs:qs + kvs],
                    n["v"]: qkv[qs + kvs:], n["o"]: np.asarray(layer.w_o), n["mlp_norm"]: np.asarray(layer.mlp_norm),
                    n["gate"]: gate, n["up"]: up, n["down"]: np.asarray(layer.w_down)})
        if layer.b_qkv is not None:
            b = np.asarray(layer.b_qkv)[qkv_hf]
            out.update({n["q_bias"]: b[:qs], n["k_bias"]: b[qs:qs + kvs], n["v_bias"]: b[qs + kvs:]})
        if layer.q_norm is not None:
            out.update({n["q_norm"]: np.asarray(layer.q_norm), n["k_norm"]: np.asarray(layer.k_norm)})
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def export_hf(model: LoadedModel, path: str) -> str:
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    save_file(target_state_dict(model), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(model.config.to_hf(), fh, indent=2)
    tok = model.tokenizer
    if tok is not None:
        tok.tk.save(os.path.join(path, "tokenizer.json"))
        with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
            json.dump({"bos_token": tok.bos_token, "eos_token": tok.eos_token, "add_bos_token": tok.add_bos,
                       "chat_template": tok.chat_template, "tokenizer_class": "PreTrainedTokenizerFast"}, fh,
                      indent=2)
    return path
