"""GGUF block kernels (specjax/kernels, model/quant.py): against float64 products of the dequantized weights (float32
activations) or a numpy statement of the integer schemes (int16 and int8 activations), on every build this CPU runs
(native, and AVX2 beside AVX-512).  Whole models on the kernels: tests/model/test_quant_models.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import ConfigError
from specjax.kernels import KernelUnavailable, build
from specjax.model.gguf_file import dequantize
from specjax.model.loader import load_model
from specjax.model.quant import KERNEL_MAX_TOKENS, HostBlocks, QuantMatrix, matmul, plain_blocks, to_device
from tests.helpers import kernel_builds, native_kernels
from tests.reference.integer_blocks import integer_product

KINDS = ("Q4_0", "Q4_1", "Q8_0")


@pytest.fixture(scope="module")
def kernels():
    return native_kernels("native")


@pytest.fixture(scope="module", params=kernel_builds())
def each_build(request):
    """The kernels of every build this CPU runs (kernel_builds): the products' oracle tests run on each."""
    return native_kernels(request.param)


def quantized_matrix(kind: str, rows: int, cols: int, kernels, seed=0, activations="float32"):
    import gguf

    rng = np.random.default_rng(seed)
    data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), gguf.GGMLQuantizationType[kind])
    dense = dequantize(data, gguf.GGMLQuantizationType[kind])
    target = kernels.block_targets(activations)[kind]
    return to_device(HostBlocks.from_gguf(data, kind), jnp.asarray(dense), target, activations), dense


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_matches_the_dequantized_product(each_build, kind):
    """Odd row counts (the tails of the row tiles and of the thread split), 1..KERNEL_MAX_TOKENS tokens (every
    token-tile width); each token's column is bit-identical whatever the number of tokens sharing the call."""
    for rows, cols in [(37, 64), (200, 96), (130, 32)]:
        w, dense = quantized_matrix(kind, rows, cols, each_build)
        x = np.random.default_rng(1).standard_normal((cols, KERNEL_MAX_TOKENS)).astype(np.float32)
        ref = dense.astype(np.float64) @ x.astype(np.float64)
        bound = np.abs(dense).astype(np.float64) @ np.abs(x).astype(np.float64)
        alone = [np.asarray(jax.jit(matmul)(w, jnp.asarray(x[:, j:j + 1]))) for j in range(x.shape[1])]
        for m in (1, 2, 3, 4, 5, 7, KERNEL_MAX_TOKENS):
            y = np.asarray(jax.jit(matmul)(w, jnp.asarray(x[:, :m])))
            assert y.shape == (rows, m) and y.dtype == np.float32
            assert np.all(np.abs(y - ref[:, :m]) <= 1e-5 * bound[:, :m] + 1e-6), (rows, m)
            for j in range(m):
                np.testing.assert_array_equal(y[:, j], alone[j][:, 0])


# How far an integer scheme's product may be from the float32 one, relative to sum |w x| (typical columns): measured
# <= 0.023 for int8 (one block of 32 the worst) and <= 5.4e-5 for int16
SCHEME_ERROR = {"int8": 0.05, "int16": 2e-4}


@pytest.mark.parametrize("activations", ["int16", "int8"])
@pytest.mark.parametrize("kind", KINDS)
def test_integer_kernel_matches_its_scheme(each_build, kind, activations):
    """The integer-activation handlers against tests/reference/integer_blocks.py (the same integer products,
    float64 sums), odd and even block counts (a last block without a pair), every token-tile width (1-8, then
    tiles of 8 and a rest), and products wider than KERNEL_MAX_TOKENS (integer matrices take every product: none
    goes to XLA's float32 dot); each token's column is bit-identical whatever the number of tokens sharing the call,
    and the product stays within SCHEME_ERROR of sum |w x| of the float32 one.  Column 5 is zero (dx = 0), column 6
    has one huge value (int8: its block's other values quantize to 0: far from the float32 product, which is the
    scheme's, not the kernel's, error), column 7 values near the int16 split's limits (each block's amax and values
    255 / 2 quantization steps from it)."""
    for rows, cols in [(37, 64), (200, 96), (130, 32), (48, 576)]:
        w, dense = quantized_matrix(kind, rows, cols, each_build, activations=activations)
        x = np.random.default_rng(1).standard_normal((cols, 3 * KERNEL_MAX_TOKENS + 1)).astype(np.float32)
        x[:, 5] = 0
        x[3, 6] = 1e4
        x[:, 7] = np.tile(np.float32([1.0, -1.0, 127.5 / 32512, -127.5 / 32512, 32384.5 / 32512, 0.5]), cols)[:cols]
        blocks = plain_blocks(w, kind)  # the kernel's rows are interleaved by 8 (37, 130: a partial last group)
        mins = None if blocks.mins is None else blocks.mins.view(np.float16).astype(np.float32)
        want = integer_product(kind, blocks.codes, blocks.scales.view(np.float16).astype(np.float32), mins, x,
                               activations)
        bound = np.abs(dense).astype(np.float64) @ np.abs(x).astype(np.float64)
        terms = bound if mins is None else bound + 2 * np.repeat(np.abs(mins), 32, axis=1) @ np.abs(x)  # q d and m
        alone = [np.asarray(jax.jit(matmul)(w, jnp.asarray(x[:, j:j + 1]))) for j in range(x.shape[1])]
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, KERNEL_MAX_TOKENS, 16, x.shape[1]):  # wider than float32 kernels' too
            y = np.asarray(jax.jit(matmul)(w, jnp.asarray(x[:, :m])))
            assert y.shape == (rows, m) and y.dtype == np.float32
            assert np.all(np.abs(y - want[:, :m]) <= 1e-6 * terms[:, :m] + 1e-6), (rows, m)
            for j in range(m):
                np.testing.assert_array_equal(y[:, j], alone[j][:, 0])
        exact = dense.astype(np.float64) @ x.astype(np.float64)
        typical = [j for j in range(x.shape[1]) if j not in (5, 6, 7)]
        assert np.max(np.abs(want - exact)[:, typical] / bound[:, typical]) <= SCHEME_ERROR[activations]


