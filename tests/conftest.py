"""Test environment: JAX on the CPU in float32, shared tiny random checkpoints in the real HF formats."""

import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite keeps glibc's default allocator even where it calls the CLI or LLM in-process (specjax/hostmem.py):
# one long process compiling hundreds of programs, with the allocation pattern its history was validated with.
os.environ.setdefault("SPECJAX_MALLOC_TUNING", "0")

from tests.scheduling import ProductionFileScheduling, configure_worker_flags  # noqa: E402

configure_worker_flags()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

from tests import helpers  # noqa: E402

COMPILE_CACHE_ENV = "SPECJAX_TEST_COMPILE_CACHE"
_CACHE_DIR = pytest.StashKey[str]()  # the run's cache directory, on the process that made it


def pytest_configure(config):
    """One jax persistent compilation cache for the whole run, shared by both xdist workers and the processes tests
    start: ~70% of the suite's time is XLA compiling programs that other test files compiled already (tests/spec's
    lossless file: 207 s from an empty cache, 61 s from a full one).  Created empty for each run and removed after
    it, so every program is still compiled once per run; `SPECJAX_TEST_COMPILE_CACHE=0` turns it off, and a
    JAX_COMPILATION_CACHE_DIR set by the user is used as it is."""
    if (os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get(COMPILE_CACHE_ENV, "1") == "0"
            or os.environ.get("JAX_COMPILATION_CACHE_DIR")):
        return  # a worker inherits the controller's environment (below): jax read it when conftest imported it
    import tempfile

    path = tempfile.mkdtemp(prefix="specjax-test-xla-")
    config.stash[_CACHE_DIR] = path
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    jax.config.update("jax_compilation_cache_dir", path)  # this process imported jax already (-n 0 runs tests here)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile (the suite's default) keeps the production-numerics files on the worker built as users'
    programs are (tests/scheduling.py)."""
    if config.getvalue("dist") == "loadfile":
        return ProductionFileScheduling(config, log)
    return None


def pytest_unconfigure(config):
    path = config.stash.get(_CACHE_DIR, None)
    if path:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def no_jax_compile_cache():
    """A test of specjax's own program store: jax's persistent cache off (the store saves nothing while it is on)."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", before)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test file.  XLA:CPU maps each executable's code into a few memory
    regions and jax's caches keep them all alive: the whole suite in one process reached 65,428 mappings, within
    100 of the kernel's limit (vm.max_map_count = 65,530), and segfaulted inside a compile in CI.  With this the
    peak is ~19k.  (Clearing only past 30k mappings measured the same suite time, 16:34 vs 16:55, at a 35k peak.)"""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """family -> directory of a tiny random HF checkpoint (config, safetensors, byte-level tokenizer)."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: helpers.make_hf_checkpoint(family, str(root / family)) for family in helpers.FAMILIES}


@pytest.fixture(scope="session")
def smollm_path():
    from specjax.model.loader import CheckpointError, default_model_path

    try:
        return default_model_path()
    except CheckpointError as e:
        helpers.missing(str(e))  # skipped, or a failure where CI is set


@pytest.fixture(scope="session")
def smollm(smollm_path):
    from specjax.model.loader import load_model

    return load_model(smollm_path)


@pytest.fixture(scope="session")
def smollm_xla_answer(smollm):
    """SmolLM2's greedy answer to helpers.SMOLLM_PROMPT (64 tokens) on one device with XLA's float32 products: the
    reference of the default kernels (tests/test_smollm.py) and of the model split over 3 devices
    (tests/parallel/test_smollm_tensor_parallel.py), computed once per worker."""
    from specjax.config import EngineConfig
    from specjax.llm import LLM
    from specjax.sampling import SamplingParams

    llm = LLM(method="ar", target=smollm, engine_config=EngineConfig(max_model_len=512, max_num_seqs=1))
    [answer] = llm.generate([helpers.SMOLLM_PROMPT], SamplingParams(max_new_tokens=64))
    assert len(answer.token_ids) == 64  # no EOS within it: every comparison covers 64 tokens
    return answer
