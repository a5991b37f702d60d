"""Compiled step programs kept on disk and loaded without tracing: a process that starts again skips jax's tracing
and lowering (0.3-0.5 s a SmolLM2 step program, GIL-bound) that even a persistent-compile-cache hit pays first.

An entry is keyed by everything that decides the program: the source of the specjax package (.py and the kernels'
.cc / .h, hashed once per process), the jax / jaxlib build, the backend, the CPU, XLA_FLAGS and the jax settings that
change lowering, the function's name, its static arguments (frozen dataclasses: their repr is their value) and the
input signature (tree structure, with its static fields, shapes, dtypes, shardings).  Any change gives another key,
so a stale entry can never load; entries that are no longer reached age out (least recently used beyond
`max_bytes`).  Loading runs pickled code from the directory (as jax's own cache does): keep it private to the user.
One device only (the executables name their devices).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import platform
import threading
import time
from typing import Callable

import jax

log = logging.getLogger(__name__)

_LOWERING_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                      "jax_threefry_partitionable")


def jax_cache_on() -> bool:
    """Is jax's persistent compilation cache on?  Then a compile may return its copy of a program, and an XLA:CPU
    executable loaded from a serialized one keeps no object code: serialized again, it saves a program that fails
    when run ("Function ... not found").  So a store saves only where that cache is off (cli/common.py picks one)."""
    return bool(jax.config.jax_compilation_cache_dir) and bool(jax.config.jax_enable_compilation_cache)


def package_fingerprint() -> str:
    """sha256 over the specjax package's sources (every .py, .cc and .h under it, by relative path)."""
    import specjax

    root = os.path.dirname(os.path.abspath(specjax.__file__))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and d != "assets")
        for name in sorted(filenames):
            if name.endswith((".py", ".cc", ".h")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as fh:
                    h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def machine_fingerprint() -> str:
    """The jax build, backend, devices, CPU and settings that change what a program compiles to."""
    import jaxlib

    dev = jax.devices()[0]
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu += next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        cpu += platform.processor()
    settings = {k: getattr(jax.config, k, None) for k in _LOWERING_SETTINGS}
    return repr((jax.__version__, jaxlib.__version__, dev.platform, dev.client.platform_version, dev.device_kind,
                 len(jax.devices()), cpu, os.environ.get("XLA_FLAGS", ""), sorted(settings.items())))


def signature(args) -> str:
    """Tree structure (static fields included) and every leaf's shape, dtype and sharding."""
    leaves, tree = jax.tree.flatten(args)
    return repr((str(tree), [(tuple(x.shape), str(x.dtype), repr(getattr(x, "sharding", None))) for x in leaves]))


class ProgramStore:
    """`get(name, static, args, compile)`: the compiled program from `root`, else `compile()` and saved there."""

    def __init__(self, root: str, max_bytes: int = 2 << 30, code: str | None = None):
        self.root = root
        self.max_bytes = max_bytes
        self._code = code  # the package fingerprint (tests pass their own)
        self._machine: str | None = None
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.errors = 0
        self._warned = False

    def key(self, name: str, static, args) -> str:
        with self._lock:
            if self._code is None:
                self._code = package_fingerprint()
            if self._machine is None:
                self._machine = machine_fingerprint()
        text = repr((self._code, self._machine, name, repr(static), signature(args)))
        return f"{name}-{hashlib.sha256(text.encode()).hexdigest()}"

    def get(self, name: str, static, args, compile: Callable[[], jax.stages.Compiled]):
        """The program `compile()` builds for `args` (a pytree of ShapeDtypeStructs) and `static`, loaded from the
        store when it holds one."""
        from jax.experimental import serialize_executable

        key = self.key(name, static, args)
        path = os.path.join(self.root, key)
        if os.path.isfile(path):
            try:
                with open(path, "rb") as fh:
                    payload, in_tree, out_tree = pickle.load(fh)
                device = next(iter(jax.tree.leaves(args)[0].sharding.device_set))
                program = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                    execution_devices=[device])
                self.hits += 1
            except Exception as e:  # a torn or foreign file: compile instead, and replace it
                self.errors += 1
                log.warning("program store entry %s did not load (%s: %s); compiling", path, type(e).__name__, e)
            else:
                try:
                    os.utime(path)  # recently used: the last to age out
                except OSError:  # aged out by another process meanwhile: the program is loaded all the same
                    pass
                return program
        program = compile()
        self.misses += 1
        if jax_cache_on():  # the program may be jax's cache copy, which would save broken: keep it unsaved
            if not self._warned:
                self._warned = True
                log.warning("jax's persistent compilation cache is on in this process: step programs are not saved "
                            "to %s (turn one of the two off)", self.root)
        else:
            self._save(path, program)
        return program

    def _save(self, path: str, program) -> None:
        from jax.experimental import serialize_executable

        try:
            blob = pickle.dumps(serialize_executable.serialize(program), protocol=pickle.HIGHEST_PROTOCOL)
            os.makedirs(self.root, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(blob)
            os.replace(tmp, path)  # readers see a whole entry or none
            self._age_out()
        except Exception as e:  # a read-only or full disk costs the next start its tracing, nothing else
            self.errors += 1
            log.warning("could not save a compiled program to %s (%s: %s)", self.root, type(e).__name__, e)

    def _age_out(self) -> None:
        """Remove the least recently used entries beyond max_bytes (and temporary files over an hour old)."""
        entries = []
        now = time.time()
        for entry in os.scandir(self.root):
            st = entry.stat()
            if entry.name.endswith(".tmp"):
                if now - st.st_mtime > 3600:
                    os.remove(entry.path)
                continue
            entries.append((st.st_mtime, st.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            total -= size
