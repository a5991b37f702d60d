"""A quantized GGUF target on the CPU block kernels (specjax/kernels, model/quant.py) against the same file run on XLA,
speculative decoding on them (lossless at every activation width), and the drafters' products on the kernels: the
model-level side of tests/model/test_quant.py's kernel oracles."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import EngineConfig
from specjax.engine.engine import LLMEngine
from specjax.model import target as tgt
from specjax.model.loader import load_model
from specjax.model.quant import QuantMatrix, dense, matmul, plain_blocks
from specjax.sampling import SamplingParams
from tests.helpers import FAMILIES, native_kernels, plain_and_random_dflash, random_prompt, write_gguf_from_hf

# integer activations on the tiny random targets (2-4 blocks of 32 per row, 9 tokens): largest logit error relative
# to the largest logit (measured int8 0.025-0.089, int16 1.0e-4-3.3e-4 over the checkpoints below: int8's error would
# fail int16's bound) and correlation with the float32 logits (int8: measured 0.9970-0.9998)
INT8_LOGIT_ERROR, INT8_LOGIT_CORRELATION = 0.2, 0.99
INT16_LOGIT_ERROR = 2e-3


@pytest.fixture(scope="module")
def kernels():
    return native_kernels("native")


def short_forward(model, ids):
    """Logits of `ids` as ONE forward of len(ids) <= KERNEL_MAX_TOKENS tokens (the kernels' side of `matmul`)."""
    cfg, n = model.config, len(ids)
    kv = tgt.init_kv_pages(cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    batch = tgt.ForwardBatch(jnp.asarray([ids], jnp.int32), jnp.arange(n)[None], 16 + jnp.arange(n)[None],
                             jnp.asarray([[1]]))
    hidden, _, _ = tgt.forward(model.weights, kv, batch, cfg)
    return np.asarray(tgt.logits(model.weights, hidden)[0])


@pytest.mark.parametrize("family,kind", [(f, k) for f in FAMILIES for k in ("Q4_1", "Q8_0")] + [("llama", "Q4_0")])
def test_quantized_gguf_on_kernels_matches_xla(tiny_dirs, tmp_path, kernels, family, kind):
    """float32 activations: the same logits to rounding and the same greedy output as XLA's float32 products; int16
    activations (the default) and int8 ones: logits within each type's quantization error of those (the kernels' own
    oracle is test_integer_kernel_matches_its_scheme), or float32 ones where the attention kernel cannot take the
    heads (qwen3's head_dim 24: XLA's attention does not compute each row on its own, tests/spec/test_lossless.py)."""
    path = str(tmp_path / f"{family}-{kind}.gguf")
    write_gguf_from_hf(tiny_dirs[family], path, kind)
    plain, fast = load_model(path), load_model(path, quant_kernels=True, activations="float32")
    int16, int8 = load_model(path, quant_kernels=True), load_model(path, quant_kernels=True, activations="int8")
    assert not plain.quantized_kernels and fast.quantized_kernels and int16.quantized_kernels
    fits = plain.config.head_dim % 16 == 0
    assert (plain.kernel_activations, fast.kernel_activations) == (None, "float32")
    assert (int16.kernel_activations, int8.kernel_activations) == (("int16", "int8") if fits else ("float32",) * 2)
    assert int16.weights.attention_any_queries == fits
    assert all(isinstance(getattr(layer, name), QuantMatrix) for layer in fast.weights.layers
               for name in ("w_qkv", "w_o", "w_gate_up", "w_down"))
    assert isinstance(fast.weights.head_blocks, QuantMatrix)
    # integer layers keep only their blocks: every product goes to the kernel, a float32 copy would never be read
    layer = int16.weights.layers[0]
    names = ("w_qkv", "w_o", "w_gate_up", "w_down")
    assert all((getattr(layer, n).dense is None) == fits for n in names)
    assert all(getattr(layer, n).shape == getattr(fast.weights.layers[0], n).shape for n in names)
    if fits:
        with pytest.raises(ValueError, match="keeps no float32 copy"):
            dense(layer.w_qkv)
    ids = random_prompt(np.random.default_rng(0), 9)
    want = short_forward(plain, ids)
    np.testing.assert_allclose(short_forward(fast, ids), want, atol=2e-5, rtol=1e-5)
    for model, bound in ((int16, INT16_LOGIT_ERROR), (int8, INT8_LOGIT_ERROR)):
        got = short_forward(model, ids)
        err = np.abs(got - want).max() / np.abs(want).max()
        if fits:
            assert 0 < err < bound and np.corrcoef(got.ravel(), want.ravel())[0, 1] > INT8_LOGIT_CORRELATION
        else:
            np.testing.assert_array_equal(got, short_forward(fast, ids))
    config = EngineConfig(max_model_len=128, max_num_seqs=1, page_size=8)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    [a] = LLMEngine(plain.config, plain.weights, config=config).generate([ids], params)
    [b] = LLMEngine(fast.config, fast.weights, config=config).generate([ids], params)
    assert a.output_ids == b.output_ids


@pytest.mark.parametrize("activations", ["int16", "int8", "float32"])
def test_speculative_decoding_on_kernels_is_lossless(tiny_dirs, tmp_path, kernels, activations):
    """Verification (blocks of 8 on the kernels) against plain decoding (1 token), both on the kernels (integer
    activations: each token is quantized on its own, so a verified row is computed as plain decoding computes it)."""
    path = str(tmp_path / "llama-Q4_1.gguf")
    write_gguf_from_hf(tiny_dirs["llama"], path, "Q4_1")
    model = load_model(path, quant_kernels=True, activations=activations)
    assert model.kernel_activations == activations
    ar, spec = plain_and_random_dflash(model.config, model.weights, random_prompt(np.random.default_rng(4), 11), 32,
                                       128)
    assert spec == ar


def test_drafters_on_the_attention_kernel_match_xla_and_stay_lossless(tiny_dirs, tmp_path, kernels):
    """DFlash and EAGLE-3 drafters read their paged context through the in-place attention kernel when the target
    has it: every draft equals the gathered-XLA path's, and the output equals plain decoding.  (A float32-activation
    target: beside an integer one the kernel path also quantizes the DFlash drafter's matrices, and this compares the
    attention alone.)"""
    import dataclasses

    from specjax.drafter.eagle3 import Eagle3Params
    from specjax.drafter.eagle3_loader import eagle3_config_for, init_eagle3
    from specjax.drafter.loader import drafter_config_for, init_drafter
    from specjax.spec.proposer import DFlashProposer, Eagle3Proposer

    path = str(tmp_path / "llama-Q8_0.gguf")
    write_gguf_from_hf(tiny_dirs["llama"], path, "Q8_0")
    model = load_model(path, quant_kernels=True, activations="float32")
    assert model.weights.attention_kernel == kernels.attention and model.config.head_dim % 16 == 0
    xla = dataclasses.replace(model.weights, attention_kernel=None)
    ecfg = eagle3_config_for(model.config, aux_ids=(1, 2, 3))
    dcfg = drafter_config_for(model.config, num_layers=2, block_size=8, target_layer_ids=(0, 2), mask_token_id=299)
    drafters = {"eagle3": (Eagle3Proposer(ecfg, 3), lambda w: Eagle3Params(init_eagle3(
                    ecfg, jax.random.PRNGKey(4), std=0.15), w.embed)),
                "dflash": (DFlashProposer(dcfg, 8), lambda w: init_drafter(dcfg, jax.random.PRNGKey(5), std=0.15))}
    prompt = random_prompt(np.random.default_rng(6), 13)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    config = EngineConfig(max_model_len=128, max_num_seqs=1, page_size=8)
    [plain] = LLMEngine(model.config, model.weights, config=config).generate([prompt], params)
    # attention calls per decode step: one per target layer, plus the drafter's (a layer each for DFlash; EAGLE-3's
    # single layer once per chained draft)
    drafter_calls = {"eagle3": 3, "dflash": dcfg.num_layers}
    for name, (proposer, make) in drafters.items():
        engines = [LLMEngine(model.config, w, proposer, make(w), config, record_drafts=True)
                   for w in (model.weights, xla)]
        runs = [e.generate([prompt], params)[0] for e in engines]
        assert runs[0].stats.draft_log == runs[1].stats.draft_log, name
        assert runs[0].output_ids == plain.output_ids, name
        for engine, want in zip(engines, (model.config.num_layers + drafter_calls[name], 0)):
            steps = [p[0] for shape, p in engine.programs.ready.items() if shape.kind == "decode"]
            assert steps and all(s.as_text().count(f'custom_call_target="{kernels.attention}"') == want
                                 for s in steps), name


def test_dflash_draft_head_streams_the_target_head_blocks(tiny_dirs, tmp_path, kernels):
    """A draft vocabulary's head rows are cut from the target head's GGUF blocks when the target runs on the
    kernels: the same weights as the dense rows, the same scores to rounding, one kernel call per decode step
    (beside the target head's), and the output still equals plain decoding."""
    import dataclasses

    from specjax.drafter.dflash import with_draft_head
    from specjax.drafter.loader import drafter_config_for, init_drafter
    from specjax.model.quant import head_product
    from specjax.spec.proposer import DFlashProposer

    path = str(tmp_path / "llama-Q8_0.gguf")
    write_gguf_from_hf(tiny_dirs["llama"], path, "Q8_0")
    model = load_model(path, quant_kernels=True, activations="float32")
    rng = np.random.default_rng(7)
    dcfg = drafter_config_for(model.config, num_layers=1, block_size=4, target_layer_ids=(0, 2), mask_token_id=299)
    ids = jnp.asarray(np.sort(rng.choice(model.config.vocab_size, 96, replace=False)), jnp.int32)
    drafter = dataclasses.replace(init_drafter(dcfg, jax.random.PRNGKey(3), std=0.15), draft_ids=ids)
    fast = with_draft_head(drafter, model.weights.head_matrix).draft_head
    slow = with_draft_head(drafter, model.weights.vocab_rows).draft_head
    assert isinstance(fast, QuantMatrix) and fast.shape == (96, model.config.hidden_size)
    np.testing.assert_array_equal(np.asarray(fast.dense), np.asarray(slow))
    rows = jnp.asarray(rng.standard_normal((3, model.config.hidden_size)), jnp.float32)
    np.testing.assert_allclose(np.asarray(head_product(fast, rows)), np.asarray(head_product(slow, rows)),
                               rtol=1e-5, atol=1e-5)

    prompt = random_prompt(np.random.default_rng(8), 12)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    config = EngineConfig(max_model_len=128, max_num_seqs=1, page_size=8)
    [plain] = LLMEngine(model.config, model.weights, config=config).generate([prompt], params)
    dense_head = dataclasses.replace(model.weights, head_blocks=None)
    calls = []
    for w in (model.weights, dense_head):
        engine = LLMEngine(model.config, w, DFlashProposer(dcfg, 4), drafter, config)
        assert engine.generate([prompt], params)[0].output_ids == plain.output_ids
        steps = [p[0] for shape, p in engine.programs.ready.items() if shape.kind == "decode"]
        calls.append({s.as_text().count(f'custom_call_target="{model.weights.head_blocks.target}"') for s in steps})
    assert len(calls[0]) == 1 and {c - 2 for c in calls[0]} == calls[1]  # the target head and the draft head


def lossless_dflash_decode_steps(model, proposer, drafter) -> list:
    """Greedy DFlash generation with `drafter` beside `model` equals plain decoding; -> its decode steps' programs."""
    prompt = random_prompt(np.random.default_rng(13), 12)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    config = EngineConfig(max_model_len=128, max_num_seqs=1, page_size=8)
    [plain] = LLMEngine(model.config, model.weights, config=config).generate([prompt], params)
    engine = LLMEngine(model.config, model.weights, proposer, drafter, config)
    assert engine.generate([prompt], params)[0].output_ids == plain.output_ids
    return [p[0] for shape, p in engine.programs.ready.items() if shape.kind == "decode"]


def test_dflash_drafter_beside_an_integer_target_runs_on_q8_0_blocks(tiny_dirs, tmp_path, kernels):
    """Beside a target on the integer-activation kernels, every drafter matrix (fc and each layer's five), float32
    or bfloat16, is quantized as Q8_0 for the int8 kernel (drafts only: verification decides): its context K/V rows
    stay close to the XLA drafter's, the output equals plain decoding, and every decode step calls that kernel for
    each of those matrices."""
    from specjax.drafter import dflash
    from specjax.drafter.loader import drafter_config_for, init_drafter
    from specjax.model.stack import LayerStack
    from specjax.spec.proposer import DFlashProposer

    path = str(tmp_path / "llama-Q4_1.gguf")
    write_gguf_from_hf(tiny_dirs["llama"], path, "Q4_1")
    model = load_model(path, quant_kernels=True)
    assert model.weights.integer_products
    dcfg = drafter_config_for(model.config, num_layers=2, block_size=4, target_layer_ids=(0, 2), mask_token_id=299)
    fp32 = init_drafter(dcfg, jax.random.PRNGKey(9), std=0.15)
    proposer = DFlashProposer(dcfg, 4)
    fast = proposer.prepare(fp32, model.weights)
    names = ("w_q", "w_kv", "w_o", "w_gate_up", "w_down")
    matrices = [fast.fc] + [getattr(layer, n) for layer in fast.layers for n in names]
    target = kernels.targets["Q8_0_I8"]
    assert all(isinstance(m, QuantMatrix) and m.activations == "int8" and m.target == target for m in matrices)

    taps = jnp.asarray(np.random.default_rng(12).standard_normal((1, 5, fast.fc.shape[1])), jnp.float32)
    rows = [np.asarray(dflash.observe(w, dcfg, taps, jnp.arange(5)[None]).k[1]) for w in (fast, fp32)]
    np.testing.assert_allclose(rows[0], rows[1], rtol=0.05, atol=0.05 * np.abs(rows[1]).max())
    # its layers are stacked like the target's (one array per field), and read exactly as a layer of its own
    assert isinstance(fast.layers, LayerStack) and fast.layers.stacked.w_q.codes.shape[0] == dcfg.num_layers
    apart = dflash.with_q8_0_kernel(dflash.with_draft_head(fp32, model.weights.head_matrix), target)
    assert isinstance(apart.layers, tuple)
    for a, b in zip(dflash.observe(fast, dcfg, taps, jnp.arange(5)[None]).v,
                    dflash.observe(apart, dcfg, taps, jnp.arange(5)[None]).v, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    steps = lossless_dflash_decode_steps(model, proposer, fp32)
    head = model.weights.head_blocks is not None and model.weights.head_blocks.target == target  # a Q8_0 head
    drafter_calls = 1 + dcfg.num_layers + 5 * dcfg.num_layers  # observe (fc, each layer's context K/V), propose
    assert steps and all(s.as_text().count(f'custom_call_target="{target}"') - head * 2 == drafter_calls
                         for s in steps)


def test_bfloat16_dflash_drafter_runs_on_the_bf16_kernel(tiny_dirs, tmp_path, kernels):
    """Beside a target on the float32-activation kernels, a drafter with bfloat16 values streams every matrix (fc
    and each layer's five) through the BF16 kernel; a float32 drafter stays on XLA.  Drafts are the XLA drafter's
    to rounding and the output equals plain decoding."""
    import dataclasses

    from specjax.drafter import dflash
    from specjax.drafter.loader import drafter_config_for, init_drafter
    from specjax.spec.proposer import DFlashProposer

    path = str(tmp_path / "llama-Q4_1.gguf")
    write_gguf_from_hf(tiny_dirs["llama"], path, "Q4_1")
    model = load_model(path, quant_kernels=True, activations="float32")
    assert not model.weights.integer_products
    dcfg = drafter_config_for(model.config, num_layers=2, block_size=4, target_layer_ids=(0, 2), mask_token_id=299)
    fp32 = init_drafter(dcfg, jax.random.PRNGKey(9), std=0.15)
    bf16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16).astype(a.dtype), fp32)
    proposer = DFlashProposer(dcfg, 4)
    fast = proposer.prepare(bf16, model.weights)
    assert all(isinstance(m, QuantMatrix) for m in [fast.fc] + [getattr(layer, n) for layer in fast.layers
                                                                for n in ("w_q", "w_kv", "w_o", "w_gate_up", "w_down")])
    assert not isinstance(proposer.prepare(fp32, model.weights).fc, QuantMatrix)
    xla = dataclasses.replace(model.weights, attention_kernel=None)
    assert not isinstance(proposer.prepare(bf16, xla).fc, QuantMatrix)

    rng = np.random.default_rng(12)
    taps = jnp.asarray(rng.standard_normal((1, 5, fast.fc.shape[1])), jnp.float32)
    rows = [np.asarray(dflash.observe(w, dcfg, taps, jnp.arange(5)[None]).k[1]) for w in (fast, bf16)]
    np.testing.assert_allclose(rows[0], rows[1], rtol=1e-4, atol=1e-4)

    steps = lossless_dflash_decode_steps(model, proposer, bf16)
    # per decode step: observe (fc, then each layer's context K/V) and propose (each layer's five products)
    bf16_calls = 1 + dcfg.num_layers + 5 * dcfg.num_layers
    assert steps and all(s.as_text().count(f'custom_call_target="{kernels.targets["BF16"]}"') == bf16_calls
                         for s in steps)


def test_int8_layers_are_stacked_and_read_in_place(tiny_dirs, tmp_path, kernels, monkeypatch):
    """On the integer kernels the loader stacks the layers (model/stack.py: a step takes one array per field, not one
    per layer) and the engine its KV pools, and the kernels read a layer inside the stacks: the logits and the
    engine's tokens are bit-identical to the same file loaded layer by layer with a pool per layer.  Float32-activation
    layers keep their dense copies and stay a tuple."""
    from specjax.engine import engine as engine_module
    from specjax.model import loader
    from specjax.model.stack import LayerStack

    path = str(tmp_path / "llama-Q4_1.gguf")
    write_gguf_from_hf(tiny_dirs["llama"], path, "Q4_1")
    stacked = load_model(path, quant_kernels=True)
    assert isinstance(stacked.weights.layers, LayerStack)
    assert not isinstance(load_model(path, quant_kernels=True, activations="float32").weights.layers, LayerStack)
    monkeypatch.setattr(loader, "stackable", lambda layers: False)
    apart = load_model(path, quant_kernels=True)
    layers = stacked.weights.layers
    assert isinstance(apart.weights.layers, tuple) and len(layers) == len(apart.weights.layers) > 1
    assert len(jax.tree.leaves(layers)) * len(layers) == len(jax.tree.leaves(apart.weights.layers))
    assert [layer.w_down.layer for layer in layers] == list(range(len(layers)))
    assert layers[-1].w_qkv.layer == len(layers) - 1 and [q.w_o.layer for q in layers[:2]] == [0, 1]
    with pytest.raises(IndexError):
        layers[len(layers)]
    for i, layer in enumerate(layers):  # the host view of a stacked layer's blocks is that layer's
        np.testing.assert_array_equal(plain_blocks(layer.w_gate_up, "Q4_1").codes,
                                      plain_blocks(apart.weights.layers[i].w_gate_up, "Q4_1").codes)
    ids = random_prompt(np.random.default_rng(5), 9)
    np.testing.assert_array_equal(short_forward(stacked, ids), short_forward(apart, ids))
    config = EngineConfig(max_model_len=128, max_num_seqs=1, page_size=8)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    one = LLMEngine(stacked.config, stacked.weights, config=config)
    monkeypatch.setattr(engine_module, "stacks_pools", lambda *_: False)  # and the other's pools one per layer
    other = LLMEngine(apart.config, apart.weights, config=config)
    assert one.kv.stacked and not other.kv.stacked
    # on one device a step's arrays are committed to it (an uncommitted argument costs its placement check per call)
    assert all(a.committed for a in jax.tree.leaves((one.tweights, one.kv, other.tweights, other.kv)))
    assert one.generate([ids], params)[0].output_ids == other.generate([ids], params)[0].output_ids
    past = dataclasses.replace(layers[0].w_o, layer=len(layers))  # the kernel checks the layer against the stack
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(jax.jit(matmul)(past, jnp.ones((past.shape[1], 1), jnp.float32)))
