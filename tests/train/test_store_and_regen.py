"""Token store crash safety, several stores as one training set, target regeneration (resume, second turns,
reference answers), and the feature cache against online features.  The train-drafter CLI:
tests/train/test_train_drafter_cli.py."""

import itertools
import json
import os

import numpy as np
import pytest

from specjax.config import EngineConfig
from specjax.datasets import Prompt, load_eval, load_train_prompts, recover_sharegpt
from specjax.llm import LLM
from specjax.train.batches import SequenceBatches
from specjax.train.config import TrainConfig
from specjax.train.features import FeatureCache
from specjax.train.regen import regenerate
from specjax.train.store import StoreUnion, TokenStore, open_stores
from tests.helpers import run_cli, toy_store


def test_store_survives_a_torn_write(tmp_path):
    store = TokenStore(str(tmp_path / "s"), vocab_size=300)
    store.append("a", "x", [1, 2, 3], 1, "stop")
    store.append("b", "x", [4, 5], 1, "length")
    with open(tmp_path / "s" / "tokens.bin", "ab") as fh:  # crash after writing tokens, before the index line
        fh.write(np.asarray([7, 7, 7], np.uint16).tobytes())
    with open(tmp_path / "s" / "index.jsonl", "a") as fh:  # ... and a torn index line
        fh.write('{"id": "c", "sou')
    files = {f: (tmp_path / "s" / f).read_bytes() for f in ("tokens.bin", "index.jsonl", "meta.json")}
    again = TokenStore(str(tmp_path / "s"))
    assert len(again) == 2 and again.num_tokens == 5 and again.ids == {"a", "b"}
    assert [list(t) for _, t in again.sequences()] == [[1, 2, 3], [4, 5]]
    # opening never writes: several training runs read one store at once (and a reader must not cut the tokens
    # a running writer has flushed before their index line)
    assert {f: (tmp_path / "s" / f).read_bytes() for f in files} == files
    again.append("c", "x", [9], 0, "stop")  # the first append repairs the torn tail
    assert [list(t) for _, t in TokenStore(str(tmp_path / "s")).sequences()][-1] == [9]
    assert (tmp_path / "s" / "tokens.bin").stat().st_size == 6 * 2
    with pytest.raises(ValueError, match="holds vocab_size=300"):
        TokenStore(str(tmp_path / "s"), vocab_size=49152)


