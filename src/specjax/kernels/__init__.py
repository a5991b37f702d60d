"""specjax's native CPU kernels: compiled from kernels/*.cc on first use, cached on disk, registered with XLA.

A kernel library is built once per (source, compiler, jaxlib, CPU flags) into `$SPECJAX_KERNEL_CACHE` (default
~/.cache/specjax/kernels) and loaded with ctypes; its XLA FFI handlers are registered under names that carry the
build key, so a changed kernel never matches a stale entry of the persistent compilation cache.  Where a kernel
cannot run (no C++ compiler, neither AVX-512F nor AVX2 + FMA, a non-CPU backend, `SPECJAX_KERNELS=0`)
`quant_kernels()` returns None with the reason logged once, and callers keep the plain XLA path.  The kernels are
written once over the vector operations of kernels/simd.h; `-march=native` picks its AVX-512 or AVX2 half.  On an
AVX-512 CPU `quant_kernels("AVX2")` (or `SPECJAX_KERNEL_ISA=AVX2` for the process's default) builds the AVX2 half
too (`-mno-avx512f`), so that one machine runs and tests both builds; the two register under different names and
can be loaded side by side.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources

log = logging.getLogger(__name__)

QUANT_SOURCE = "quant_matmul.cc"
QUANT_HANDLERS = {"Q4_0": "SpecjaxQ4_0", "Q4_1": "SpecjaxQ4_1", "Q8_0": "SpecjaxQ8_0", "BF16": "SpecjaxBF16",
                  "Q4_0_I8": "SpecjaxQ4_0I8", "Q4_1_I8": "SpecjaxQ4_1I8", "Q8_0_I8": "SpecjaxQ8_0I8",
                  "Q4_0_I16": "SpecjaxQ4_0I16", "Q4_1_I16": "SpecjaxQ4_1I16", "Q8_0_I16": "SpecjaxQ8_0I16"}
# How a GGUF block kernel takes its activations, the default first: quantized per block of 32 to 16-bit integers
# (the model's answers at integer speed), to int8 (llama.cpp's scheme: a little faster, and it flips near-ties of a
# small model), or as float32 (the dequantized weights' float32 product to rounding).
ACTIVATIONS = ("int16", "int8", "float32")
# The integer activation types and the suffix of their handlers' keys.
INTEGER_ACTIVATIONS = {"int16": "_I16", "int8": "_I8"}


def handler_key(kind: str, activations: str) -> str:
    """QUANT_HANDLERS' key of block format `kind` with `activations` (BF16 has float32 ones only)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {activations!r}")
    key = kind + INTEGER_ACTIVATIONS.get(activations, "")
    return key if key in QUANT_HANDLERS else kind
ATTENTION_SOURCE = "paged_attention.cc"
ATTENTION_HANDLER = "SpecjaxPagedAttention"
KV_WRITE_SOURCE = "kv_write.cc"
KV_WRITE_HANDLER = "SpecjaxWriteRows"
ARGMAX_SOURCE = "argmax.cc"
ARGMAX_HANDLER = "SpecjaxArgmax"
CXX_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")


class KernelUnavailable(RuntimeError):
    """The kernels cannot be built or run here (the message says why)."""


@dataclass(frozen=True)
class QuantKernels:
    """Registered FFI targets (CPU platform): one per block format (GGUF Q4_0, Q4_1, Q8_0, and BF16) and
    activation type (the GGUF formats' integer variants are keyed "<kind>_I16" and "<kind>_I8") for
    model/quant.py, `attention`, paged attention over the KV pool in place, `kv_write`, a step's K/V rows written
    into every pool in one call (model/attention.py), and `argmax`, the greedy tokens of a head's vocab-major
    logits (model/target.py)."""

    targets: dict[str, str]
    attention: str
    kv_write: str
    argmax: str

    def block_targets(self, activations: str) -> dict[str, str]:
        """Block format -> FFI target for activations "int16", "int8" or "float32" (ACTIVATIONS)."""
        return {kind: self.targets[handler_key(kind, activations)] for kind in self.targets
                if not kind.endswith(tuple(INTEGER_ACTIVATIONS.values()))}


def cache_dir() -> str:
    return os.environ.get("SPECJAX_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specjax",
                                                                   "kernels")


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    """The CPU's model name and family (/proc/cpuinfo), e.g. "AMD EPYC (family 26, model 2)"."""
    info = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
                if key.strip() == "flags":
                    break
    except OSError:
        return "unknown"
    family, model = info.get("cpu family", "?"), info.get("model", "?")
    return f"{info.get('model name', 'unknown')} (family {family}, model {model})"


