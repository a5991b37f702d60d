"""Block-quantized weight matrices on the device, and `matmul`, the one product every target projection uses.

A `QuantMatrix` keeps a [O, I] weight twice: its GGUF blocks (codes, float16 scales and mins; 0.56-1.06 bytes per
weight), or for a bfloat16 drafter its bfloat16 bits (2 bytes), for the kernels of specjax/kernels/quant_matmul.cc,
and the float32 matrix (the same values, bit for bit) for XLA.  `linear` and `head_product` are the drafters' and
heads' views of the same product.  A product with few tokens (decoding, verification, small batches) reads the
blocks: it is bound by the bytes of weights it streams, ~6x fewer than float32.  With float32 activations, wider
products (prefill, large batches) are compute-bound and XLA's float32 dot is faster there (a static shape test,
`KERNEL_MAX_TOKENS`); the integer-activation kernels (int16, the default, or int8) take every product
(QuantMatrix.integer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

# Widest product (tokens M of W[O, I] @ x[I, M]) that goes to the kernel.  Measured on SmolLM2's 30-layer
# projection chain (2 cores, AVX-512): kernel / XLA float32 = 5.7 / 18.5 ms at M = 1, 14.3 / 26.8 at M = 8,
# 35.0 / 32.6 at M = 16 (docs/results/kflat.md; not re-measured on AVX2).
KERNEL_MAX_TOKENS = 12

# GGUF block formats the kernels read: bytes per block of 32 weights, offset of the codes, whether a min follows d.
BLOCK_LAYOUT = {"Q4_0": (18, 2, False), "Q4_1": (20, 4, True), "Q8_0": (34, 2, False)}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantMatrix:
    codes: jax.Array  # [O, I/32, 16] uint8 (Q4: low nibbles = weights 0..15 of a block), [O, I/32, 32] int8 (Q8_0)
    #                   or [O, I/32, 32] uint16 (bfloat16 bits); integer ones rows interleaved by 8 (`interleave`):
    #                   [ceil(O/8), I/32, 128] (Q4) or [ceil(O/8), I/32, 256] (Q8_0)
    scales: jax.Array | None  # [O, I/32] uint16: the file's float16 bits (integer: [ceil(O/8), I/32, 8]); None: BF16
    mins: jax.Array | None  # [O, I/32] uint16 float16 bits (Q4_1; laid out as scales) or None
    dense: jax.Array | None  # [O, I] float32: the same weights dequantized; None for an integer one (never read)
    target: str = dataclasses.field(metadata=dict(static=True))  # registered FFI target of the kernel
    # how the kernel takes its activations (kernels.ACTIVATIONS): quantized to "int16" or "int8" integers (then
    # every product goes to it, of any width, since XLA's float32 product of the dense copy would be another
    # function of x: a row's result must not depend on how many rows share its step, losslessness; it is as fast
    # as XLA's dot up to 64 tokens), or "float32"
    activations: str = dataclasses.field(default="float32", metadata=dict(static=True))
    rows: int = dataclasses.field(default=0, metadata=dict(static=True))  # O (integer: the codes hold groups of 8)
    # the arrays hold every layer's matrix stacked on a leading axis (model/stack.py) and this one is `layer`
    layer: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def integer(self) -> bool:
        """Does the kernel quantize activations to integers (rows interleaved by 8, no float32 product)?"""
        return self.activations != "float32"

    @property
    def shape(self) -> tuple[int, int]:
        rows = self.rows if self.integer else self.codes.shape[-3]
        return rows, self.codes.shape[-2] * 32  # Q4: 16 bytes of codes hold a block of 32


@dataclass(frozen=True)
class HostBlocks:
    """A quantized [O, I] matrix on the host, split into the kernel's arrays; rows can be selected and stacked
    (fused projections, llama.cpp's Q/K row permutation) before it goes to the device."""

    kind: str
    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None

    @classmethod
    def from_gguf(cls, data: np.ndarray, kind: str) -> HostBlocks:
        """data: a GGUF tensor's bytes [O, I/32 * block bytes]."""
        size, start, has_min = BLOCK_LAYOUT[kind]
        blocks = np.asarray(data).reshape(data.shape[0], -1, size)
        scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.uint16)[..., 0]  # float16 bits, as the file has them
        mins = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)[..., 0] if has_min else None
        codes = np.ascontiguousarray(blocks[..., start:])
        return cls(kind, codes.view(np.int8) if kind == "Q8_0" else codes, scales, mins)

    @classmethod
    def quantize_q8_0(cls, w: np.ndarray) -> HostBlocks:
        """A float [O, I] matrix (I a multiple of 32) quantized as GGUF's Q8_0 (ggml's reference quantizer):
        per block of 32, d = amax / 127 stored as float16, codes round(w / d) (half away from zero)."""
        x = np.asarray(w, np.float32).reshape(w.shape[0], -1, 32)
        d = np.abs(x).max(axis=-1) / 127.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
        y = x * inv[..., None]
        whole = np.trunc(y)
        codes = (whole + np.sign(y) * (np.abs(y - whole) >= 0.5)).astype(np.int8)  # |y| <= 127
        return cls("Q8_0", codes, d.astype(np.float16).view(np.uint16), None)

    def rows(self, index) -> HostBlocks:
        mins = None if self.mins is None else self.mins[index]
        return HostBlocks(self.kind, self.codes[index], self.scales[index], mins)

    @staticmethod
    def stack(parts: list[HostBlocks]) -> HostBlocks:
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse matrices quantized differently: {sorted(kinds)}")
        mins = None if parts[0].mins is None else np.concatenate([p.mins for p in parts], axis=0)
        return HostBlocks(parts[0].kind, np.concatenate([p.codes for p in parts], axis=0),
                          np.concatenate([p.scales for p in parts], axis=0), mins)


