"""Step programs saved to disk and loaded without tracing (engine/program_store.py): a loaded program computes what
a compiled one does, any change to what decides a program misses, a broken entry is recompiled, and the store stays
within its size."""

import os

import jax
import pytest

from specjax.config import EngineConfig
from specjax.drafter.loader import drafter_config_for, init_drafter
from specjax.engine import program_store
from specjax.engine.engine import LLMEngine
from specjax.engine.program_store import ProgramStore
from specjax.model.loader import load_model
from specjax.sampling import SamplingParams
from specjax.spec.proposer import DFlashProposer

PROMPT, NEW = list(range(3, 40)), 24
pytestmark = pytest.mark.usefixtures("no_jax_compile_cache")


@pytest.fixture(scope="module")
def parts(tiny_dirs):
    target = load_model(tiny_dirs["llama"])
    dcfg = drafter_config_for(target.config, num_layers=1, block_size=4, target_layer_ids=(1, 2), mask_token_id=299)
    return target, dcfg, init_drafter(dcfg, jax.random.PRNGKey(0))


def decode(parts, cache, k=3):
    """One greedy request on a fresh engine with program store `cache` -> (tokens, store)."""
    target, dcfg, dw = parts
    engine = LLMEngine(target.config, target.weights, DFlashProposer(dcfg, 4), dw,
                       EngineConfig(page_size=4, max_model_len=96, max_num_seqs=1, prefill_chunk=64,
                                    num_draft_tokens=k, program_cache=cache))
    kv = engine.kv
    [seq] = engine.generate([PROMPT], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert all(x.is_deleted() for x in jax.tree.leaves(kv))  # the loaded commit still donates the KV pools
    return seq.output_ids, engine.program_store


def test_loaded_programs_decode_what_compiled_ones_do(parts, tmp_path):
    cache = str(tmp_path / "programs")
    plain, none = decode(parts, None)
    assert none is None
    first, store = decode(parts, cache)
    assert first == plain and store.hits == 0 and store.misses >= 4  # prefill, decode and their commits
    saved = sorted(os.listdir(cache))
    assert len(saved) == store.misses
    again, store = decode(parts, cache)
    assert again == plain and store.misses == 0 and store.hits == len(saved)
    other, store = decode(parts, cache, k=2)  # another static argument: other programs (the prefill's are shared)
    assert store.misses >= 2 and len(os.listdir(cache)) > len(saved)
    _, store = decode(parts, str(tmp_path / "elsewhere"), k=3)
    assert store.misses == len(saved)


def test_changed_code_misses_broken_entries_recompile_and_the_store_ages_out(parts, tmp_path, monkeypatch, caplog):
    target, dcfg, dw = parts
    cache = str(tmp_path / "programs")
    plain, _ = decode(parts, cache)
    saved = sorted(os.listdir(cache))
    keys = [ProgramStore(cache, code=code).key("decode_step", (("k", 3),), target.weights) for code in "ab"]
    assert keys[0] != keys[1]  # the package's source is part of every key
    for name in saved:  # torn writes: every entry unreadable
        with open(os.path.join(cache, name), "r+b") as fh:
            fh.truncate(100)
    again, store = decode(parts, cache)
    assert again == plain and store.errors == len(saved) and store.hits == 0
    assert "did not load" in caplog.text
    _, store = decode(parts, cache)  # replaced by whole entries
    assert store.hits == len(saved) and store.errors == 0
    sizes = {n: os.path.getsize(os.path.join(cache, n)) for n in os.listdir(cache)}
    store = ProgramStore(cache, max_bytes=max(sizes.values()))
    store._age_out()
    assert len(os.listdir(cache)) == 1  # only what fits, the most recently used first
    monkeypatch.setattr(program_store, "jax_cache_on", lambda: True)  # jax's cache could hand back its copy
    _, store = decode(parts, str(tmp_path / "with-jax-cache"))
    assert store.misses >= 4 and not os.path.exists(tmp_path / "with-jax-cache")
    assert "not saved" in caplog.text