def test_several_stores_read_as_one_training_set(tiny_dirs, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    toy_store(a, 5, 70, 256, 10, seed=0)
    toy_store(b, 3, 60, 256, 10, seed=1)  # e.g. sampled answers to some of the same prompts (ids may repeat)
    assert isinstance(open_stores(a), TokenStore)
    union = open_stores(f"{a},{b}")
    assert isinstance(union, StoreUnion) and len(union) == 8 and union.num_tokens == 5 * 70 + 3 * 60
    assert [list(t) for _, t in union.sequences()] == ([list(t) for _, t in TokenStore(a).sequences()] +
                                                      [list(t) for _, t in TokenStore(b).sequences()])
    assert len(SequenceBatches(union, TrainConfig(block_size=4)).seqs) == 8
    with pytest.raises(ValueError, match="not a token store"):
        open_stores(f"{a},{tmp_path / 'typo'}")
    with pytest.raises(ValueError, match="no token store named"):
        open_stores(",")
    assert not os.path.exists(tmp_path / "typo")  # a wrong path is not created as an empty store
    TokenStore(str(tmp_path / "c"), 49152)
    with pytest.raises(ValueError, match="different vocabularies"):
        open_stores(f"{a},{tmp_path / 'c'}")
    common = ["train-drafter", "--target", tiny_dirs["qwen3"], "--out", str(tmp_path / "run"), "--layers", "1",
              "--block-size", "4", "--target-layer-ids", "0,2", "--batch-size", "2", "--num-anchors", "4",
              "--eval-prompts", "0", "--compile-cache", "", "--steps", "1"]
    _, err = run_cli(common + ["--data", f"{a},{tmp_path / 'typo'}"], ok=False)
    assert "error: --data:" in err and "not a token store" in err
    _, err = run_cli(common + ["--data", f"{a},{b}", "--features", str(tmp_path / "feats")], ok=False)
    assert "--features caches one store" in err
    run_cli(common + ["--data", f"{a},{b}"])
    config = json.load(open(tmp_path / "run" / "train_config.json"))
    assert config["data"] == f"{a},{b}" and config["data_sequences"] == 8


def test_sharegpt_recovery_stops_at_the_truncated_record(tmp_path):
    p = tmp_path / "sg.json"
    p.write_text('[ {"id": "1", "conversations": [{"from": "human", "value": "hi"}]},\n'
                 ' {"id": "2", "conversations": []}, {"id": "3", "conversations": [{"from": "hu')
    assert [r["id"] for r in recover_sharegpt(str(p))] == ["1", "2"]
    prompts = load_train_prompts(["sharegpt"], sharegpt_file=str(p))
    assert [q.turns for q in prompts] == [["hi"]]


def test_second_turns_are_answered_after_the_targets_own_first_answer(tiny_dirs, tmp_path):
    """`sharegpt_turn2`: the prompt is the first turn, the store's own answer to it and the second turn, encoded as
    `specjax bench` encodes mt_bench's second turns; without a stored first answer the prompt waits; answers stop
    at --max-seq-tokens."""
    def turn(who, text):
        return {"from": who, "value": text}

    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([
        {"id": "a", "conversations": [turn("human", "first a"), turn("gpt", "x"), turn("human", "second a"),
                                      turn("gpt", "ref a")]},
        {"id": "b", "conversations": [turn("human", "first b"), turn("gpt", "y"), turn("human", "second b")]},
        {"id": "c", "conversations": [turn("human", "only one turn"), turn("gpt", "z")]},
        {"id": "d", "conversations": [turn("human", "first d"), turn("gpt", "w"), turn("human", "z" * 3000)]},
    ]))
    firsts = load_train_prompts(["sharegpt"], sharegpt_file=str(sg))
    seconds = load_train_prompts(["sharegpt_turn2"], sharegpt_file=str(sg))
    assert [(q.id, q.after, q.turns, q.reference) for q in seconds] == [
        ("sharegpt2/a", "sharegpt/a", ["first a", "second a"], "ref a"),
        ("sharegpt2/b", "sharegpt/b", ["first b", "second b"], None)]  # d's second turn is over 2000 characters
    llm = LLM(tiny_dirs["qwen3"], method="ar", engine_config=EngineConfig(max_model_len=128, max_num_seqs=2))
    store = TokenStore(str(tmp_path / "r"), 300)
    regenerate(llm, [q for q in firsts if q.id == "sharegpt/a"], store, max_new_tokens=6)
    stats = regenerate(llm, seconds, store, max_new_tokens=60, max_seq_tokens=80)
    assert stats["generated"] == 1 and stats["skipped_no_first_answer"] == 1  # b's first turn was never answered
    (_, first), (rec, second) = list(store.sequences())
    answer = llm.tokenizer.decode(first[len(llm.encode("first a")):].tolist(), skip_special_tokens=True)
    prompt = llm.encode([{"role": "user", "content": "first a"}, {"role": "assistant", "content": answer},
                         {"role": "user", "content": "second a"}])
    assert rec["id"] == "sharegpt2/a" and second[:rec["prompt_len"]].tolist() == prompt
    assert len(prompt) + 16 <= 80 < len(prompt) + 60  # the cap, not max_new_tokens, bounds the answer
    assert rec["length"] <= 80 and (rec["length"] == 80) == (rec["finish"] == "length")
    _, err = run_cli(["regenerate", "--target", tiny_dirs["qwen3"], "--out", str(tmp_path / "ref"), "--sources",
                      "sharegpt_turn2", "--sharegpt-file", str(sg), "--answers", "reference", "--compile-cache", ""],
                     ok=False)
    assert "needs the target" in err


def test_eval_and_train_prompts_are_disjoint():
    train_ids = {p.id for p in load_train_prompts(["gsm8k_train", "mbpp_train"])}
    for name in ("gsm8k", "mbpp"):
        ev = load_eval(name)
        assert ev and not {p.id for p in ev} & train_ids
    assert len(load_eval("mbpp")) == 500 and len(load_eval("mt_bench")[0].turns) == 2


