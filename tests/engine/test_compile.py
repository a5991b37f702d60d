"""Compile once per shape bucket: after warm-up (ahead, or in the background), generation compiles nothing."""

import gc

import jax
import jax.extend
import pytest

from specjax.config import EngineConfig
from specjax.drafter.loader import drafter_config_for, init_drafter
from specjax.engine import runner
from specjax.engine.engine import LLMEngine
from specjax.model.loader import load_model
from specjax.sampling import GREEDY, SamplingParams
from specjax.spec.proposer import DFlashProposer


@pytest.fixture(scope="module")
def parts(tiny_dirs):
    target = load_model(tiny_dirs["llama"])
    dcfg = drafter_config_for(target.config, num_layers=1, block_size=4, target_layer_ids=(1, 2), mask_token_id=299)
    return target, dcfg, init_drafter(dcfg, jax.random.PRNGKey(0))


def make_engine(parts):
    target, dcfg, dw = parts
    return LLMEngine(target.config, target.weights, DFlashProposer(dcfg, 4), dw,
                     EngineConfig(page_size=4, max_model_len=128, max_num_seqs=1, prefill_chunk=32))


def jit_cache_sizes():
    return runner.prefill_step._cache_size(), runner.decode_step._cache_size(), runner.commit._cache_size()


PROMPT, NEW = list(range(3, 50)), 60


