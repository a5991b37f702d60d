"""GGUF files -> LoadedModel: the metadata's ModelConfig, GGUF tensor names translated to HF ones (undoing
llama.cpp's Q/K row permutation for llama-architecture files), tensors dequantized lazily, and the block-quantized
matrices kept as blocks for the CPU kernels where they can run.  The file format itself is model/gguf_file.py.
"""

from __future__ import annotations

import logging
import os
import re

import jax.numpy as jnp
import numpy as np

from specjax.config import ConfigError, ModelConfig, RopeConfig
from specjax.kernels import quant_kernels as built_kernels
from specjax.model.assemble import assemble_target
from specjax.model.attention import kernel_fits
from specjax.model.checkpoint import CheckpointError, LoadedModel
from specjax.model.gguf_file import GGUFFile, dequantize, gguf_field
from specjax.model.quant import BLOCK_LAYOUT, HostBlocks
from specjax.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# GGUF -> HF.  `{i}` is the layer index.
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
GGUF_IGNORED = {"rope_freqs.weight"}  # folded into RopeConfig.freq_factors

def gguf_to_hf_name(name: str) -> str:
    m = re.match(r"blk\.(\d+)\.(.+)$", name)
    key = f"blk.{{i}}.{m.group(2)}" if m else name
    if key not in GGUF_TO_HF:
        raise CheckpointError(f"GGUF tensor {name!r} has no mapping (unsupported tensor)")
    return GGUF_TO_HF[key].replace("{i}", m.group(1)) if m else GGUF_TO_HF[key]


def unpermute_llama_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's HF->GGUF Q/K row permutation (interleaved RoPE order -> rotate-half order)."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_llama_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's HF->GGUF permutation (used by tests and `specjax export` to write GGUF files)."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    return w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

def gguf_model_config(reader, source: str) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ConfigError(f"{source}: GGUF architecture {arch!r} is not supported (llama, qwen2, qwen3)")

    def req(key):
        val = gguf_field(reader, f"{arch}.{key}")
        if val is None:
            raise CheckpointError(f"{source}: GGUF metadata {arch}.{key} is missing")
        return val

    hidden, heads = int(req("embedding_length")), int(req("attention.head_count"))
    tokens = gguf_field(reader, "tokenizer.ggml.tokens") or []
    vocab = int(gguf_field(reader, f"{arch}.vocab_size", len(tokens)) or 0)
    tensor_names = {t.name for t in reader.tensors}
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    freq_factors = None
    if "rope_freqs.weight" in tensor_names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        freq_factors = tuple(float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1))
    scaling = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    theta = float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0))
    if scaling == "linear":
        rope = RopeConfig(theta=theta, scaling_type="linear",
                          factor=float(gguf_field(reader, f"{arch}.rope.scaling.factor")), freq_factors=freq_factors)
    elif scaling in ("none", None):
        rope = RopeConfig(theta=theta, freq_factors=freq_factors)
    else:
        raise ConfigError(f"{source}: GGUF rope scaling {scaling!r} is not supported")
    return ModelConfig(
        family=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=int(req("block_count")),
        num_heads=heads,
        num_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(gguf_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        intermediate_size=int(req("feed_forward_length")),
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        max_position_embeddings=int(gguf_field(reader, f"{arch}.context_length", 4096)),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


class LazyDequant:
    """A GGUF tensor dequantized to float32 only when taken, so that loading holds one float32 copy of a tensor at
    a time rather than of the whole model (`heads`: Llama q/k rows to un-permute to HF order)."""

    def __init__(self, tensor, heads: int | None = None):
        self.tensor, self.heads = tensor, heads

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def __array__(self, dtype=None, copy=None):
        arr = dequantize(self.tensor.data, self.tensor.tensor_type)  # a new float32 array, not a view of the file
        if self.heads is not None:
            arr = unpermute_llama_qk(arr, self.heads)
        return arr if dtype is None else arr.astype(dtype, copy=False)


def load_gguf(path: str, dtype=jnp.float32, mesh=None, quant_kernels: bool = False,
              activations: str = "int16") -> LoadedModel:
    """`quant_kernels`: also keep the matrices stored in a kernel's block format (Q4_0, Q4_1, Q8_0) as blocks,
    for the CPU kernels (model/quant.py), when they can run here (one device, float32); `activations`: how those
    kernels take their inputs ("int16" or "int8" integers per block of 32, or "float32"; kernels.ACTIVATIONS)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"GGUF file not found: {path}")
    try:
        reader = GGUFFile(path)
    except (ValueError, OSError, KeyError, IndexError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read GGUF file {path}: {e}") from None
    cfg = gguf_model_config(reader, path)
    kernels = built_kernels() if quant_kernels and mesh is None and dtype == jnp.float32 else None
    if kernels is not None and activations != "float32" and not kernel_fits(cfg.head_dim):
        # integer activations need every row of a step computed on its own (a last-bit difference can move a
        # rounding), and XLA's gathered attention, which such heads would use, does not compute rows that way
        log.warning("head_dim %d does not fit the attention kernel: GGUF block kernels take float32 activations",
                    cfg.head_dim)
        activations = "float32"
    tensors, blocks = {}, {}
    for t in reader.tensors:
        if t.name in GGUF_IGNORED:
            continue
        name = gguf_to_hf_name(t.name)
        heads = None
        if cfg.family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
        tensors[name] = LazyDequant(t, heads)
        if kernels is not None and t.tensor_type.name in BLOCK_LAYOUT and len(t.shape) == 2:
            q = HostBlocks.from_gguf(t.data, t.tensor_type.name)
            if heads is not None:
                q = HostBlocks(q.kind, *(a if a is None else unpermute_llama_qk(a, heads)
                                         for a in (q.codes, q.scales, q.mins)))
            blocks[name] = q
    cfg, weights = assemble_target(cfg, tensors, path, dtype, mesh, blocks,
                                   kernels and kernels.block_targets(activations), activations)
    return LoadedModel(cfg, weights, Tokenizer.from_gguf(reader, path), path, mesh)