def test_regenerate_resumes_without_duplicates(tiny_dirs, tmp_path):
    llm = LLM(tiny_dirs["qwen3"], method="ar", engine_config=EngineConfig(max_model_len=64, max_num_seqs=2))
    prompts = [Prompt(f"p{i}", "toy", [f"question {i}"]) for i in range(5)]
    store = TokenStore(str(tmp_path / "r"), 300)
    first = regenerate(llm, prompts[:3], store, max_new_tokens=8)
    assert first["generated"] == 3
    store = TokenStore(str(tmp_path / "r"))  # reopen, as after a crash
    second = regenerate(llm, prompts, store, max_new_tokens=8)
    assert second["generated"] == 2 and len(store) == 5
    for rec, toks in store.sequences():
        assert rec["prompt_len"] < len(toks) <= rec["prompt_len"] + 8
    # the CLI resumes a store only at its own temperature: greedy and sampled answers do not mix in one store
    _, err = run_cli(["regenerate", "--target", tiny_dirs["qwen3"], "--out", str(tmp_path / "r"), "--sources",
                      "gsm8k_train", "--temperature", "0.7", "--compile-cache", ""], ok=False)
    assert "holds answers at temperature 0.0, not 0.7" in err and len(TokenStore(str(tmp_path / "r"))) == 5


def test_feature_cache_matches_online_features_and_resumes(tiny_dirs, tmp_path):
    import jax.numpy as jnp

    from specjax.model.loader import load_model
    from specjax.train.features import build_feature_cache, target_features

    target = load_model(tiny_dirs["qwen3"])
    store = TokenStore(str(tmp_path / "data"), 300)
    rng = np.random.default_rng(2)
    lens = [70, 33, 100, 64, 90]
    for i, n in enumerate(lens):
        store.append(f"s{i}", "toy", rng.integers(0, 256, n), 5, "length")
    taps = (1, 3)

    class Crash(Exception):
        pass

    calls = []

    def crash_after_second(done, total):  # windows of 2: [s1 (33 tokens), s0 (70)] are two forwards, then s2..
        calls.append(done)
        if len(calls) == 2:
            raise Crash

    with pytest.raises(Crash):  # an interrupted build keeps the windows it finished
        build_feature_cache(target, store, str(tmp_path / "c"), taps, max_len=96, batch_tokens=128,
                            progress=crash_after_second, window=2)
    partial = FeatureCache(str(tmp_path / "c"))
    assert calls == [1, 2] and partial.meta["done"] == 2 and not partial.complete
    with pytest.raises(ValueError, match="incomplete"):
        partial.check(store, taps, target.config.hidden_size, 96)
    cache = build_feature_cache(target, store, str(tmp_path / "c"), taps, max_len=96, batch_tokens=128)
    cache.check(store, (3,), target.config.hidden_size, 96)
    seqs = [t for _, t in store.sequences()]
    toks = np.zeros((2, 128), np.int32)
    for r, i in enumerate([2, 4]):
        toks[r, :min(lens[i], 96)] = seqs[i][:96]
    online = np.asarray(target_features(target.weights, jnp.asarray(toks), target.config, (3,)))
    cached = cache.batch([2, 4], 128, (3,))
    for r, i in enumerate([2, 4]):
        n = min(lens[i], 96)
        np.testing.assert_allclose(cached[r, :n], online[r, :n], rtol=2e-3, atol=2e-3)
        assert not cached[r, n:].any()
    with pytest.raises(ValueError, match=r"not \[2\]"):
        cache.check(store, (2, 3), target.config.hidden_size, 96)
    with pytest.raises(ValueError, match="max_len=128"):
        cache.check(store, taps, target.config.hidden_size, 128)
    store.append("s9", "toy", rng.integers(0, 256, 40), 5, "length")
    with pytest.raises(ValueError, match="built for a store of 5 sequences"):
        cache.check(store, taps, target.config.hidden_size, 96)
    calls = []  # a grown store extends its cache: only the new sequence runs, the old rows stay
    grown = build_feature_cache(target, store, str(tmp_path / "c"), taps, max_len=96, batch_tokens=128,
                                progress=lambda done, total: calls.append((done, total)))
    assert calls == [(6, 6)]
    grown.check(store, taps, target.config.hidden_size, 96)
    np.testing.assert_array_equal(grown.batch([2, 4], 128, (3,)), cached)
    toks = np.zeros((1, 64), np.int32)
    toks[0, :40] = [t for _, t in store.sequences()][5]
    online = np.asarray(target_features(target.weights, jnp.asarray(toks), target.config, (3,)))
    np.testing.assert_allclose(grown.batch([5], 64, (3,))[0, :40], online[0, :40], rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="other settings or data"):
        build_feature_cache(target, TokenStore(str(tmp_path / "other"), 300), str(tmp_path / "c"), taps, max_len=96)


