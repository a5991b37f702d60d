"""A plain numpy statement of the integer-activation block products (kernels/quant_matmul.cc's *I8 and *I16
handlers), written from the scheme rather than from the kernel: each token's activations quantized per block of 32
to int8 (scale amax / 127) or to 16-bit integers (scale amax / 32512), integer dot products with the weights' codes,
sums in float64."""

import numpy as np

# the largest integer of each activation type: a block's amax maps to it
LEVELS = {"int8": 127, "int16": 32512}


def quantize_blocks(x: np.ndarray, activations: str = "int8"):
    """x [I, M] float32 -> (q [M, B, 32] int64, dx [M, B] float32): dx = amax / LEVELS, q = rint(x * (1 / dx)) in
    float32, round half to even; an all-zero block has dx 0 and q 0."""
    n, m = x.shape
    xb = x.T.reshape(m, n // 32, 32)
    dx = (np.abs(xb).max(-1) / np.float32(LEVELS[activations])).astype(np.float32)
    inv = np.divide(np.float32(1), dx, out=np.zeros_like(dx), where=dx > 0)
    return np.rint(xb * inv[..., None]).astype(np.int64), dx


def integer_product(kind: str, codes: np.ndarray, scales: np.ndarray, mins, x: np.ndarray,
                    activations: str = "int8") -> np.ndarray:
    """W @ x [O, M] in float64 for the kernel's arrays (model/quant.HostBlocks): codes [O, B, 16] Q4 (low nibbles
    weights 0..15 of a block, high 16..31) or [O, B, 32] int8 (Q8_0), scales / mins [O, B]."""
    q, dx = quantize_blocks(x, activations)
    if kind == "Q8_0":
        w = codes.astype(np.int64)
    else:
        c = codes.astype(np.int64)
        w = np.concatenate([c & 15, c >> 4], axis=-1)
        if kind == "Q4_0":
            w = w - 8
    dots = np.einsum("obi,mbi->omb", w, q).astype(np.float64)
    y = np.einsum("omb,ob,mb->om", dots, scales.astype(np.float64), dx.astype(np.float64))
    if kind == "Q4_1":  # the min term from the exact block sums of x
        xb = x.T.reshape(x.shape[1], -1, 32).astype(np.float64)
        y += np.einsum("ob,mb->om", mins.astype(np.float64), xb.sum(-1))
    return y
