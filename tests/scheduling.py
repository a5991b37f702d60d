"""Which XLA build each xdist worker compiles with, and the test files the unoptimized worker never runs."""

from __future__ import annotations

import os

from xdist.scheduler import LoadFileScheduling

UNOPTIMIZED_WORKER = "gw1"
# Files whose claim is about the numerics users get: the real SmolLM2 weights, the integer / GGUF kernels, and every
# lossless check (speculative output equals plain decoding: the lossless file, EAGLE-3, adaptive K, the drafter
# extensions, the server's concurrent streams equal to each alone, tensor parallelism's equal tokens).  They run only
# as users' programs are built: a row dependence that only an optimizing build brings would pass at -O0, and at -O0
# DFlash on SmolLM2's int8 kernels once parted from plain decoding (a K/V row rounded twice to float16, fixed in
# 7b098e3, 2026-12-07; docs/architecture.md).
PRODUCTION_FILES = frozenset({
    "tests/spec/test_lossless.py", "tests/spec/test_check_lossless.py", "tests/test_smollm.py",
    "tests/model/test_quant.py", "tests/model/test_quant_models.py", "tests/model/test_argmax.py",
    "tests/parallel/test_smollm_tensor_parallel.py", "tests/parallel/test_tensor_parallel.py",
    "tests/drafter/test_eagle3.py", "tests/drafter/test_extensions.py", "tests/engine/test_adaptive.py",
    "tests/serve/test_server.py"})
OPT_FLAG = "--xla_backend_optimization_level"


def configure_worker_flags(environ=os.environ) -> None:
    """Before jax starts its backend: xdist worker gw1 compiles unoptimized (LLVM -O0, as `cargo test` builds debug:
    the suite is mostly XLA compiling small programs; tests/spec/test_lossless.py took 274 s at XLA's default level
    3 and 192 s at 0 on the AVX2 VM, CPU time 413 -> 246 s).  Every other process (gw0, a replacement for a crashed
    worker, `-n 0`) keeps XLA's default, and an opt level the user names in XLA_FLAGS is kept everywhere.  Processes
    a test starts inherit the flags (helpers.cpu_env)."""
    flags = environ.get("XLA_FLAGS", "")
    if environ.get("PYTEST_XDIST_WORKER") == UNOPTIMIZED_WORKER and OPT_FLAG not in flags:
        environ["XLA_FLAGS"] = f"{flags} {OPT_FLAG}=0".strip()


class ProductionFileScheduling(LoadFileScheduling):
    """--dist loadfile, except that the unoptimized worker never gets PRODUCTION_FILES: the others take those first,
    then the rest from the end of the queue (with xdist's default --loadscope-reorder, the files with fewest tests),
    while the unoptimized worker starts from the front."""

    def _pick(self, node) -> str | None:
        scopes = list(self.workqueue)
        if node.gateway.id != UNOPTIMIZED_WORKER:
            return next((s for s in scopes if s in PRODUCTION_FILES), scopes[-1] if scopes else None)
        return next((s for s in scopes if s not in PRODUCTION_FILES), None)

    def schedule(self) -> None:
        if self.collection is None:  # the first call: xdist drops workers from the end when files are fewer
            self.assigned_work = dict(sorted(self.assigned_work.items(),
                                             key=lambda item: item[0].gateway.id == UNOPTIMIZED_WORKER))
        super().schedule()

    def _assign_work_unit(self, node) -> None:
        scope = self._pick(node)
        if scope is not None:  # xdist's own assignment pops the queue's first unit: put the pick there
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    def _reschedule(self, node) -> None:
        if not node.shutting_down and self._pick(node) is None:
            node.shutdown()  # nothing left this worker may run: it finishes its queue, then stops
            return
        super()._reschedule(node)