def test_reference_answers_store_like_regenerated_ones_and_merge_with_their_features(tiny_dirs, tmp_path):
    """`regenerate --answers reference`: the prompt encoded as the target's regeneration encodes it, then the
    source's answer and EOS (cut at max_new_tokens: "length"); resumable, bounded by max_tokens.  Then two stores
    and their feature caches merge into one pair that serves the same rows."""
    from specjax.model.loader import load_model
    from specjax.train.features import build_feature_cache
    from specjax.train.merge import merge_stores
    from specjax.train.regen import store_references

    assert all(p.reference for p in load_train_prompts(["gsm8k_train"])[:50])  # every source has its answers
    target = load_model(tiny_dirs["qwen3"])
    tok, eos = target.tokenizer, target.config.eos_token_ids[0]
    prompts = [Prompt(f"q{i}", "toy", [f"question {i}"], "answer " * (i + 1)) for i in range(6)]
    prompts.append(Prompt("none", "toy", ["no answer"]))
    store = TokenStore(str(tmp_path / "ref"), 300)
    stats = store_references(tok, prompts[:2], store, max_new_tokens=4, eos_token_id=eos)
    assert stats["stored"] == 2
    store = TokenStore(str(tmp_path / "ref"))  # reopened: resumes, skips what it holds and prompts with no answer
    stats = store_references(tok, prompts, store, max_new_tokens=4, eos_token_id=eos)
    assert stats == {**stats, "stored": 4, "skipped": 1} and len(store) == 6
    for (rec, toks), p in zip(store.sequences(), prompts):
        ids = tok.encode_chat([{"role": "user", "content": p.turns[0]}])
        answer = tok.encode(p.reference, add_special_tokens=False)
        assert list(toks[:rec["prompt_len"]]) == ids
        want = answer[:4] if len(answer) >= 4 else answer + [eos]
        assert list(toks[rec["prompt_len"]:]) == want and rec["finish"] == ("length" if len(answer) >= 4 else "stop")
    capped = TokenStore(str(tmp_path / "capped"), 300)
    store_references(tok, prompts, capped, max_new_tokens=4, eos_token_id=eos, max_tokens=1)
    assert len(capped) == 1
    other = TokenStore(str(tmp_path / "other"), 300)
    other.append("x", "toy", np.arange(3, 40), 5, "length")
    taps = (1, 3)
    for name, s in (("ref", store), ("other", other)):
        build_feature_cache(target, s, str(tmp_path / f"f-{name}"), taps, max_len=32, batch_tokens=128)
    merged, cache = merge_stores([(store.path, str(tmp_path / "f-ref")), (other.path, str(tmp_path / "f-other"))],
                                 str(tmp_path / "mix"), str(tmp_path / "f-mix"))
    assert [r["id"] for r in merged.index] == [r["id"] for r in store.index] + ["x"]
    assert [list(t) for _, t in merged.sequences()] == [list(t) for s in (store, other) for _, t in s.sequences()]
    parts = FeatureCache(str(tmp_path / "f-ref")), FeatureCache(str(tmp_path / "f-other"))
    np.testing.assert_array_equal(cache.batch([1, 6], 40, taps)[0], parts[0].batch([1], 40, taps)[0])
    np.testing.assert_array_equal(cache.batch([1, 6], 40, taps)[1], parts[1].batch([0], 40, taps)[0])
    with pytest.raises(ValueError, match="exists"):
        merge_stores([(store.path, str(tmp_path / "f-ref"))], str(tmp_path / "mix"), str(tmp_path / "f-new"))
    with pytest.raises(ValueError, match="more than one store"):
        merge_stores([(store.path, str(tmp_path / "f-ref"))] * 2, str(tmp_path / "m2"), str(tmp_path / "f-m2"))
    # keep_first: a store whose first sequence the other already holds contributes only the rest, rows included
    tail = TokenStore(str(tmp_path / "tail"), 300)
    for rec, toks in itertools.islice(store.sequences(), 4, None):
        tail.append(rec["id"], rec["source"], toks, rec["prompt_len"], rec["finish"])
    tail.append("y", "toy", np.arange(5, 30), 5, "length")
    build_feature_cache(target, tail, str(tmp_path / "f-tail"), taps, max_len=32, batch_tokens=128)
    both, bcache = merge_stores([(store.path, str(tmp_path / "f-ref")), (tail.path, str(tmp_path / "f-tail"))],
                                str(tmp_path / "m3"), str(tmp_path / "f-m3"), keep_first=True)
    assert [r["id"] for r in both.index] == [r["id"] for r in store.index] + ["y"]
    np.testing.assert_array_equal(bcache.batch([5, 6], 40, taps), np.concatenate(
        [parts[0].batch([5], 40, taps), FeatureCache(str(tmp_path / "f-tail")).batch([2], 40, taps)]))
