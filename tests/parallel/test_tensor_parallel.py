"""Tensor parallelism on 8 virtual CPU devices: every family at TP = 2 and 4 (qwen2, whose 8 KV heads divide,
also at 8), plain and DFlash decoding, batched with preemption, give the same greedy tokens as one device; the
weights, KV pages and collectives are laid out as parallel.py says; bad sizes fail with a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import helpers

DEVICES = 8
# Heads chosen so that TP = 4 divides the KV heads (qwen2: 8 KV heads, TP = 8; its vocabulary of 300 does not
# divide by 8, so that case also runs the replicated-vocabulary layout).
GEOMETRY = {"llama": dict(num_attention_heads=8, num_key_value_heads=4),
            "qwen2": dict(num_attention_heads=8, num_key_value_heads=8),
            "qwen3": dict(num_attention_heads=8, num_key_value_heads=4)}
SIZES = {"llama": (1, 2, 4), "qwen2": (1, 2, 4, 8), "qwen3": (1, 2, 4)}
# Plain decoding on one device is the oracle; DFlash at every size > 1 runs the same target forward plus the
# drafter (its tokens must equal plain decoding's), plain decoding again at the largest size.
CASES = {f: [(1, "ar"), (sizes[-1], "ar")] + [(tp, "dflash") for tp in sizes[1:]] for f, sizes in SIZES.items()}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100, 3, 100, 3, 100, 3, 100, 3, 100, 3, 100], [7]]
NEW_TOKENS = 20


def run_worker(cases: list[dict]) -> list[dict]:
    env = helpers.cpu_env(DEVICES)
    proc = subprocess.run([sys.executable, "-m", "tests.parallel.tp_worker"], input=json.dumps(cases), env=env,
                          capture_output=True, text=True, timeout=1200,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    cases, keys = [], []
    for family, geometry in GEOMETRY.items():
        path = helpers.make_hf_checkpoint(family, str(root / family), **geometry)
        for tp, method in CASES[family]:
            keys.append((family, tp, method))
            # 40 two-token pages: the four requests cannot all fit, so some are preempted and recomputed.
            # Page buckets of 1 and 32 (the widest) only: fewer programs to compile (~30% of the file's time);
            # padded page tables are the lossless test's subject, the split and its collectives are this file's.
            cases.append(dict(model=path, tp=tp, method=method, prompts=PROMPTS, max_new_tokens=NEW_TOKENS,
                              num_pages=40, drafter="random:1" if method == "dflash" else None, block_size=4,
                              page_bucket_factor=32))
        keys += [(family, 3, "ar"), (family, 16, "ar")]
        cases += [dict(model=path, tp=3, method="ar", prompts=PROMPTS, max_new_tokens=2),
                  dict(model=path, tp=16, method="ar", prompts=PROMPTS, max_new_tokens=2)]
    out = run_worker(cases)
    assert len(out) == len(cases)
    return dict(zip(keys, out))


@pytest.mark.parametrize("family", list(GEOMETRY))
def test_every_tensor_parallel_size_gives_the_same_greedy_tokens(results, family):
    base = results[(family, 1, "ar")]["tokens"]
    assert all(len(t) == NEW_TOKENS for t in base)
    for tp, method in CASES[family]:
        r = results[(family, tp, method)]
        assert r["tokens"] == base, (family, tp, method)
        assert r["preemptions"] >= 1, (family, tp, method)  # the pool was small enough to preempt


@pytest.mark.parametrize("family", list(GEOMETRY))
def test_weights_and_kv_pages_are_split_and_layers_cost_two_all_reduces(results, family):
    layers = helpers.tiny_hf_config(family).num_hidden_layers
    one = results[(family, 1, "ar")]
    assert one["kv_spec"] is None and not one["decode_collectives"]
    for tp in SIZES[family][1:]:
        r = results[(family, tp, "dflash")]
        assert r["kv_spec"] == ["tp"]
        kv = r["memory"]["kv_pool"]
        assert len(kv) == tp and len(set(kv.values())) == 1  # each device holds 1/tp of the pool
        assert sum(kv.values()) == sum(one["memory"]["kv_pool"].values())
        weights, total = r["memory"]["weights"], sum(one["memory"]["weights"].values())
        hf = helpers.tiny_hf_config(family)
        vocab = hf.vocab_size * hf.hidden_size * 4 * (1 if hf.tie_word_embeddings else 2)
        replicated = vocab if hf.vocab_size % tp else 0  # a vocabulary that does not divide stays whole
        assert len(weights) == tp and max(weights.values()) < (total - replicated) / tp * 1.1 + replicated
        # Megatron: one all-reduce after attention and one after the MLP per target layer (+1 for the
        # vocab-parallel embedding lookup, +1 for the drafter's); the logits stay vocab-sharded: each greedy argmax
        # (target and drafter heads) reduces a max and a first index over the shards (sampling.first_argmax: two
        # all-reduces of a few scalars, where jnp.argmax gathered the logits); nothing moves activations inside
        # the layers, and the commit is local.
        c = r["decode_collectives"]
        assert 2 * layers <= c.get("all-reduce", 0) <= 2 * layers + 6, c
        assert c.get("all-gather", 0) <= 4 and not c.get("all-to-all") and not c.get("collective-permute"), c
        assert not r["commit_collectives"]


def test_bad_tensor_parallel_sizes_are_clear_errors(results):
    for family in GEOMETRY:
        assert "does not divide" in results[(family, 3, "ar")]["error"]
        assert "needs 16 devices but 8" in results[(family, 16, "ar")]["error"]