def test_interleaved_rows_round_trip_and_select(kernels):
    """The integer kernels' rows interleaved by 8 (a partial last group padded) hold the blocks the float32 kernels
    read, and a row selection (a draft vocabulary's head rows) computes each row as the whole matrix does."""
    from specjax.model.quant import take_rows

    x = jnp.asarray(np.random.default_rng(2).standard_normal((96, 3)).astype(np.float32))
    for kind in ("Q4_0", "Q4_1", "Q8_0"):
        w8, _ = quantized_matrix(kind, 13, 96, kernels, seed=4, activations="int16")
        w32, _ = quantized_matrix(kind, 13, 96, kernels, seed=4)
        assert w8.shape == w32.shape == (13, 96) and w8.codes.shape[0] == 2
        a, b = plain_blocks(w8, kind), plain_blocks(w32, kind)
        for name in ("codes", "scales", "mins"):
            assert (getattr(a, name) is None) == (getattr(b, name) is None)
            if getattr(a, name) is not None:
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        ids = jnp.asarray([12, 0, 5, 9, 8], jnp.int32)
        part = take_rows(w8, ids)
        assert part.integer and part.activations == "int16" and part.shape == (5, 96)
        np.testing.assert_array_equal(np.asarray(matmul(part, x)), np.asarray(matmul(w8, x))[np.asarray(ids)])


def test_activation_modes_choose_the_handlers(kernels):
    int16, int8, f32 = (kernels.block_targets(a) for a in ("int16", "int8", "float32"))
    assert set(int16) == set(int8) == set(f32) == {"Q4_0", "Q4_1", "Q8_0", "BF16"}
    assert all(len({int16[k], int8[k], f32[k]}) == 3 for k in KINDS) and int16["BF16"] == int8["BF16"] == f32["BF16"]
    with pytest.raises(ValueError, match="activations must be one of int16, int8, float32"):
        kernels.block_targets("fp8")
    with pytest.raises(ConfigError, match="unknown kernel activations 'fp8'"):
        load_model("default", quant_kernels=True, activations="fp8")


def test_wide_products_use_the_dense_matrix(kernels):
    w, dense = quantized_matrix("Q4_1", 64, 64, kernels)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((64, KERNEL_MAX_TOKENS + 1)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(jax.jit(matmul)(w, x)), np.asarray(jax.jit(jnp.matmul)(dense, x)))