def test_no_compile_after_warmup(parts):
    engine = make_engine(parts)
    seen = []  # the progress callback sees every shape built now, in order, with the total known from the start
    n = engine.warmup(len(PROMPT), len(PROMPT) + NEW, modes=(GREEDY,), progress=lambda d, t: seen.append((d, t)))
    assert n >= 4 and seen == [(i, n) for i in range(1, n + 1)]  # prefill chunks of 16 and 32, decode at 2 widths
    built, sizes = set(engine.programs.ready), jit_cache_sizes()
    [seq] = engine.generate([PROMPT], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert len(seq.output_ids) == NEW
    assert engine.programs.foreground_builds == 0 and set(engine.programs.ready) == built
    assert jit_cache_sizes() == sizes


def test_warmup_all_compiles_every_shape_and_nothing_after(parts):
    """`serve --warmup all`: every shape the engine can produce is built at start-up (each prefill chunk at both
    page-table widths, a decode step at every page bucket), and requests of any length compile nothing after."""
    engine = make_engine(parts)
    n = engine.warmup_all(modes=(GREEDY,))
    built, sizes = set(engine.programs.ready), jit_cache_sizes()
    assert n == len(built) and {s.n for s in built if s.kind == "prefill"} == {16, 32}
    assert {s.pages for s in built if s.kind == "decode"} == set(engine.page_buckets)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    for prompt in (PROMPT[:5], PROMPT):
        [seq] = engine.generate([prompt], params)
        assert len(seq.output_ids) == NEW
    assert engine.programs.foreground_builds == 0 and set(engine.programs.ready) == built
    assert jit_cache_sizes() == sizes


def test_background_warmup_compiles_what_steps_use_off_the_engine_thread(parts):
    """The prefill shape first; decode steps run at the widest page table the request reaches, so one decode
    program (built on the background thread) serves every step; a second identical request compiles nothing, and
    nothing ever compiles on the calling thread."""
    engine = make_engine(parts)
    assert engine.warmup(len(PROMPT), len(PROMPT) + NEW, modes=(GREEDY,), background=True) == 1  # the prefill
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    [first] = engine.generate([PROMPT], params)
    assert engine.programs.wait_idle(300)
    built = set(engine.programs.ready)
    # 48..110 tokens (+ K = 3 drafts) reach 28 pages of 4 -> the 32-page bucket, from the first decode step on;
    # both prefill chunks (32 + 15 tokens) ran in the one prefill program, as wide as the prompt (12 pages -> 16),
    # not at the full 32-page width of max_model_len
    assert {(s.kind, s.pages) for s in built} == {("prefill", 16), ("decode", 32)}
    runs = engine.programs.runs.copy()
    [second] = engine.generate([PROMPT], params)
    assert second.output_ids == first.output_ids
    assert engine.programs.foreground_builds == 0 and set(engine.programs.ready) == built
    assert all(engine.programs.runs[s] > runs[s] for s in built)


def test_without_warmup_each_shape_compiles_once_when_first_needed(parts):
    engine = make_engine(parts)
    engine.generate([PROMPT], SamplingParams(max_new_tokens=20, ignore_eos=True))
    first = engine.programs.foreground_builds
    assert first == len(engine.programs.ready) > 0
    engine.generate([PROMPT], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert engine.programs.foreground_builds == first


def test_adaptive_k_without_warmup_still_tries_every_k(parts):
    """Without background compilation the controller is not limited to compiled K: each option gets compiled
    (here, on the calling thread) and timed."""
    target, dcfg, dw = parts
    engine = LLMEngine(target.config, target.weights, DFlashProposer(dcfg, 4), dw,
                       EngineConfig(page_size=4, max_model_len=128, max_num_seqs=1, prefill_chunk=32, adaptive_k=True))
    engine.generate([PROMPT], SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert set(engine.k_history) == set(engine.k_options) and len(engine.k_options) > 2


def test_a_background_build_never_reads_the_live_caches(parts):
    """A step donates the KV caches and only then gets the new ones back: a program built on the background thread
    in between must not touch the donated arrays (it did: "Array has been deleted", when decode programs began
    compiling during the first prefill).  Programs are built from specs taken at start-up."""
    from specjax.engine.programs import StepShape

    engine = make_engine(parts)
    for x in jax.tree.leaves((engine.kv, engine.pstate)):
        x.delete()  # the state between a donating step's launch and its results
    engine.programs.build_now(StepShape("decode", 1, engine.k_options[0], 4, GREEDY))
    engine.programs.build_now(StepShape("prefill", 1, 16, 4, GREEDY))


def test_prefill_chunks_padded_into_a_larger_program_ask_for_their_own_shape(parts):
    """Compiling on demand, a prefill chunk that runs padded in a larger ready program (four prompts x 32 tokens,
    as a first step of four prompts builds) asks for its own (batch, tokens) bucket, which is then built on the
    background thread and used.  Before, the padded program itself was taken as the need: every later chunk of one
    short prompt ran as four prompts x 32 tokens (regeneration spent ~half its time there) and never asked for
    anything."""
    from specjax.engine.programs import StepShape

    target, dcfg, dw = parts
    engine = LLMEngine(target.config, target.weights, DFlashProposer(dcfg, 4), dw,
                       EngineConfig(page_size=4, max_model_len=128, max_num_seqs=4, prefill_chunk=32))
    engine.programs.on_demand, engine.programs.demand_after = True, {"decode": 8, "prefill": 2}
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    big = StepShape("prefill", 4, 32, 32, GREEDY)
    engine.programs.build_now(big)
    short = StepShape("prefill", 1, 16, 1, GREEDY)  # a 10-token prompt: its only chunk reads no cached pages
    for i in range(3):
        engine.generate([list(range(3 + i, 13 + i))], params)
        assert engine.programs.wait_idle(300)
    assert short in engine.programs.ready and engine.programs.runs[short] >= 1
    assert engine.programs.foreground_builds == 0
    engine.programs.close()


def test_a_capped_program_cache_frees_programs_and_changes_no_output(parts):
    """With max_step_programs, background compilation keeps at most that many programs (freeing the least recently
    used, in jax's caches too) and the engine still never compiles on its own thread; the tokens are those of an
    engine that keeps every program."""
    target, dcfg, dw = parts
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 12, 70)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)

    def live_executables():
        gc.collect()
        return len(jax.extend.backend.get_backend().live_executables())

    def run(cap):
        jax.clear_caches()  # what other tests of this process left in jax's caches (their live objects stay)
        before = live_executables()
        engine = LLMEngine(target.config, target.weights, DFlashProposer(dcfg, 4), dw,
                           EngineConfig(page_size=4, max_model_len=128, max_num_seqs=2, prefill_chunk=32,
                                        max_step_programs=cap))
        engine.warmup(8, 40, modes=(GREEDY,), background=True)
        engine.programs.demand_after = {"decode": 1, "prefill": 1}
        outs = [s.output_ids for p in prompts for s in engine.generate([p], params)]
        outs += [s.output_ids for s in engine.generate(prompts[:2], params)]
        assert engine.programs.wait_idle(300) and engine.programs.foreground_builds == 0
        engine.programs.close()
        return outs, engine.programs, live_executables() - before

    capped, programs, live = run(2)
    reference, everything, live_everything = run(0)
    assert capped == reference
    assert len(everything.ready) > 3 and everything.evictions == 0
    assert len(programs.ready) <= 2 and programs.evictions >= len(everything.ready) - 2
    assert live <= 2 * 2 < len(everything.ready) <= live_everything  # a step (+ a commit, often shared) each


def test_on_the_attention_kernel_every_decode_step_passes_the_widest_page_table(parts):
    """The in-place attention kernel reads each sequence's cached rows only, so a step costs the same at any
    page-table width: on it every decode step passes the widest table (one program per (batch, K), not one per page
    bucket too), and the tokens equal those of the gathered path, whose steps take a width per bucket.  On both, a
    prompt's first prefill chunk reads no cached pages (the narrowest table); its later chunks read the full width."""
    import dataclasses

    from tests.helpers import native_attention_kernel

    target, dcfg, dw = parts
    on_kernel = dataclasses.replace(target.weights, attention_kernel=native_attention_kernel())
    config = EngineConfig(page_size=4, max_model_len=128, max_num_seqs=2, prefill_chunk=32)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    outs, shapes = [], []
    for weights in (target.weights, on_kernel):
        engine = LLMEngine(target.config, weights, DFlashProposer(dcfg, 4), dw, config)
        outs.append([s.output_ids for s in engine.generate([PROMPT, PROMPT[:9]], params)])
        shapes.append({(s.kind, s.pages) for s in engine.programs.ready})
    assert outs[0] == outs[1]
    gathered, in_place = shapes
    full = 32  # 128 tokens in pages of 4
    assert {p for kind, p in in_place if kind == "decode"} == {full}
    assert len({p for kind, p in gathered if kind == "decode"}) > 1
    assert {p for kind, p in gathered if kind == "prefill"} == {p for kind, p in in_place if kind == "prefill"} \
        == {1, full}  # the 47-token prompt: a fresh chunk of 32, then 15 tokens after 32 cached
