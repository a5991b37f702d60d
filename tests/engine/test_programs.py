"""Step programs: background queue order, waiting for a queued shape, fallback to larger ready shapes, errors,
the least-recently-used cap."""

import threading
import time

import pytest

from specjax.engine.programs import StepPrograms, StepShape


def shape(kind="decode", b=1, n=0, pg=4, mode="greedy"):
    return StepShape(kind, b, n, pg, mode)


class SlowBuild:
    def __init__(self, seconds=0.05, fail=()):
        self.seconds, self.fail, self.order, self.threads = seconds, set(fail), [], []

    def __call__(self, s):
        time.sleep(self.seconds)
        self.order.append(s)
        self.threads.append(threading.current_thread().name)
        if s in self.fail:
            raise RuntimeError(f"cannot build {s}")
        return lambda: s


def test_fits_pads_up_batch_pages_and_prefill_tokens_but_never_changes_k_or_mode():
    big = shape(b=8, n=3, pg=16)
    assert big.fits(shape(b=2, n=3, pg=4)) and not big.fits(shape(b=2, n=1, pg=4))
    assert not big.fits(shape(b=16, n=3)) and not big.fits(shape(n=3, pg=32))
    assert not big.fits(shape(b=2, n=3, mode="sample"))
    assert shape("prefill", 2, 64, 16).fits(shape("prefill", 1, 16, 8))
    assert not shape("prefill", 2, 64, 16).fits(shape("decode", 1, 16, 8))


def test_background_builds_in_order_and_lookups_prefer_the_smallest_fit():
    build = SlowBuild()
    progs = StepPrograms(build)
    big = shape(b=8, pg=16)
    progs.build_now(big)
    queued = [shape(b=1, pg=4), shape(b=1, pg=8), shape(b=2, pg=4)]
    assert progs.prefetch(queued + [big]) == 3
    assert progs.get(shape(b=1, pg=4))[0] in (big, shape(b=1, pg=4))  # a fit is used at once, never waited for
    assert progs.wait_s == 0
    assert progs.wait_idle(5)
    assert build.order == [big] + queued and set(build.threads[1:]) == {"specjax-compile"}
    assert progs.get(shape(b=1, pg=2))[0] == shape(b=1, pg=4)
    assert progs.get(shape(b=2, pg=8))[0] == big
    assert progs.foreground_builds == 0


def test_a_step_waits_for_its_queued_shape_which_jumps_the_queue():
    build = SlowBuild(0.2)
    progs = StepPrograms(build)
    queued = [shape(n=k) for k in range(5)]
    progs.prefetch(queued)
    got, fn = progs.get(shape(n=4))  # nothing fits K = 4: wait for it rather than compile here
    assert got == shape(n=4) and fn() == shape(n=4)
    assert 0.1 < progs.wait_s < 5  # the step's wait is counted (a generation's tok/s is reported without it)
    assert build.order.index(shape(n=4)) <= 1 and progs.foreground_builds == 0
    progs.close()
    assert progs.pending() == 0 and len(build.order) < 5


def test_unqueued_shapes_compile_on_the_calling_thread_and_are_counted():
    build = SlowBuild(0)
    progs = StepPrograms(build)
    got, _ = progs.get(shape(n=2))
    assert got == shape(n=2) and progs.foreground_builds == 1 and build.threads == [threading.current_thread().name]
    assert progs.runs[shape(n=2)] == 1


def test_a_failed_background_build_reaches_the_step_that_needs_it():
    bad = shape(n=3)
    progs = StepPrograms(SlowBuild(0.01, fail=[bad]))
    progs.prefetch([bad])
    with pytest.raises(RuntimeError, match="cannot build"):
        progs.get(bad)
    progs.close()
    with pytest.raises(RuntimeError, match="closed"):
        progs.prefetch([shape()])


def test_on_demand_a_padded_step_queues_its_shape_and_an_unfit_step_waits_for_the_background_thread():
    build = SlowBuild(0.05)
    progs = StepPrograms(build)
    progs.on_demand, progs.demand_after = True, {"decode": 3, "prefill": 3}
    progs.build_now(shape(b=1, pg=16))
    for _ in range(2):
        assert progs.get(shape(b=1, pg=4))[0] == shape(b=1, pg=16)  # runs padded
    assert progs.pending() == 0  # two steps wished for pg 4: not worth a compile yet
    assert progs.get(shape(b=1, pg=4))[0] == shape(b=1, pg=16)  # the third queues it
    assert progs.get(shape(b=4, pg=4))[0] == shape(b=4, pg=4)  # nothing fits a batch of 4: built over there
    assert progs.wait_idle(5) and shape(b=1, pg=4) in progs.ready
    assert progs.foreground_builds == 0 and set(build.threads[1:]) == {"specjax-compile"}
    progs.close()
    progs.request([shape(n=7)])  # ignored once closed
    assert progs.pending() == 0


def test_on_demand_the_cap_frees_the_least_recently_used_program_and_counts_rebuilds():
    build, released = SlowBuild(0.01), []
    progs = StepPrograms(build, release=lambda: released.append(len(progs.ready)), max_ready=2)
    progs.on_demand = True
    a, b, c = shape(n=1), shape(n=2), shape(n=3)
    progs.build_now(a)
    held = progs.get(a)[1]  # a step that is running a's program
    assert progs.get(b)[0] == b  # built in the background (nothing fits K = 2): two ready, at the cap
    assert progs.evictions == 0 and released == []
    progs.get(a)  # a is used again: b is now the least recently used
    assert progs.get(c)[0] == c and progs.wait_idle(5)
    assert set(progs.ready) == {a, c} and progs.evictions == 1 and released == [2]
    assert b not in progs.runs and held() == a  # the running step's program is still whole
    assert progs.rebuilds == 0
    assert progs.get(b)[0] == b and progs.wait_idle(5)  # needed again: rebuilt, counted, a (LRU) goes
    assert set(progs.ready) == {b, c} and progs.rebuilds == 1 and progs.evictions == 2
    assert progs.foreground_builds == 0
    progs.close()


def test_the_cap_applies_only_to_on_demand_compilation():
    """Ahead-of-time warm-up (every shape before serving) keeps all it builds, whatever the cap."""
    progs = StepPrograms(SlowBuild(0), max_ready=1)
    progs.prefetch([shape(n=k) for k in range(4)])
    assert progs.wait_idle(5) and len(progs.ready) == 4 and progs.evictions == 0
    progs.close()