def interleave(blocks: HostBlocks) -> HostBlocks:
    """The integer kernels' layout: rows interleaved 8 at a time (zero rows pad the last group).  For row group g and
    block b, 32-byte vector j's 4-byte lane r holds row 8g + r's code bytes 4j .. 4j + 3 (kernels/quant_matmul.cc):
    codes [G, B, 128] (Q4) or [G, B, 256] (Q8_0), scales / mins [G, B, 8]."""
    o, b, n = blocks.codes.shape
    g = -(-o // 8)

    def group(a):  # [O, B, ...] -> [G, 8, B, ...], zero rows appended
        a = np.concatenate([a, np.zeros((g * 8 - o,) + a.shape[1:], a.dtype)]) if g * 8 > o else a
        return a.reshape((g, 8) + a.shape[1:])

    def lanes(a):  # [O, B] -> [G, B, 8]
        return None if a is None else np.ascontiguousarray(group(a).transpose(0, 2, 1))

    words = np.ascontiguousarray(group(blocks.codes)).view(np.uint32)  # [G, 8, B, n / 4]: 4 code bytes a word
    codes = np.ascontiguousarray(words.transpose(0, 2, 3, 1)).view(blocks.codes.dtype).reshape(g, b, 8 * n)
    return HostBlocks(blocks.kind, codes, lanes(blocks.scales), lanes(blocks.mins))


def deinterleave(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, kind: str, rows: int) -> HostBlocks:
    """`interleave` undone: the [O, B, ...] blocks of an integer QuantMatrix's arrays."""
    g, b, n = codes.shape
    words = np.ascontiguousarray(codes).view(np.uint32).reshape(g, b, n // 32, 8)  # [G, B, J, 8 rows]
    plain = words.transpose(0, 3, 1, 2).reshape(g * 8, b, n // 32)[:rows]
    plain = np.ascontiguousarray(plain).view(codes.dtype)  # [O, B, n / 8] bytes

    def rows_of(a):
        return None if a is None else a.transpose(0, 2, 1).reshape(g * 8, b)[:rows]

    return HostBlocks(kind, plain, rows_of(scales), rows_of(mins))


def plain_blocks(w: QuantMatrix, kind: str) -> HostBlocks:
    """A GGUF-format QuantMatrix's blocks on the host, [O, B, ...] whatever the kernel's layout."""
    def host(a):
        return np.asarray(a if w.layer is None else a[w.layer])

    codes, scales = host(w.codes), host(w.scales)
    mins = None if w.mins is None else host(w.mins)
    if w.integer:
        return deinterleave(codes, scales, mins, kind, w.rows)
    return HostBlocks(kind, codes, scales, mins)


def block_kind(w: QuantMatrix) -> str:
    """The GGUF format of a QuantMatrix's blocks (Q4_0, Q4_1, Q8_0) or BF16."""
    if w.scales is None:
        return "BF16"
    return "Q8_0" if w.codes.dtype == jnp.int8 else "Q4_1" if w.mins is not None else "Q4_0"


def to_device(blocks: HostBlocks, dense: jax.Array | None, target: str, activations: str = "float32") -> QuantMatrix:
    """`dense`: the same matrix already on the device (float32; shared, not copied), or None for an integer one
    (every product goes to the kernel); `activations`: those `target` takes (QuantMatrix.activations)."""
    integer = activations != "float32"
    if dense is None and not integer:
        raise ValueError("a float32-activation QuantMatrix needs its dense copy (wide products run on XLA)")
    if dense is not None and (tuple(dense.shape) != (blocks.codes.shape[0], blocks.codes.shape[1] * 32)
                              or dense.dtype != jnp.float32):
        raise ValueError(f"dense {dense.dtype}{tuple(dense.shape)} does not match the blocks {blocks.codes.shape}")
    put = jax.device_put  # a transfer; jnp.asarray of these integer arrays compiles a program per shape
    rows = blocks.codes.shape[0]
    if integer:
        blocks = interleave(blocks)
    mins = None if blocks.mins is None else put(blocks.mins)
    return QuantMatrix(put(blocks.codes), put(blocks.scales), mins, dense, target, activations, rows if integer else 0)


def dense(w) -> jax.Array:
    """The float32 (or loaded dtype) [O, I] matrix of a weight, quantized or not."""
    if not isinstance(w, QuantMatrix):
        return w
    if w.dense is None:
        raise ValueError(f"this {w.shape} integer-kernel matrix keeps no float32 copy: its products take float32 "
                         "activations on the kernel only (load with --kernel-activations float32 for XLA's)")
    return w.dense


def bf16_matrix(w, target: str) -> QuantMatrix | None:
    """A float32 [O, I] matrix (on the device or the host) whose values are all bfloat16 numbers (a bfloat16
    checkpoint loaded as float32) as a QuantMatrix of its bfloat16 bits for the kernel `target` (half the bytes per
    product, the same weights), or None when it is not (its values would round) or its rows are not whole blocks
    of 32."""
    host = np.asarray(w)
    if host.dtype != np.float32 or host.ndim != 2 or host.shape[1] % 32:
        return None
    half = host.astype(jnp.bfloat16)
    if not np.array_equal(half.astype(np.float32), host):
        return None
    codes = half.view(np.uint16).reshape(host.shape[0], host.shape[1] // 32, 32)
    dense = w if isinstance(w, jax.Array) else jax.device_put(np.ascontiguousarray(host))
    return QuantMatrix(jax.device_put(codes), None, None, dense, target)


def q8_0_matrix(w, target: str, activations: str = "int8") -> QuantMatrix | None:
    """A float [O, I] matrix (on the device or the host) quantized as Q8_0 for the integer-activation kernel
    `target` (taking `activations`), or None when its rows are not whole blocks of 32."""
    host = np.asarray(w, np.float32)
    if host.ndim != 2 or host.shape[1] % 32:
        return None
    return to_device(HostBlocks.quantize_q8_0(host), None, target, activations)


def linear(x: jax.Array, w) -> jax.Array:
    """x [..., I] @ W: `w` an [I, O] array (a plain product), or a QuantMatrix [O, I] (`matmul`: its blocks
    through the kernel for up to KERNEL_MAX_TOKENS rows)."""
    if not isinstance(w, QuantMatrix):
        return x @ w
    out = matmul(w, x.reshape(-1, x.shape[-1]).T)
    return out.T.reshape(*x.shape[:-1], out.shape[0])


def take_rows(w, ids: jax.Array):
    """Rows `ids` of a [O, I] weight, quantized (a QuantMatrix of those rows' blocks) or not."""
    if not isinstance(w, QuantMatrix):
        return jnp.take(w, ids, axis=0)

    rows = np.asarray(ids)

    def take(a):  # on the host: a QuantMatrix lives on one CPU device, and an eager take compiles per shape
        return None if a is None else jax.device_put(np.take(np.asarray(a), rows, axis=0))

    if w.integer:  # rows interleaved by 8: cut from the plain blocks, interleaved again
        return to_device(plain_blocks(w, block_kind(w)).rows(rows), take(w.dense), w.target, w.activations)
    return QuantMatrix(take(w.codes), take(w.scales), take(w.mins), take(w.dense), w.target, w.activations)


def head_product(w, rows: jax.Array) -> jax.Array:
    """An output head's vocab-major float32 logits: w [V, D] (array or QuantMatrix), rows [M, D] -> [V, M].
    Vocab-major because that is the fast product on XLA:CPU (model/target.py); few rows of a QuantMatrix stream
    its blocks through the kernel (`matmul`)."""
    if isinstance(w, QuantMatrix):
        return matmul(w, rows.T)
    return jnp.einsum("vd,md->vm", w, rows, preferred_element_type=jnp.float32)


def matmul(w, x: jax.Array) -> jax.Array:
    """W[O, I] @ x[I, M] -> [O, M]: the kernel for a QuantMatrix and M <= KERNEL_MAX_TOKENS (any M for an
    integer one), else XLA."""
    if (not isinstance(w, QuantMatrix) or x.dtype != jnp.float32
            or (x.shape[1] > KERNEL_MAX_TOKENS and not w.integer)):
        return dense(w) @ x
    return kernel_product(w, x)


def kernel_product(w: QuantMatrix, x: jax.Array) -> jax.Array:
    """W[O, I] @ float32 x[I, M] -> [O, M] on the QuantMatrix's kernel, whatever M."""
    args = tuple(a for a in (w.codes, w.scales, w.mins) if a is not None) + (x,)
    out = jax.ShapeDtypeStruct((w.shape[0], x.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(w.target, out)(*args, layer=np.int64(-1 if w.layer is None else w.layer))
