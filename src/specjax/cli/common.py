"""Shared pieces of the command line: model flags, compile cache, machine facts."""

from __future__ import annotations

import argparse
import os
import sys

from specjax.config import KV_CACHE_DTYPES, EngineConfig
from specjax.kernels import ACTIVATIONS

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "specjax", "xla")


def enable_compile_cache(path: str | None) -> None:
    """Persist compiled XLA programs across runs (first run compiles, later runs load)."""
    import jax

    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def engine_compile_cache(args) -> str | None:
    """Persist a command's compiled engine programs across runs (call after join_processes).  An engine on one
    device in one process keeps its step programs in `<--compile-cache>-programs`, loaded without tracing
    (engine/program_store.py): that directory is returned (EngineConfig.program_cache), and jax's persistent cache
    stays off in the process (a program loaded from it cannot be saved again).  Otherwise jax's persistent cache."""
    import jax

    if not args.compile_cache:
        return None
    if jax.process_count() == 1 and args.tensor_parallel_size == 1:
        return args.compile_cache.rstrip("/\\") + "-programs"
    enable_compile_cache(args.compile_cache)
    return None


def add_lookup_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookup-min-match", type=int, default=None, metavar="N",
                   help="prompt lookup assists a DFlash / EAGLE-3 drafter: a step whose context ends in an n-gram of "
                        ">= N tokens seen before verifies what followed it instead of the drafter's block (0 = off; "
                        "default: 4 for DFlash and EAGLE-3 at a fixed K on a CPU, else off)")


def add_context_vocab_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-vocab", type=int, default=EngineConfig.context_vocab, metavar="N",
                   help="a DFlash drafter with a draft vocabulary also drafts each prompt's last N distinct tokens "
                        "outside it (names, identifiers the answer copies; 0 = off; default %(default)s)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF model directory, .gguf file, or hub name ORG/NAME[@REVISION] (HF cache; HF_HUB_OFFLINE "
                        "respected) (default: embedded SmolLM2-135M)")
    p.add_argument("--drafter", default=None,
                   help="drafter directory or hub name (DFlash z-lab format, or EAGLE-3 for --method eagle3), or "
                        "random[:LAYERS[:DRAFT_VOCAB]]; default: the shipped drafter")
    p.add_argument("--method", default=None, choices=["ar", "dflash", "ngram", "eagle3"],
                   help="decoding method (default: dflash when a drafter is available, else ar)")
    p.add_argument("--ngram", default="1,3", help="n-gram lookup: min,max n (method ngram)")
    p.add_argument("--block-size", type=int, default=None, help="DFlash block size (default: the drafter's)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="drafts verified per step, <= block_size-1 (default: DFlash at a fixed K, 3 on CPU and "
                        "block_size-1 elsewhere; with adaptive K, the largest option)")
    add_lookup_arg(p)
    add_context_vocab_arg(p)
    p.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output (tokens)")
    p.add_argument("--page-size", type=int, default=16, help="KV page size (tokens)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights/activations dtype (float32 is fastest on CPU)")
    p.add_argument("--compile-cache", default=DEFAULT_CACHE, help="persistent XLA cache dir ('' to disable)")
    add_quant_kernel_arg(p)
    add_parallel_args(p)


def add_quant_kernel_arg(p: argparse.ArgumentParser) -> None:
    """The CPU runtime's options: the GGUF kernels, their activations, and the KV cache's dtype."""
    p.add_argument("--quant-kernels", default=True, action=argparse.BooleanOptionalAction,
                   help="GGUF targets: multiply Q4_0/Q4_1/Q8_0 weights in their blocks with specjax's CPU kernels "
                        "(every product with integer activations, up to 12 tokens with float32 ones; float32, one "
                        "device, AVX-512F or AVX2 + FMA; else XLA on float32 copies)")
    p.add_argument("--kernel-activations", default="int16", choices=ACTIVATIONS,
                   help="how those kernels take their activations: int16 per block of 32 (the model's answers at "
                        "integer speed; ~1e-5 relative error in a product), int8 per block of 32 (llama.cpp's "
                        "scheme, a little faster; ~1e-3, enough to flip a small model's near-ties) or float32 "
                        "(the float32 product of the dequantized weights, to rounding)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="dtype of the target's KV cache (auto: float16 on the integer-activation kernels, as "
                        "llama.cpp, else the activations'); a 16-bit cache holds twice the tokens and is read in "
                        "half the time, at a rounding of every key and value")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the target over this many devices (heads, MLP and vocabulary; KV pages by KV head); "
                        "with several processes, over the devices of all of them")
    env = os.environ.get
    p.add_argument("--coordinator-address", default=env("JAX_COORDINATOR_ADDRESS"),
                   help="multi-host: HOST:PORT of process 0 (jax.distributed; env JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, default=int(env("JAX_NUM_PROCESSES", "0")) or None,
                   help="multi-host: number of processes (env JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=int(env("JAX_PROCESS_ID")) if env("JAX_PROCESS_ID") else None,
                   help="multi-host: this process's index, 0 = the one that prints / serves (env JAX_PROCESS_ID)")


def join_processes(args) -> None:
    """Join the multi-process run the flags describe (no-op for one process)."""
    from specjax.parallel import initialize_distributed

    initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)


UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30}


def parse_bytes(text: str) -> int:
    """"2GiB", "1.5GB", "512MiB", "1000000" -> bytes (argparse type: a bad size is a usage error naming it)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use bytes or a number with B, KB, MB, GB, KiB, "
                                         "MiB or GiB")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


class StderrProgress:
    """A `progress(done, total)` callback drawn as one tqdm line on stderr (n of N, elapsed, time left) while a
    user waits; silent when stderr is not a terminal (logs keep the summary line the caller prints)."""

    def __init__(self, desc: str, unit: str = "shape"):
        self.desc, self.unit, self.bar = desc, unit, None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, file=sys.stderr, disable=None, leave=False)
        self.bar.update(done - self.bar.n)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def histogram_lines(taus: list[int], width: int = 30) -> list[str]:
    if not taus:
        return []
    counts = [taus.count(t) for t in range(1, max(taus) + 1)]
    peak = max(counts)
    return [f"  tau={t:>2}: {c:>5} {'#' * max(1 if c else 0, round(width * c / peak))}" for t, c in
            enumerate(counts, 1)]


def machine_info() -> dict:
    import platform

    import jax

    import specjax
    from specjax.kernels import cpu_flags, cpu_model, simd_isa

    flags = cpu_flags()
    return {"specjax": specjax.__version__, "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "cpu": cpu_model(), "kernel_isa": simd_isa(flags), "avx512_vnni": "avx512_vnni" in flags.split(),
            "kernel_build": os.environ.get("SPECJAX_KERNEL_ISA") or "native"}
