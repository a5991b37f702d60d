"""HF tensor names (the canonical ones: a GGUF file's are translated to them) and `assemble_target`: HF-named
[out, in] arrays -> TargetWeights, checked against the config, placed on the device or split over a mesh, with
GGUF block copies made QuantMatrix where the CPU kernels take them.  Shared by both formats' readers.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig, replace
from specjax.model.checkpoint import CheckpointError, TensorReader
from specjax.model.quant import HostBlocks, QuantMatrix, to_device
from specjax.model.target import TargetLayer, TargetWeights, fused_row_order, gate_up_parts, qkv_parts
from specjax.parallel import mesh_size, placer


def hf_layer_names(i: int) -> dict[str, str]:
    """Role -> HF tensor name for decoder layer i (Llama / Qwen2 / Qwen3 share this layout)."""
    p = f"model.layers.{i}."
    return {
        "attn_norm": p + "input_layernorm.weight",
        "q": p + "self_attn.q_proj.weight", "k": p + "self_attn.k_proj.weight", "v": p + "self_attn.v_proj.weight",
        "q_bias": p + "self_attn.q_proj.bias", "k_bias": p + "self_attn.k_proj.bias",
        "v_bias": p + "self_attn.v_proj.bias",
        "q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight",
        "o": p + "self_attn.o_proj.weight",
        "mlp_norm": p + "post_attention_layernorm.weight",
        "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight", "down": p + "mlp.down_proj.weight",
    }


HF_GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                   "lm_head": "lm_head.weight"}
HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def assemble_target(cfg: ModelConfig, tensors: dict[str, np.ndarray], source: str, dtype=jnp.float32,
                    mesh=None, blocks: dict[str, HostBlocks] | None = None,
                    kernels: dict[str, str] | None = None,
                    activations: str = "float32") -> tuple[ModelConfig, TargetWeights]:
    """Build TargetWeights from HF-named [out, in] arrays, checking names and shapes against `cfg`; with a
    `mesh`, split over it for tensor parallelism (specjax/parallel.py).  `blocks` (GGUF block-quantized copies of
    some matrices, by HF name) and `kernels` (FFI target per block format, specjax/kernels) make those matrices
    QuantMatrix (model/quant.py) when all parts of a projection have them (`activations`: those the targets
    take, kernels.ACTIVATIONS).  -> (cfg with its tensor_parallel set, weights)."""
    cfg = replace(cfg, tensor_parallel=mesh_size(mesh))
    reader = TensorReader(tensors, source)
    take = reader.take
    blocks = blocks or {}  # load_gguf passes blocks only where the kernels can run (one device, float32)
    integer = activations != "float32"

    def quantized(placed, names, rows=None):
        """`placed` (a device array) as a QuantMatrix when every named part has blocks of a kernel's format."""
        parts = [blocks.get(n) for n in names]
        if not parts or any(p is None or p.kind not in kernels for p in parts):
            return placed
        fused = HostBlocks.stack(parts)
        return to_device(fused if rows is None else fused.rows(rows), placed, kernels[fused.kind], activations)

    def projection(parts, placement, rows=None):
        """A projection of the named parts [(name, shape)] stacked by rows (then reordered by `rows`): on the
        integer kernels its blocks alone (every product goes there: no float32 copy to dequantize and hold), else
        the float32 matrix placed on the device (a QuantMatrix sharing it where the kernels take its blocks)."""
        names = [n for n, _ in parts]
        if integer and all(blocks.get(n) is not None and blocks[n].kind in kernels for n in names):
            for name, shape in parts:
                reader.check(name, shape)
            fused = HostBlocks.stack([blocks[n] for n in names])
            return to_device(fused if rows is None else fused.rows(rows), None, kernels[fused.kind], activations)
        whole = np.concatenate([take(n, shape) for n, shape in parts], axis=0)
        return quantized(dev(whole if rows is None else whole[rows], placement), names, rows)

    d, v, h, f = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.intermediate_size
    qs, kvs = cfg.q_size, cfg.kv_size
    dev = placer(mesh, cfg, dtype)
    qkv_rows = fused_row_order(qkv_parts(cfg), cfg.tensor_parallel)
    gate_up_rows = fused_row_order(gate_up_parts(cfg), cfg.tensor_parallel)
    layers = []
    for i in range(cfg.num_layers):
        n = hf_layer_names(i)
        bias = None
        if cfg.qkv_bias:
            bias = np.concatenate([take(n["q_bias"], (qs,)), take(n["k_bias"], (kvs,)),
                                   take(n["v_bias"], (kvs,))])[qkv_rows]
        layers.append(TargetLayer(
            attn_norm=dev(take(n["attn_norm"], (d,)), "replicated"),
            w_qkv=projection([(n["q"], (qs, d)), (n["k"], (kvs, d)), (n["v"], (kvs, d))], "rows", qkv_rows),
            b_qkv=dev(bias, "rows"),
            q_norm=dev(take(n["q_norm"], (h,)), "replicated") if cfg.qk_norm else None,
            k_norm=dev(take(n["k_norm"], (h,)), "replicated") if cfg.qk_norm else None,
            w_o=projection([(n["o"], (d, qs))], "cols"),
            mlp_norm=dev(take(n["mlp_norm"], (d,)), "replicated"),
            w_gate_up=projection([(n["gate"], (f, d)), (n["up"], (f, d))], "rows", gate_up_rows),
            w_down=projection([(n["down"], (d, f))], "cols"),
        ))
    embed = take(HF_GLOBAL_NAMES["embed"], (v, d))
    final_norm = take(HF_GLOBAL_NAMES["final_norm"], (d,))
    if cfg.tie_word_embeddings:
        lm_head = None
        reader.used.add(HF_GLOBAL_NAMES["lm_head"])  # some tied checkpoints still carry a copy; HF ignores it too
    else:
        lm_head = dev(take(HF_GLOBAL_NAMES["lm_head"], (v, d)), "vocab")
    unexpected = [k for k in reader.unexpected() if not HF_IGNORED.match(k)]
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensors for {cfg.family} config: {unexpected[:8]}")
    embed = dev(embed, "vocab")
    head_name = HF_GLOBAL_NAMES["embed" if lm_head is None else "lm_head"]
    head = quantized(embed if lm_head is None else lm_head, [head_name])
    return cfg, TargetWeights(embed=embed, layers=tuple(layers), final_norm=dev(final_norm, "replicated"),
                              lm_head=lm_head, head_blocks=head if isinstance(head, QuantMatrix) else None)
