"""The greedy-token kernel (kernels/argmax.cc) against sampling.first_argmax: first maximum per column of a
vocab-major [V, M] matrix, ties, -inf columns, NaN, every stream layout (M = 1 .. 9, 12, 16, 33, 128) and tails."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import EngineConfig
from specjax.drafter.loader import drafter_config_for, init_drafter
from specjax.engine.engine import LLMEngine
from specjax.model.loader import load_model
from specjax.sampling import SamplingParams, first_argmax, vocab_major_argmax
from specjax.spec.proposer import DFlashProposer
from tests.helpers import native_kernels, random_prompt


@pytest.fixture(scope="module")
def kernel():
    return native_kernels().argmax


def cases():
    rng = np.random.default_rng(0)
    for v in (1, 7, 8, 100, 1001, 4099):
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 33, 128):
            x = rng.normal(size=(v, m)).astype(np.float32)
            if v > 10:
                x[rng.integers(0, v, 4), rng.integers(0, m, 4)] = 50.0  # ties: the first row must win
                x[:, m - 1] = -np.inf  # a column of -inf: row 0
                if m > 2:
                    x[v // 2, 1] = x[v - 1, 1] = np.nan  # the first NaN wins over any number
                    x[0, 2], x[v // 3, 2] = 1e30, np.nan
            yield x
    yield np.round(rng.normal(size=(49152, 4)), 1).astype(np.float32)  # SmolLM2's head, many equal values


def test_argmax_kernel_equals_first_argmax(kernel):
    for x in cases():
        got = jax.jit(vocab_major_argmax, static_argnums=1)(jnp.asarray(x), kernel)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(first_argmax(jnp.asarray(x), axis=0)),
                                      err_msg=str(x.shape))
    with pytest.raises(Exception, match="specjax argmax"):  # no rows: a clear error, not a read out of bounds
        jax.ffi.ffi_call(kernel, jax.ShapeDtypeStruct((3,), jnp.int32))(jnp.zeros((0, 3), jnp.float32))


def test_engine_greedy_tokens_and_drafts_on_the_kernel_equal_xla(tiny_dirs, kernel):
    """The engine's greedy path (target verification and the DFlash drafter's drafts) with the kernel and with
    XLA's first_argmax on the same weights: the same tokens and the same drafts, step by step."""
    model = load_model(tiny_dirs["llama"], quant_kernels=True)
    assert model.weights.argmax_kernel == kernel
    dcfg = drafter_config_for(model.config, num_layers=1, block_size=4, target_layer_ids=(0, 2), mask_token_id=299)
    dw = init_drafter(dcfg, jax.random.PRNGKey(1))
    prompts = [random_prompt(np.random.default_rng(i), 6 + 5 * i) for i in range(3)]
    runs = []
    for weights in (model.weights, dataclasses.replace(model.weights, argmax_kernel=None)):
        engine = LLMEngine(model.config, weights, DFlashProposer(dcfg, 4), dw,
                           EngineConfig(max_model_len=64, page_size=8, max_num_seqs=3), record_drafts=True)
        seqs = engine.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
        runs.append([(s.output_ids, s.stats.draft_log) for s in seqs])
    assert runs[0] == runs[1]
