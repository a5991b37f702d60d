"""The suite's own rules: which worker compiles unoptimized, which files only the default build runs, and a missing
real-weight checkpoint or reference package skipping here but failing in CI."""

import os
from collections import OrderedDict
from types import SimpleNamespace

import pytest

from tests import helpers
from tests.scheduling import PRODUCTION_FILES, ProductionFileScheduling, configure_worker_flags

PROD = sorted(PRODUCTION_FILES)


def test_only_the_unoptimized_worker_compiles_at_o0_and_children_inherit_it(monkeypatch):
    for worker, flags, want in [
            (None, "", ""),  # one process (-n 0): as users build
            ("gw0", "", ""),
            ("gw2", "", ""),  # a replacement for a crashed worker
            ("gw1", "", "--xla_backend_optimization_level=0"),
            ("gw1", "--xla_force_host_platform_device_count=2",
             "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"),
            ("gw1", "--xla_backend_optimization_level=3", "--xla_backend_optimization_level=3")]:  # the user's
        env = {"XLA_FLAGS": flags} if flags else {}
        if worker:
            env["PYTEST_XDIST_WORKER"] = worker
        configure_worker_flags(env)
        assert env.get("XLA_FLAGS", "") == want, (worker, flags)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0")
    assert helpers.cpu_env(4)["XLA_FLAGS"] == (
        "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=4")
    assert helpers.cpu_env()["XLA_FLAGS"] == os.environ["XLA_FLAGS"]


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
    """The scheduler with both workers' collections registered (each file holds two tests)."""
    sched = ProductionFileScheduling.__new__(ProductionFileScheduling)  # no pytest config: set what it reads
    sched.config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True))
    sched.numnodes, sched.log, sched.collection = len(nodes), lambda *args: None, None
    sched.workqueue = OrderedDict()
    collection = [f"{f}::test_{i}" for f in files for i in range(2)]
    sched.assigned_work = {n: {} for n in nodes}
    sched.registered_collections = {n: collection for n in nodes}
    return sched


def test_production_files_go_to_the_default_build_first_and_the_rest_is_shared():
    other = ["tests/a_test.py", "tests/b_test.py", "tests/c_test.py"]
    gw0, gw1 = FakeNode("gw0"), FakeNode("gw1")
    sched = scheduler([other[0], PROD[0], other[1], PROD[1], other[2]], [gw0, gw1])
    sched.schedule()  # two files each at the start
    assert list(sched.assigned_work[gw0]) == PROD[:2] and list(sched.assigned_work[gw1]) == other[:2]
    sched._assign_work_unit(gw0)  # then the rest, from the end of the queue
    assert list(sched.assigned_work[gw0]) == PROD[:2] + [other[2]] and not sched.workqueue
    assert gw0.sent == [[2, 3], [6, 7], [8, 9]]  # indices of each file's tests in the worker's collection


def test_the_unoptimized_worker_stops_once_only_production_files_are_left():
    gw0, gw1 = FakeNode("gw0"), FakeNode("gw1")
    sched = scheduler(["tests/a_test.py", PROD[0], PROD[1]], [gw0, gw1])
    sched.schedule()
    assert list(sched.assigned_work[gw1]) == ["tests/a_test.py"]  # still running: it finishes it, then stops
    assert list(sched.assigned_work[gw0]) == PROD[:2] and gw1.shutting_down and sched.workqueue == {}


def test_one_production_file_keeps_the_default_build_whatever_order_workers_came_up_in():
    gw0, gw1 = FakeNode("gw0"), FakeNode("gw1")
    sched = scheduler([PROD[0]], [gw1, gw0])
    sched.schedule()
    assert list(sched.assigned_work) == [gw0] and list(sched.assigned_work[gw0]) == [PROD[0]] and gw1.shutting_down


def test_a_replacement_worker_takes_production_files():
    gw2 = FakeNode("gw2")  # a crashed gw0's replacement compiles at the default level
    sched = scheduler([PROD[0]], [gw2])
    sched.workqueue = OrderedDict({PROD[0]: {f"{PROD[0]}::test_0": False}})
    sched._reschedule(gw2)
    assert list(sched.assigned_work[gw2]) == [PROD[0]] and not gw2.shutting_down


def test_a_missing_checkpoint_or_reference_package_skips_but_fails_where_ci_is_set(monkeypatch):
    for value, outcome in [(None, pytest.skip.Exception), ("", pytest.skip.Exception), ("0", pytest.skip.Exception),
                           ("false", pytest.skip.Exception), ("true", pytest.fail.Exception),
                           ("1", pytest.fail.Exception)]:
        if value is None:
            monkeypatch.delenv("CI", raising=False)
        else:
            monkeypatch.setenv("CI", value)
        with pytest.raises(outcome):
            helpers.missing("the default model is not installed")
        with pytest.raises(outcome):
            helpers.import_or_missing("specjax_no_such_module")
    assert helpers.import_or_missing("json").dumps([]) == "[]"


def test_every_production_file_exists():
    """A renamed or moved file would silently leave the default build's list (and land on the -O0 worker)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert [f for f in PROD if not os.path.isfile(os.path.join(root, f))] == []
