"""Every layer's weights in one array per field (a leading layer axis), so that a jitted step takes ~14 arrays
instead of 14 per layer.

A call of a compiled step spends ~1-2 us of the host per argument (JAX's signature and layout checks, PJRT's
usage holds), and on the CPU kernels the host's time is the step's: SmolLM2's 30 layers were 420 of a decode step's
~535 arguments.  `LayerStack` is a pytree whose leaves are the stacked arrays; indexing it gives the layer as the
model code reads it (its QuantMatrix fields point at the stacked blocks with their `layer`, which the kernels read
in place; its small vectors are sliced).  Only integer-kernel matrices are stacked (model/loader.py decides): a float
matrix would be copied out of the stack by every product that reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from specjax.model.quant import QuantMatrix


@jax.tree_util.register_pytree_node_class
class LayerStack(Sequence):
    """A sequence of `num_layers` layers stored as one layer whose leaves carry a leading layer axis."""

    def __init__(self, stacked, num_layers: int):
        self.stacked = stacked
        self.num_layers = num_layers

    def tree_flatten(self):
        return (self.stacked,), self.num_layers

    @classmethod
    def tree_unflatten(cls, num_layers, children):
        return cls(children[0], num_layers)

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(self.num_layers)))
        if not -self.num_layers <= i < self.num_layers:
            raise IndexError(f"layer {i} of {self.num_layers}")
        i %= self.num_layers

        def view(a):
            return dataclasses.replace(a, layer=i) if isinstance(a, QuantMatrix) else a[i]

        return jax.tree.map(view, self.stacked, is_leaf=lambda a: isinstance(a, QuantMatrix))


def first_layer(layers):
    """The first layer's fields for host-side checks of their kinds and flags: a LayerStack's stacked layer as it
    is (slicing its arrays outside a trace dispatches, and first compiles, a program per array: 0.1 s of start-up)."""
    return layers.stacked if isinstance(layers, LayerStack) else layers[0]


def stackable(layers) -> bool:
    """Can `layers` (a tuple of one dataclass type) be a LayerStack?  When all have the same structure and shapes
    and every matrix among their fields is an integer-kernel QuantMatrix (no float copy)."""
    if len(layers) < 2 or isinstance(layers, LayerStack):
        return False
    first = jax.tree.structure(layers[0])
    shapes = [(a.shape, a.dtype) for a in jax.tree.leaves(layers[0])]
    for layer in layers:
        if jax.tree.structure(layer) != first or [(a.shape, a.dtype) for a in jax.tree.leaves(layer)] != shapes:
            return False
        for f in dataclasses.fields(layer):
            w = getattr(layer, f.name)
            if w is None or isinstance(w, QuantMatrix) and w.integer and w.dense is None and w.layer is None:
                continue
            if isinstance(w, QuantMatrix) or getattr(w, "ndim", 0) > 1:
                return False
    return True


def stack_layers(layers) -> LayerStack:
    """Stack `layers` (see `stackable`) through the host (an eager jnp.stack would compile a program per shape);
    the per-layer arrays can be dropped after."""
    leaves = [jax.tree.leaves(layer) for layer in layers]
    stacked = [jax.device_put(np.stack([np.asarray(a) for a in parts]), parts[0].sharding) for parts in zip(*leaves)]
    return LayerStack(jax.tree.unflatten(jax.tree.structure(layers[0]), stacked), len(layers))
