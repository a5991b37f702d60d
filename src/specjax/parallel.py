"""Devices: tensor parallelism on a jax Mesh (how every array of a target, its KV pages and the drafters is laid
out over it, and placing arrays there), data-parallel training batches, and joining a multi-process run.  The
collectives are XLA's (GSPMD), never written by hand.

Megatron layout over the mesh axis "tp": the fused q/k/v and gate/up projections are split by rows (whole heads
and matching gate/up rows per device, see model/target.py `fused_row_order`), w_o and w_down by columns (their
products end in the two all-reduces of a layer), the KV pools by KV head, the vocabulary (embedding and LM
head) by rows when the vocabulary divides, else replicated; norms, the drafter and its state are replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.config import ConfigError, ModelConfig

AXIS = "tp"


def tensor_parallel_mesh(size: int, devices=None) -> Mesh | None:
    """A 1-D mesh of the first `size` devices (of `devices`, default all); None for size 1 without `devices`
    (plain single-device arrays)."""
    if size < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {size}")
    if jax.process_count() > 1 and size != jax.device_count():
        raise ConfigError(f"with {jax.process_count()} processes the target must span every process's devices: "
                          f"--tensor-parallel-size must be {jax.device_count()} (the devices of all processes), "
                          f"got {size}")
    if size == 1 and devices is None:
        return None
    devices = list(jax.devices() if devices is None else devices)
    if size > len(devices):
        hint = (" (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N before the process starts makes N "
                "virtual devices)" if devices[0].platform == "cpu" else "")
        raise ConfigError(f"--tensor-parallel-size {size} needs {size} devices but {len(devices)} "
                          f"{devices[0].platform} device(s) are available{hint}")
    return Mesh(np.array(devices[:size]), (AXIS,))


def initialize_distributed(coordinator_address: str | None, num_processes: int | None,
                           process_id: int | None) -> None:
    """Join a multi-process (multi-host) jax run through `jax.distributed.initialize`, before any device is used;
    CPU collectives go through gloo.  Nothing to do when no coordinator and no process count is given (one
    process, or a TPU slice / SLURM job where jax detects the cluster itself when called with no arguments:
    pass --num-processes there)."""
    if not coordinator_address and not num_processes:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"could not join the multi-process run (coordinator {coordinator_address}, "
                          f"{num_processes} processes, this is process {process_id}): {e}") from None


def to_global(x, sharding):
    """A host array (or a local device array) as a global array of `sharding`: each process supplies the shards
    of its own devices (every process must pass the same value)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def to_host(x) -> np.ndarray:
    """The value of a (possibly multi-process) array on this host."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def data_parallel_mesh(size: int) -> Mesh | None:
    """A 1-D mesh (axis "dp") of the first `size` devices for data-parallel training; None for size 1."""
    if size < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {size}")
    if size > len(jax.devices()):
        raise ConfigError(f"--data-parallel-size {size} needs {size} devices but {len(jax.devices())} are available")
    return None if size == 1 else Mesh(np.array(jax.devices()[:size]), ("dp",))


def shard_batch(tree, mesh: Mesh | None):
    """Every array leaf of `tree` split along its first (batch) axis over the mesh's devices."""
    if mesh is None:
        return tree
    by_row = NamedSharding(mesh, P(mesh.axis_names[0]))
    return jax.tree_util.tree_map(lambda x: to_global(x, by_row), tree)


def mesh_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.size


def target_spec(cfg: ModelConfig, role: str) -> P:
    """PartitionSpec of a target weight by role: "rows" (fused q/k/v, gate/up, their biases), "cols" (w_o,
    w_down), "vocab" (embedding, LM head), "replicated" (norms)."""
    if role == "rows":
        return P(AXIS)
    if role == "cols":
        return P(None, AXIS)
    if role == "vocab":
        return P(AXIS) if cfg.vocab_size % cfg.tensor_parallel == 0 else P()
    if role == "replicated":
        return P()
    raise ValueError(f"unknown weight role {role!r}")


def kv_spec() -> P:
    """KV pools [K, P, Z, H]: split by KV head."""
    return P(AXIS)


def placer(mesh: Mesh | None, cfg: ModelConfig, dtype):
    """-> place(host_array, role): a device array of `dtype` laid out by role; each device receives only its
    shard (nothing is gathered on one device first; with several processes, each places its own devices' shards).
    Without a mesh: the default device."""
    import jax.numpy as jnp

    def place(a, role: str):
        if a is None:
            return None
        if mesh is None:
            return jnp.asarray(a, dtype=dtype)
        return to_global(np.asarray(a).astype(dtype, copy=False), NamedSharding(mesh, target_spec(cfg, role)))

    return place


def replicate(tree, mesh: Mesh | None):
    """Every array leaf of `tree` replicated over `mesh`, except leaves already on it (e.g. the target's
    embedding shared by a drafter keeps its sharding)."""
    if mesh is None or tree is None:
        return tree
    everywhere = NamedSharding(mesh, P())

    def put(x):
        if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh:
            return x
        return to_global(x, everywhere) if isinstance(x, (jax.Array, np.ndarray)) else x

    return jax.tree_util.tree_map(put, tree)


def committed(tree):
    """`tree` with every uncommitted array leaf committed to the device it is on (the same buffer, not a copy).  A
    compiled step's call takes a slower path for each uncommitted argument: a DFlash engine's 42 uncommitted drafter
    weights and pools cost 15-30 us a step on the 2-vCPU CPU host (in-process A/B).  An array that appears twice
    (EAGLE-3's view of the target's embedding) stays one array."""
    done: dict[int, jax.Array] = {}

    def put(x):
        if not isinstance(x, jax.Array) or x.committed:
            return x
        if id(x) not in done:
            done[id(x)] = jax.device_put(x, x.sharding)
        return done[id(x)]

    return jax.tree_util.tree_map(put, tree)


def zeros_like_tree(make, mesh: Mesh | None, spec: P):
    """Run `make()` (a function building a pytree of zeros) with every leaf created directly in `spec` on `mesh`
    (no full copy on one device first).  Without a mesh: make() as is."""
    if mesh is None:
        return make()
    return jax.jit(make, out_shardings=NamedSharding(mesh, spec))()