def simd_isa(flags: str) -> str | None:
    """The vector instruction set the kernels build for on a CPU with these /proc/cpuinfo flags, or None."""
    names = set(flags.split())
    if "f16c" not in names:  # the GGUF scales stay float16 (every AVX2 or AVX-512 CPU has it)
        return None
    if "avx512f" in names:
        return "AVX-512F"
    if {"avx2", "fma"} <= names:
        return "AVX2"
    return None


def isa_flags(isa: str | None, flags: str) -> tuple[str, ...]:
    """Compiler flags beyond CXX_FLAGS for kernel build `isa` (None / "native": what -march=native gives, "AVX2":
    the AVX2 + FMA half on any CPU that has it) on a CPU with these /proc/cpuinfo flags.  Raises KernelUnavailable
    when this CPU cannot run that build."""
    native = simd_isa(flags)
    if native is None:
        raise KernelUnavailable("this CPU has neither AVX-512F nor AVX2 + FMA")
    choice = (isa or "native").lower()
    if choice in ("native", native.lower()):
        return ()
    if choice == "avx2" and {"avx2", "fma"} <= set(flags.split()):
        return ("-mno-avx512f",)
    raise KernelUnavailable(f"kernel build {isa!r} cannot run here (choose from native, AVX2; this CPU: {native})")


def build(source: str, include_dir: str, out_dir: str, compiler: str, extra_key: str = "",
          extra_flags: tuple[str, ...] = ()) -> str:
    """Compile `source` into out_dir (atomically; concurrent builders race harmlessly) unless a library with the
    same key is already there.  The key covers the source and the headers beside it (simd.h).  -> the library's
    path.  Raises KernelUnavailable with the compiler's output."""
    here = os.path.dirname(source)
    code = b""
    for name in [os.path.basename(source)] + sorted(f for f in os.listdir(here) if f.endswith(".h")):
        with open(os.path.join(here, name), "rb") as fh:
            code += name.encode() + b"\0" + fh.read()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([code, version.encode(), " ".join(CXX_FLAGS + extra_flags).encode(),
                                     extra_key.encode()])).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(source))[0]
    path = os.path.join(out_dir, f"{stem}-{key}.so")
    if os.path.isfile(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *CXX_FLAGS, *extra_flags, f"-I{include_dir}", source, "-o", tmp],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed on {os.path.basename(source)}: "
                                    f"{(done.stderr or done.stdout).strip()[-600:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def _load_quant_kernels(isa: str | None = None) -> QuantKernels:
    import jax

    if os.environ.get("SPECJAX_KERNELS", "1") == "0":
        raise KernelUnavailable("disabled by SPECJAX_KERNELS=0")
    if jax.default_backend() != "cpu":
        raise KernelUnavailable(f"the kernels are for the CPU backend, not {jax.default_backend()}")
    flags = cpu_flags()
    extra_flags = isa_flags(isa or os.environ.get("SPECJAX_KERNEL_ISA"), flags)
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise KernelUnavailable("no C++ compiler found (set CXX or install g++)")
    def register(source_name: str, symbols: dict[str, str]) -> dict[str, str]:
        with resources.as_file(resources.files(__package__) / source_name) as source:
            path = build(str(source), jax.ffi.include_dir(), cache_dir(), compiler, jax.__version__ + flags,
                         extra_flags)
        lib = ctypes.CDLL(path)
        tag = os.path.basename(path).rsplit("-", 1)[1][:-3]
        names = {}
        for key, symbol in symbols.items():
            names[key] = f"specjax_{key.lower()}_{tag}"
            jax.ffi.register_ffi_target(names[key], jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        return names

    return QuantKernels(register(QUANT_SOURCE, QUANT_HANDLERS),
                        register(ATTENTION_SOURCE, {"paged_attention": ATTENTION_HANDLER})["paged_attention"],
                        register(KV_WRITE_SOURCE, {"kv_write": KV_WRITE_HANDLER})["kv_write"],
                        register(ARGMAX_SOURCE, {"argmax": ARGMAX_HANDLER})["argmax"])


@functools.lru_cache(maxsize=None)
def quant_kernels(isa: str | None = None) -> QuantKernels | None:
    """The block-quantized matmul kernels of kernels/quant_matmul.cc and the paged attention of
    kernels/paged_attention.cc, built and registered once per process and `isa` (see isa_flags; None: the
    SPECJAX_KERNEL_ISA variable, else native), or None where they cannot run here (the reason is logged)."""
    try:
        return _load_quant_kernels(isa)
    except (KernelUnavailable, OSError, subprocess.SubprocessError) as e:
        log.warning("quantized CPU kernels unavailable, using float32 XLA matmuls: %s", e)
        return None
