"""Which XLA build each xdist worker compiles with, and which test files only the production-built worker runs."""

from __future__ import annotations

import os

from xdist.scheduler import LoadFileScheduling

PRODUCTION_WORKER = "gw0"
# Files whose claim is about the numerics users get: the real SmolLM2 weights, the int8 / GGUF kernels, and the
# lossless test.  At -O0 the shipped drafter on SmolLM2's int8 kernels is not lossless (test_smollm.py's
# kernel test: the first differing token at 21 of 64; levels 1-3 pass; session 55), so these run only as users'
# programs are built.
PRODUCTION_FILES = ("tests/spec/test_lossless.py", "tests/test_smollm.py", "tests/model/test_quant.py",
                    "tests/model/test_argmax.py", "tests/parallel/test_smollm_tensor_parallel.py")
OPT_FLAG = "--xla_backend_optimization_level"


def configure_worker_flags(environ=os.environ) -> None:
    """Before jax starts its backend: every xdist worker but the production one compiles unoptimized (LLVM -O0, as
    `cargo test` builds debug: the suite is mostly XLA compiling small programs; tests/spec/test_lossless.py took
    274 s at XLA's default level 3 and 192 s at 0 on the AVX2 VM, CPU time 413 -> 246 s).  A single process
    (`-n 0`) and the production worker keep XLA's default, and an opt level the user names in XLA_FLAGS is kept
    everywhere.  Processes a test starts inherit the flags (helpers.cpu_env)."""
    worker = environ.get("PYTEST_XDIST_WORKER")
    flags = environ.get("XLA_FLAGS", "")
    if worker and worker != PRODUCTION_WORKER and OPT_FLAG not in flags:
        environ["XLA_FLAGS"] = f"{flags} {OPT_FLAG}=0".strip()


class ProductionFileScheduling(LoadFileScheduling):
    """--dist loadfile, except that PRODUCTION_FILES go to the production worker (first, while the other worker
    starts on the largest of the rest, then the production worker takes the rest from the smallest end).  If the
    production worker is gone (it crashed or timed out), any worker takes them: a slower build, not a hang."""

    def _production(self, scope: str) -> bool:
        return scope.startswith(PRODUCTION_FILES)

    def _pick(self, node) -> str | None:
        scopes = list(self.workqueue)
        production_alive = any(n.gateway.id == PRODUCTION_WORKER for n in self.nodes)
        if node.gateway.id == PRODUCTION_WORKER or not production_alive:
            return next((s for s in scopes if self._production(s)), scopes[-1] if scopes else None)
        return next((s for s in scopes if not self._production(s)), None)

    def _assign_work_unit(self, node) -> None:
        scope = self._pick(node)
        if scope is None:
            return
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if self._pick(node) is None:  # nothing left that this worker may run
            if self._pending_of(self.assigned_work[node]) == 0:
                node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 2:
            return
        self._assign_work_unit(node)
