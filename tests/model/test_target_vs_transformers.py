"""Target parity with HF transformers on tiny random Llama (llama3 rope scaling), Qwen2 (qkv bias, tied head)
and Qwen3 (q/k norm, head_dim != hidden/heads) checkpoints: prefill and paged incremental decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.model import target as tgt
from specjax.model.attention import write_rows
from specjax.model.loader import load_model
from tests.helpers import FAMILIES, hf_forward, load_hf_torch, random_prompt

ATOL = 2e-4


def paged_layout(rng, lengths, page_size, num_pages):
    """Random, interleaved physical pages for each sequence: {seq: [pages in logical order]}."""
    need = [-(-n // page_size) for n in lengths]
    pool = rng.permutation(np.arange(1, num_pages))[: sum(need)]
    out, at = [], 0
    for n in need:
        out.append([int(p) for p in pool[at:at + n]])
        at += n
    return out


def slots_for(pages, positions, page_size):
    return [pages[p // page_size] * page_size + p % page_size for p in positions]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_and_taps_vs_transformers(tiny_dirs, family):
    loaded = load_model(tiny_dirs[family])
    cfg = loaded.config
    ids = random_prompt(np.random.default_rng(1), 23)
    ref_logits, ref_hidden = hf_forward(load_hf_torch(tiny_dirs[family]), ids)

    page_size, num_pages = 4, 16
    [pages] = paged_layout(np.random.default_rng(2), [len(ids)], page_size, num_pages)
    kv = tgt.init_kv_pages(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    batch = tgt.ForwardBatch(jnp.asarray([ids]), jnp.arange(len(ids))[None],
                             jnp.asarray([slots_for(pages, range(len(ids)), page_size)]), jnp.asarray([pages]))
    taps_idx = tuple(range(cfg.num_layers))  # HF's last entry is after the final norm: compare it via logits
    hidden, taps, _ = tgt.forward(loaded.weights, kv, batch, cfg, taps_idx)
    np.testing.assert_allclose(np.asarray(tgt.logits(loaded.weights, hidden))[0], ref_logits, atol=ATOL, rtol=1e-4)
    d = cfg.hidden_size
    for j, idx in enumerate(taps_idx):
        np.testing.assert_allclose(np.asarray(taps)[0, :, j * d:(j + 1) * d], ref_hidden[idx], atol=ATOL, rtol=1e-4,
                                   err_msg=f"hidden state {idx}")


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_incremental_decode_through_pages_vs_transformers(tiny_dirs, family):
    """Two sequences advance together by different chunk sizes (prefill, multi-token verify-like chunks and
    single-token decode) through small, shuffled, interleaved pages; every logit matches HF's full forward."""
    loaded = load_model(tiny_dirs[family])
    cfg = loaded.config
    rng = np.random.default_rng(3)
    seqs = [random_prompt(rng, 31), random_prompt(rng, 18)]
    hf = load_hf_torch(tiny_dirs[family])
    refs = [hf_forward(hf, s)[0] for s in seqs]
    schedule = [[9, 4], [1, 5], [6, 1], [1, 1], [3, 0], [11, 7]]  # new tokens per sequence per step
    assert [sum(c[i] for c in schedule) for i in range(2)] == [len(s) for s in seqs]

    page_size, num_pages = 4, 20
    layout = paged_layout(rng, [len(s) for s in seqs], page_size, num_pages)
    kv = tgt.init_kv_pages(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)

    @jax.jit  # one program per chunk width, as the engine runs it (op by op, the six widths took 35 s a family)
    def step(weights, kv, batch):
        hidden, _, rows = tgt.forward(weights, kv, batch, cfg)
        return tgt.logits(weights, hidden), write_rows(kv, batch.slots, rows)

    done = [0, 0]
    for chunk in schedule:
        t = max(chunk)
        tokens = np.zeros((2, t), np.int32)
        positions = np.zeros((2, t), np.int32)
        slots = np.full((2, t), -1, np.int32)
        for i, n in enumerate(chunk):
            pos = list(range(done[i], done[i] + n))
            tokens[i, :n] = seqs[i][done[i]:done[i] + n]
            positions[i, :n] = pos
            slots[i, :n] = slots_for(layout[i], pos, page_size)
        table = np.zeros((2, max(len(p) for p in layout)), np.int32)
        for i, pages in enumerate(layout):
            table[i, :len(pages)] = pages
        batch = tgt.ForwardBatch(*(jnp.asarray(a) for a in (tokens, positions, slots, table)))
        logits, kv = step(loaded.weights, kv, batch)
        logits = np.asarray(logits)
        for i, n in enumerate(chunk):
            np.testing.assert_allclose(logits[i, :n], refs[i][done[i]:done[i] + n], atol=ATOL, rtol=1e-4)
            done[i] += n


def test_rope_llama3_scaling_matches_transformers():
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from specjax.config import RopeConfig
    from tests.helpers import tiny_hf_config

    hf_cfg = tiny_hf_config("llama")
    inv_ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, torch.device("cpu"))
    rope = RopeConfig.from_hf(hf_cfg.to_dict())
    assert rope.scaling_type == "llama3"
    np.testing.assert_allclose(rope.inv_freq(hf_cfg.head_dim), inv_ref.numpy(), rtol=1e-6)
