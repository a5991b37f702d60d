"""DFlash drafter parity with the reference PyPI package `dflash` (0.1.0, z-lab) on a tiny random Qwen3 target
and a tiny random drafter written in the z-lab format by our own `save_drafter`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.config import DrafterConfig, EngineConfig, RopeConfig
from specjax.drafter import dflash
from specjax.drafter.loader import init_drafter, load_drafter, save_drafter
from specjax.engine.engine import LLMEngine
from specjax.model.attention import write_rows
from specjax.model.loader import load_model
from specjax.model.target import init_kv_pages
from specjax.sampling import SamplingParams
from specjax.spec.proposer import DFlashProposer
from tests.helpers import hf_forward, import_or_missing, load_hf_torch, random_prompt

dflash_ref = import_or_missing("dflash.model")  # skipped without it, a failure where CI is set

BLOCK = 8
MASK_ID = 299  # an unused row of the tiny vocabulary, like Qwen3's 151669


@pytest.fixture(scope="module")
def pair(tiny_dirs, tmp_path_factory):
    """(our target, our drafter (cfg, weights), HF target, reference DFlashDraftModel) sharing weights."""
    target = load_model(tiny_dirs["qwen3"])
    t = target.config
    cfg = DrafterConfig(hidden_size=t.hidden_size, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=24,
                        intermediate_size=96, block_size=BLOCK, mask_token_id=MASK_ID, target_layer_ids=(0, 2),
                        num_target_layers=t.num_layers, vocab_size=t.vocab_size, target_hidden_size=t.hidden_size,
                        rms_norm_eps=1e-6, rope=RopeConfig(theta=t.rope.theta))
    weights = init_drafter(cfg, jax.random.PRNGKey(7), std=0.15)
    weights = jax.tree_util.tree_map(lambda a: a, weights)
    # Non-trivial norm weights, so that a wrong norm placement cannot pass unnoticed.
    rng = np.random.default_rng(0)
    weights = jax.tree_util.tree_map(
        lambda a: a + jnp.asarray(0.1 * rng.normal(size=a.shape), a.dtype) if a.ndim == 1 else a, weights)
    path = str(tmp_path_factory.mktemp("drafter"))
    save_drafter(path, cfg, weights)
    ref = dflash_ref.DFlashDraftModel.from_pretrained(path, dtype=torch.float32).eval()
    cfg2, weights2 = load_drafter(path, t)
    assert cfg2 == cfg
    return target, (cfg2, weights2), load_hf_torch(tiny_dirs["qwen3"]), ref


def test_reference_loads_our_checkpoint(pair):
    _, (cfg, _), _, ref = pair
    assert ref.block_size == cfg.block_size and ref.mask_token_id == cfg.mask_token_id
    assert list(ref.target_layer_ids) == list(cfg.target_layer_ids)


def test_draft_logits_match_reference_for_scripted_acceptance(pair):
    """Drive both drafters through the same context schedule with varied accepted lengths (0..K), checking the
    context append (a + 1 rows), the cache crop, the RoPE positions and the logits of every step."""
    target, (cfg, weights), hf_target, ref = pair
    rng = np.random.default_rng(5)
    tokens = random_prompt(rng, 70)
    _, hidden = hf_forward(hf_target, tokens)
    ctx_raw = np.concatenate([hidden[i + 1] for i in cfg.target_layer_ids], axis=-1)  # outputs of the layers
    embed_t = hf_target.get_input_embeddings()
    head = hf_target.lm_head

    page_size, num_pages = 4, 32
    dkv = init_kv_pages(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    pages = list(np.random.default_rng(1).permutation(np.arange(1, num_pages))[:20])
    table = jnp.asarray([pages])
    slot = lambda p: pages[p // page_size] * page_size + p % page_size  # noqa: E731

    cache = dflash_ref._make_cache(ref.config)
    s, prev = 11, 0  # prompt of 11 tokens, then accepted lengths below
    for a in [None, 0, 3, 7, 1, 0, 5, 2]:
        if a is not None:
            s = prev + a + 1
        new_rows = list(range(prev, s))
        # --- reference (HF semantics, exactly as dflash_generate drives it)
        with torch.no_grad():
            noise = embed_t(torch.tensor([[tokens[s]] + [MASK_ID] * (BLOCK - 1)]))
            out = ref(target_hidden=torch.tensor(ctx_raw[None, prev:s]), noise_embedding=noise,
                      position_ids=torch.arange(prev, s + BLOCK)[None], past_key_values=cache, use_cache=True)
            ref_logits = ref.compute_logits(out[:, 1:], head)[0].numpy()
        dflash_ref._crop_to(cache, s)
        # --- ours: observe the accepted rows, then propose from the bonus at position s
        rows = dflash.observe(weights, cfg, jnp.asarray(ctx_raw[None, prev:s]), jnp.asarray([new_rows]))
        dkv = write_rows(dkv, jnp.asarray([[slot(p) for p in new_rows]]), rows)
        ours = np.asarray(dflash.propose_logits(weights, cfg, dkv, target.weights.embed, target.weights.vocab_rows,
                                                jnp.asarray([tokens[s]]), jnp.asarray([s]), table, BLOCK - 1, BLOCK))[0]
        np.testing.assert_allclose(ours, ref_logits, atol=2e-4, rtol=1e-4, err_msg=f"step at s={s}")
        np.testing.assert_array_equal(ours.argmax(-1), ref_logits.argmax(-1))
        prev = s


def test_speculative_generation_matches_reference(pair):
    """The engine's drafts per step, acceptance lengths and final tokens equal `dflash_generate`'s."""
    target, (cfg, weights), hf_target, ref = pair
    prompt = random_prompt(np.random.default_rng(9), 13)
    max_new = 40
    drafts_ref = []
    orig = ref.compute_logits

    def record(hidden, head):
        logits = orig(hidden, head)
        drafts_ref.append(logits.argmax(-1)[0].tolist())
        return logits

    ref.compute_logits = record
    try:
        stats = dflash_ref.dflash_generate(ref, hf_target, torch.tensor([prompt]), max_new, None, block_size=BLOCK,
                                           return_stats=False)
    finally:
        ref.compute_logits = orig
    ref_tokens = stats[0, len(prompt):].tolist()

    engine = LLMEngine(target.config, target.weights, DFlashProposer(cfg, BLOCK), weights,
                       EngineConfig(page_size=4, max_model_len=128, max_num_seqs=1), eos_token_ids=(-1,),
                       record_drafts=True)
    [seq] = engine.generate([prompt], SamplingParams(max_new_tokens=max_new))
    assert seq.output_ids == ref_tokens
    # The reference shrinks the last blocks to fit max_length; compare the steps that used a full block.
    full = [d for d in drafts_ref if len(d) == BLOCK - 1]
    assert len(full) >= 3
    # Near max_new_tokens the engine asks for fewer drafts from the same full block: compare those as prefixes.
    assert [ref_d[:len(ours)] for ours, ref_d in zip(seq.stats.draft_log, full)] == seq.stats.draft_log[:len(full)]
    assert sum(len(d) for d in seq.stats.draft_log[:len(full)]) >= 3 * (BLOCK - 1)


def test_bench_peer_reference_runs_the_same_prompts(pair, tiny_dirs, tmp_path, capsys):
    import json

    from specjax.cli import main

    target, (cfg, weights), _, _ = pair
    drafter = str(tmp_path / "drafter")
    save_drafter(drafter, cfg, weights)
    out = tmp_path / "bench"
    assert main(["bench", "--model", tiny_dirs["qwen3"], "--methods", "ar,dflash", "--drafter", drafter,
                 "--datasets", "gsm8k", "--num-prompts", "2", "--max-new-tokens", "12", "--max-model-len", "1024",
                 "--peer", "dflash-reference", "--out-dir", str(out), "--compile-cache", ""]) == 0
    records = {r["method"]: r for r in json.loads((out / "bench.json").read_text())["records"]}
    assert records["dflash-reference"]["matches_ar"] and records["dflash"]["matches_ar"]
    assert records["dflash-reference"]["tau"] == pytest.approx(records["dflash"]["tau"], abs=0.3)
    assert "| gsm8k | dflash-reference |" in capsys.readouterr().out