def test_fused_rows_keep_their_blocks(kernels):
    """Stacking and row selection (fused q/k/v, llama.cpp's Q/K permutation) move whole rows of every array."""
    import gguf

    rng = np.random.default_rng(3)
    parts = [gguf.quants.quantize(rng.standard_normal((r, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
             for r in (8, 4)]
    order = rng.permutation(12)
    fused = HostBlocks.stack([HostBlocks.from_gguf(p, "Q4_1") for p in parts]).rows(order)
    dense = np.concatenate([dequantize(p, gguf.GGMLQuantizationType.Q4_1) for p in parts])[order]
    w = to_device(fused, jnp.asarray(dense), kernels.targets["Q4_1"])
    x = np.eye(64, 4, dtype=np.float32)
    np.testing.assert_allclose(np.asarray(matmul(w, jnp.asarray(x))), dense @ x, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="quantized differently"):
        HostBlocks.stack([HostBlocks.from_gguf(parts[0], "Q4_1"), HostBlocks.from_gguf(parts[0][:, :34], "Q8_0")])


def test_build_failure_names_the_compiler_error(tmp_path):
    src = tmp_path / "broken.cc"
    src.write_text("this is not C++\n")
    with pytest.raises(KernelUnavailable, match="broken.cc"):
        build(str(src), str(tmp_path), str(tmp_path / "out"), "g++")


def test_kernel_builds_this_cpu_can_run():
    """`isa_flags`: the native build adds nothing, the AVX2 build turns AVX-512 off where the CPU has AVX2 + FMA, and a
    build this CPU cannot run is refused, naming the choices."""
    from specjax.kernels import isa_flags

    avx512, avx2 = "f16c fma avx2 avx512f avx512bw", "f16c fma avx2"
    assert isa_flags(None, avx512) == isa_flags("native", avx2) == isa_flags("AVX2", avx2) == ()
    assert isa_flags("AVX2", avx512) == isa_flags("avx2", avx512) == ("-mno-avx512f",)
    with pytest.raises(KernelUnavailable, match=r"'AVX-512F' cannot run here \(choose from native, AVX2; this CPU"):
        isa_flags("AVX-512F", avx2)
    with pytest.raises(KernelUnavailable, match="neither AVX-512F nor AVX2"):
        isa_flags("AVX2", "f16c sse4_2")


def test_disabled_by_environment(monkeypatch):
    from specjax.kernels import _load_quant_kernels

    monkeypatch.setenv("SPECJAX_KERNELS", "0")
    with pytest.raises(KernelUnavailable, match="SPECJAX_KERNELS=0"):
        _load_quant_kernels()


def test_bf16_kernel_streams_exact_bfloat16_matrices(kernels):
    """A float32 matrix of bfloat16 values goes to the BF16 kernel with the same weights (its dense copy is the
    matrix itself); one that would round stays dense.  Products match float64 and do not depend on how many
    tokens share the call."""
    from specjax.model.quant import bf16_matrix, linear

    rng = np.random.default_rng(11)
    w = jnp.asarray(rng.standard_normal((96, 64)).astype(jnp.bfloat16).astype(np.float32))  # [O, I]
    assert bf16_matrix(w + 1e-4, kernels.targets["BF16"]) is None
    assert bf16_matrix(w[:, :48], kernels.targets["BF16"]) is None  # rows not whole blocks of 32
    q = bf16_matrix(w, kernels.targets["BF16"])
    assert isinstance(q, QuantMatrix) and q.codes.dtype == jnp.uint16 and q.scales is None and q.dense is w
    x = rng.standard_normal((64, 7)).astype(np.float32)
    want = np.asarray(w, np.float64) @ x.astype(np.float64)
    got = np.asarray(matmul(q, jnp.asarray(x)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for m in (1, 3):  # a token's result is the same alone or in a wider call
        np.testing.assert_array_equal(np.asarray(matmul(q, jnp.asarray(x[:, :m]))), got[:, :m])
    rows = jnp.asarray(x.T[:5])  # linear: x [..., I] @ W^T through the kernel, as x @ w.T does densely
    np.testing.assert_allclose(np.asarray(linear(rows, q)), np.asarray(rows @ w.T), rtol=1e-5, atol=1e-5)


def test_q8_0_quantizer_matches_gguf_py(kernels):
    """HostBlocks.quantize_q8_0 gives gguf-py's Q8_0 bytes (ggml's reference quantizer), zero blocks and ties
    included, and its integer QuantMatrix multiplies like the int8 scheme over its dequantized blocks."""
    from gguf import GGMLQuantizationType, quants

    from specjax.model.quant import q8_0_matrix

    rng = np.random.default_rng(21)
    w = rng.standard_normal((37, 96)).astype(np.float32)
    w[3, :32] = 0.0
    w[5, :32] = np.arange(32) - 15.5  # amax 16.5: halves of d land on ties
    mine = HostBlocks.quantize_q8_0(w)
    ref = HostBlocks.from_gguf(quants.quantize(w, GGMLQuantizationType.Q8_0), "Q8_0")
    assert np.array_equal(mine.codes, ref.codes) and np.array_equal(mine.scales, ref.scales)
    assert q8_0_matrix(w[:, :48], kernels.targets["Q8_0_I8"]) is None  # rows not whole blocks of 32
    q = q8_0_matrix(w, kernels.targets["Q8_0_I8"])
    assert q.activations == "int8" and q.dense is None and plain_blocks(q, "Q8_0").codes.tolist() == ref.codes.tolist()
    x = rng.standard_normal((96, 5)).astype(np.float32)
    want = integer_product("Q8_0", ref.codes, ref.scales.view(np.float16).astype(np.float32), None, x)
    bound = np.abs(w).astype(np.float64) @ np.abs(x).astype(np.float64)
    assert np.all(np.abs(np.asarray(matmul(q, jnp.asarray(x))) - want) <= 1e-6 * bound + 1e-6)
