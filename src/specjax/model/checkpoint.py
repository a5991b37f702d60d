"""What every checkpoint reader shares: `CheckpointError`, the loaded target (`LoadedModel`), `TensorReader` (named
tensors taken with their shapes checked, leftovers reported) and `read_json`.  Imports nothing from the readers
(model/hf_dir.py, model/gguf_loader.py, model/hub.py, drafter/*loader.py), which all import it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
from jax.sharding import Mesh

from specjax.config import ModelConfig
from specjax.model.quant import QuantMatrix
from specjax.model.stack import first_layer
from specjax.model.target import TargetWeights
from specjax.model.tokenizer import Tokenizer


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

def read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"{what} not found: {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} is not valid JSON: {path} ({e})") from None

