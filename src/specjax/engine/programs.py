"""Compiled step programs by shape: built ahead (now, or in order on a background thread) or on demand, and looked
up with a fallback to a larger ready shape so that a request never waits on a compile it does not need.

A step shape is (kind, batch, n, pages, mode): kind "prefill" (n = tokens per row) or "decode" (n = drafts K).
A prefill chunk fits any ready program with batch, tokens and pages at least its own (padding rows and columns
are masked); a decode step needs its exact K but may run with a larger batch or page-table width.  When nothing
ready fits, the exact shape is built: moved to the front of the background queue and waited for if it is queued
there (or `on_demand`), otherwise compiled on the calling thread and counted in `foreground_builds` (a server that
promises no compilation on its engine thread checks that this stays 0).  With `on_demand`, steps that run padded
also queue their exact shape once `demand_after` of them asked for it (a short answer then compiles nothing while
it decodes: tracing holds the GIL and compiling takes a core; a padded prefill soon gets its own shape), so only
the shapes a workload uses get compiled:
each XLA:CPU executable of a
30-layer target holds ~35-75 MB of host memory (measured on SmolLM2-135M), which is what made a server with
every shape compiled hold 9.4 GB.  With `on_demand`, `max_ready` caps the programs kept: after each background
build the least recently used ones beyond it are dropped (and `release` drops the framework's own references to
them), so a server's memory for programs is bounded by the cap, not by the shapes its load ever reached.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, NamedTuple

from specjax.hostmem import release_freed_memory

log = logging.getLogger(__name__)


class StepShape(NamedTuple):
    kind: str  # "prefill" | "decode"
    batch: int
    n: int  # prefill: tokens per row; decode: drafts K
    pages: int  # page-table width
    mode: str  # sampler mode

    def fits(self, need: "StepShape") -> bool:
        """Can a program of this shape run a step that needs `need` (same kind and mode, padded up)?"""
        same_n = self.n >= need.n if self.kind == "prefill" else self.n == need.n
        return (self.kind == need.kind and self.mode == need.mode and same_n and self.batch >= need.batch
                and self.pages >= need.pages)


class StepPrograms:
    """`build(shape) -> callable` compiles one shape; `prefetch` queues shapes for the background thread."""

    def __init__(self, build: Callable[[StepShape], Callable], release: Callable[[], None] | None = None,
                 max_ready: int = 0):
        self._build = build
        self._release = release  # after an eviction: drop the caches that still hold evicted programs
        self.max_ready = max_ready  # with on_demand: most programs kept ready (least recently used go; 0 = all)
        self.evictions = 0
        self.rebuilds = 0  # builds of shapes evicted before (a cap below the load's working set recompiles)
        self._evicted: set[StepShape] = set()
        self.ready: collections.OrderedDict[StepShape, Callable] = collections.OrderedDict()  # least recent first
        self.runs: collections.Counter = collections.Counter()  # lookups that returned each shape
        self.foreground_builds = 0
        self.wait_s = 0.0  # seconds get() spent waiting for a program that nothing ready could stand in for
        self.on_demand = False  # queue the exact shape of steps that had to run padded
        # ... once that many steps of its kind asked for it: a short answer compiles nothing more while it decodes,
        # and a prefill, whose padding multiplies the whole forward (a batch of 1 in a program of 4), soon gets its own
        self.demand_after = {"decode": 8, "prefill": 3}
        self._demand: collections.Counter = collections.Counter()
        self._queue: collections.deque[StepShape] = collections.deque()
        self._building: StepShape | None = None
        self._error: dict[StepShape, BaseException] = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------------------------------------ building
    def build_now(self, shape: StepShape) -> Callable:
        """Compile `shape` on this thread (if not ready) and return it; does not count as a foreground build."""
        with self._cv:
            if shape in self.ready:
                return self.ready[shape]
        t0 = time.perf_counter()
        fn = self._build(shape)
        log.info("compiled step shape %s in %.1f s", shape, time.perf_counter() - t0)
        with self._cv:
            if shape not in self.ready and shape in self._evicted:
                self.rebuilds += 1
                log.warning("step shape %s compiled again after its eviction: the load uses more than "
                            "max_step_programs=%d shapes (raise it to stop recompiling)", shape, self.max_ready)
            self.ready.setdefault(shape, fn)
            self.ready.move_to_end(shape)
            self._cv.notify_all()
            return self.ready[shape]

    def _evict(self, keep: StepShape) -> None:
        """Drop the least recently used programs beyond `max_ready` (on_demand only; never `keep`)."""
        with self._cv:
            over = len(self.ready) - self.max_ready
            if not (self.on_demand and self.max_ready and over > 0):
                return
            victims = [s for s in self.ready if s != keep][:over]
            for s in victims:  # a step running one keeps its reference until it returns
                del self.ready[s]
                self.runs.pop(s, None)
                self._demand.pop(s, None)
            self._evicted.update(victims)
            self.evictions += len(victims)
        log.info("evicted %d step program(s) (cap %d): %s", len(victims), self.max_ready, victims)
        if self._release is not None:
            self._release()

    def prefetch(self, shapes) -> int:
        """Queue shapes (in order, skipping ready or queued ones) for the background thread; returns how many."""
        with self._cv:
            if self._closed:
                raise RuntimeError("programs are closed")
            new = [s for s in dict.fromkeys(shapes) if s not in self.ready and s not in self._queue
                   and s != self._building]
            self._queue.extend(new)
            if new:
                self._start_worker()
            self._cv.notify_all()
            return len(new)

    def _start_worker(self) -> None:  # with self._cv held
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._worker, name="specjax-compile", daemon=True)
            self._thread.start()

    def request(self, shapes) -> None:
        """Count a step's wish for shapes it could have used; queue each once `demand_after` steps wished for it
        (on_demand only; ignored once closed)."""
        if not self.on_demand or self._closed:
            return
        due = []
        for s in shapes:
            if s not in self.ready:
                self._demand[s] += 1
                if self._demand[s] >= self.demand_after[s.kind]:
                    due.append(s)
        if due:
            self.prefetch(due)

    def pending(self) -> int:
        with self._cv:
            return len(self._queue) + (self._building is not None)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the background queue is empty and nothing is being built."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and self._building is None, timeout)

    def close(self) -> None:
        """Drop queued shapes and wait for the one being built (a compile cannot be interrupted)."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _worker(self) -> None:
        while True:
            with self._cv:
                if self._closed or not self._queue:
                    self._building = None
                    self._cv.notify_all()
                    release_freed_memory(collect=False)  # the compiler's temporaries, kept resident otherwise
                    return
                shape = self._building = self._queue.popleft()
            try:
                self.build_now(shape)
                self._evict(keep=shape)
            except BaseException as e:  # surfaced to whoever needs this shape
                log.exception("compiling %s failed", shape)
                with self._cv:
                    self._error[shape] = e
            finally:
                with self._cv:
                    self._building = None
                    self._cv.notify_all()

    # ------------------------------------------------------------------------------------------------ lookup
    def find(self, need: StepShape) -> StepShape | None:
        """The smallest ready shape that fits `need` (exact first), or None."""
        with self._cv:
            if need in self.ready:
                return need
            fits = [s for s in self.ready if s.fits(need)]
        return min(fits, key=lambda s: (s.batch * max(s.n, 1) * s.pages, s)) if fits else None

    def get(self, need: StepShape) -> tuple[StepShape, Callable]:
        """(shape, program) to run a step that needs `need`: a ready fit, else the exact shape once built (on the
        background thread, waited for, when it is queued or `on_demand`; else here)."""
        while True:
            found = self._fit_or_build(need)
            with self._cv:
                if found in self.ready:  # else evicted since it was found (a cap below the working set): again
                    self.runs[found] += 1
                    self.ready.move_to_end(found)
                    return found, self.ready[found]

    def _fit_or_build(self, need: StepShape) -> StepShape:
        found = self.find(need)
        if found is None:
            t0 = time.perf_counter()
            with self._cv:
                if need in self._error:
                    raise self._error.pop(need)
                if self.on_demand and not self._closed and need not in self._queue and need != self._building:
                    self._queue.append(need)
                    self._start_worker()
                if need in self._queue or need == self._building:
                    if need in self._queue:  # jump the queue: a request is waiting for it
                        self._queue.remove(need)
                        self._queue.appendleft(need)
                    self._cv.wait_for(lambda: need in self.ready or need in self._error
                                      or (need not in self._queue and need != self._building))
                    if need in self._error:
                        raise self._error.pop(need)
                    found = need if need in self.ready else None
            if found is None:
                self.foreground_builds += 1
                self.build_now(need)
                found = need
            self.wait_s += time.perf_counter() - t0
        elif found != need:
            self.request([need])
        return found
