"""The suite's own scheduling: which worker compiles unoptimized, and which files only the production build runs."""

from types import SimpleNamespace

from tests.scheduling import PRODUCTION_FILES, ProductionFileScheduling, configure_worker_flags


def test_only_workers_other_than_the_production_one_compile_unoptimized():
    for worker, flags, want in [
            (None, "", ""),  # one process (-n 0): as users build
            ("gw0", "", ""),
            ("gw1", "", "--xla_backend_optimization_level=0"),
            ("gw1", "--xla_force_host_platform_device_count=2",
             "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"),
            ("gw1", "--xla_backend_optimization_level=3", "--xla_backend_optimization_level=3")]:  # the user's
        env = {"XLA_FLAGS": flags} if flags else {}
        if worker:
            env["PYTEST_XDIST_WORKER"] = worker
        configure_worker_flags(env)
        assert env.get("XLA_FLAGS", "") == want, (worker, flags)


class FakeNode:
    def __init__(self, name):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent = []

    def send_runtest_some(self, indices):
        self.sent.append(indices)

    def shutdown(self):
        self.shutting_down = True


def scheduler(files, nodes):
    sched = ProductionFileScheduling.__new__(ProductionFileScheduling)  # no pytest config needed for the queue
    collection = [f"{f}::test_{i}" for f in files for i in range(2)]
    sched.workqueue = {f: {f"{f}::test_{i}": False for i in range(2)} for f in files}
    sched.assigned_work = {n: {} for n in nodes}
    sched.registered_collections = {n: collection for n in nodes}
    return sched


def test_production_files_go_to_the_production_worker_and_the_rest_is_shared():
    prod = list(PRODUCTION_FILES[:2])
    other = ["tests/a_test.py", "tests/b_test.py", "tests/c_test.py"]
    gw0, gw1 = FakeNode("gw0"), FakeNode("gw1")
    sched = scheduler([other[0], prod[0], other[1], prod[1], other[2]], [gw0, gw1])
    sched._assign_work_unit(gw1)
    sched._assign_work_unit(gw0)
    assert list(sched.assigned_work[gw1]) == [other[0]] and list(sched.assigned_work[gw0]) == [prod[0]]
    sched._assign_work_unit(gw0)  # the second production file before anything else
    sched._assign_work_unit(gw1)
    assert list(sched.assigned_work[gw0]) == prod and list(sched.assigned_work[gw1]) == other[:2]
    sched._assign_work_unit(gw0)  # then the rest, from the end of the queue
    assert list(sched.assigned_work[gw0]) == prod + [other[2]] and not sched.workqueue
    assert gw0.sent == [[2, 3], [6, 7], [8, 9]]  # indices of each file's tests in the worker's collection


def test_the_other_worker_stops_when_only_production_files_are_left():
    gw0, gw1 = FakeNode("gw0"), FakeNode("gw1")
    sched = scheduler([PRODUCTION_FILES[0]], [gw0, gw1])
    sched._reschedule(gw1)
    assert gw1.shutting_down and not sched.assigned_work[gw1] and sched.workqueue


def test_without_the_production_worker_any_worker_takes_production_files():
    gw2 = FakeNode("gw2")  # a replacement for a crashed gw0
    sched = scheduler([PRODUCTION_FILES[0]], [gw2])
    sched._reschedule(gw2)
    assert list(sched.assigned_work[gw2]) == [PRODUCTION_FILES[0]] and not gw2.shutting_down
