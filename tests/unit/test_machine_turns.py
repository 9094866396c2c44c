"""How the drills share the machine under `pytest -n` (tests/machine_turns.py): the real flock locks,
one MachineTurns a worker (each opens the lock files itself, as each xdist worker process does)."""

from __future__ import annotations

import fcntl
import threading
import time

import pytest

from tests.conftest import SuiteScopes
from tests.machine_turns import MachineTurns, is_timed_drill, untimed_first

# Timed (a deadline: real flock locks are waited on for up to 10 s): make test runs it with the timed drills, not
# at the lowest priority beside them (tests/background.py), where a timed drill keeping both cores busy would make
# it late.
pytestmark = pytest.mark.timed

WAIT_S = 10  # how long a step that must happen may take; a step that must not happen is checked after 0.3 s


def until_a_timed_turn_waits(folder) -> None:
    """Returns once a worker holds the turnstile, which a timed turn does while it waits for the machine."""
    deadline = time.monotonic() + WAIT_S
    with open(folder / "turnstile.lock", "a+") as probe:
        while time.monotonic() < deadline:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            fcntl.flock(probe, fcntl.LOCK_UN)
            time.sleep(0.01)
    raise AssertionError(f"no timed turn waited within {WAIT_S} s")


def in_thread(take, record: list[str], name: str) -> threading.Thread:
    def run():
        take()
        record.append(name)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_timed_drill_waits_for_untimed_ones_and_then_has_the_machine_alone(tmp_path):
    first, second, timed = MachineTurns(tmp_path), MachineTurns(tmp_path), MachineTurns(tmp_path)
    first.take_shared()
    second.take_shared()  # two untimed drills side by side
    record: list[str] = []
    waiting = in_thread(timed.take_alone, record, "timed")
    until_a_timed_turn_waits(tmp_path)
    assert record == []
    first.give_back()
    waiting.join(0.3)
    assert record == []  # one untimed drill still runs
    second.give_back()
    waiting.join(WAIT_S)
    assert record == ["timed"]
    untimed = in_thread(second.take_shared, record, "untimed")
    untimed.join(0.3)
    assert record == ["timed"]  # nothing runs beside it
    timed.give_back()
    untimed.join(WAIT_S)
    assert record == ["timed", "untimed"]


def test_an_untimed_drill_that_comes_after_a_waiting_timed_one_goes_after_it(tmp_path):
    running, later, timed = MachineTurns(tmp_path), MachineTurns(tmp_path), MachineTurns(tmp_path)
    running.take_shared()
    record: list[str] = []
    waiting_timed = in_thread(timed.take_alone, record, "timed")
    until_a_timed_turn_waits(tmp_path)
    waiting_untimed = in_thread(later.take_shared, record, "untimed")  # would pass a plain shared lock at once
    waiting_untimed.join(0.3)
    assert record == []
    running.give_back()
    waiting_timed.join(WAIT_S)
    assert record == ["timed"]
    timed.give_back()
    waiting_untimed.join(WAIT_S)
    assert record == ["timed", "untimed"]


class FakeModule:
    def __init__(self, untimed: bool):
        self.untimed = untimed

    def get_closest_marker(self, name):
        return name if name == "untimed" and self.untimed else None


class FakeItem:
    """What the plugin reads of a pytest item: its node id, the `slow` mark tests/conftest.py puts on every
    drill, and its module's marks."""

    def __init__(self, nodeid: str, untimed_module: bool = False, *own_marks: str):
        self.nodeid, self.own_marks = nodeid, set(own_marks)
        self.module = FakeModule(untimed_module)
        if nodeid.startswith("tests/drills/"):
            self.own_marks.add("slow")

    def get_closest_marker(self, name):
        if name in self.own_marks:
            return name
        return self.module.get_closest_marker(name)

    def getparent(self, cls):
        assert cls is pytest.Module
        return self.module


def test_untimed_drills_come_first_and_each_group_keeps_its_order():
    items = [FakeItem("tests/unit/test_a.py::t"), FakeItem("tests/drills/test_b.py::t"),
             FakeItem("tests/drills/test_c.py::t", True), FakeItem("tests/drills/test_d.py::t"),
             FakeItem("tests/drills/test_e.py::t", True)]
    untimed_first(items)
    assert [item.nodeid.split("/")[-1] for item in items] == [
        "test_a.py::t", "test_c.py::t", "test_e.py::t", "test_b.py::t", "test_d.py::t"]


def held(folder) -> str:
    """What a worker's machine lock is held as, seen from a probe that must not wait."""
    with open(folder / "machine.lock", "a+") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "alone"
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "shared"
        return "free"


def run_test(turns: MachineTurns, item, nextitem, folder, fail: bool = False) -> str:
    """Runs the plugin's wrapper around one test as pytest does; returns how the machine was held during it."""
    protocol = turns.pytest_runtest_protocol(item, nextitem)
    next(protocol)
    during = held(folder)
    if fail:  # pytest hands the wrapper the error, which goes on through it
        with pytest.raises(RuntimeError, match="the test failed"):
            protocol.throw(RuntimeError("the test failed"))
    else:
        with pytest.raises(StopIteration):
            protocol.send(None)
    return during


def test_a_timed_module_holds_the_machine_alone_from_its_first_test_to_its_last(tmp_path):
    turns = MachineTurns(tmp_path)
    first, second, last = (FakeItem(f"tests/drills/test_lost_node.py::test_{n}") for n in "abc")
    after = FakeItem("tests/drills/test_models.py::test_x", True)
    assert run_test(turns, first, second, tmp_path) == "alone"
    assert held(tmp_path) == "alone"  # between tests of the module: its module fixtures still run agents
    assert run_test(turns, second, last, tmp_path) == "alone"
    assert run_test(turns, last, after, tmp_path) == "alone"
    assert held(tmp_path) == "free"
    assert run_test(turns, after, None, tmp_path) == "shared"
    assert held(tmp_path) == "free"


def test_the_last_test_of_the_run_and_a_failed_test_give_the_machine_back(tmp_path):
    turns = MachineTurns(tmp_path)
    timed = FakeItem("tests/drills/test_lost_node.py::test_a")
    assert run_test(turns, timed, None, tmp_path, fail=True) == "alone"
    assert held(tmp_path) == "free"


def test_untimed_drills_and_unit_tests_take_a_shared_turn_each(tmp_path):
    turns = MachineTurns(tmp_path)
    unit = FakeItem("tests/unit/test_catalog.py::test_x")
    untimed, untimed_next = (FakeItem(f"tests/drills/test_models.py::test_{n}", True) for n in "ab")
    assert run_test(turns, unit, untimed, tmp_path) == "shared"
    assert held(tmp_path) == "free"
    assert run_test(turns, untimed, untimed_next, tmp_path) == "shared"
    assert held(tmp_path) == "free"  # released between the tests of an untimed module: a timed one may go first


def test_a_test_marked_untimed_inside_a_timed_module_stays_in_the_modules_turn(tmp_path):
    """The module's mark decides: a shared turn asked for while holding the machine alone would wait behind the
    other worker's turnstile, which waits for this worker's machine."""
    turns = MachineTurns(tmp_path)
    timed = FakeItem("tests/drills/test_lost_node.py::test_a")
    marked = FakeItem("tests/drills/test_lost_node.py::test_b", False, "untimed")
    assert is_timed_drill(marked)  # a test's own mark is not read
    assert run_test(turns, timed, marked, tmp_path) == "alone"
    assert run_test(turns, marked, None, tmp_path) == "alone"
    assert held(tmp_path) == "free"


@pytest.mark.parametrize(("nodeid", "scope"), [
    ("tests/unit/cdk/test_cluster_stack.py::test_x", "tests/unit/cdk/"),
    ("tests/drills/test_lost_node.py::test_x[a]", "tests/drills/test_lost_node.py"),
    ("tests/drills/test_cfn_lint.py::test_x[a]", "tests/unit/cdk/"),  # it reads the CDK unit's syntheses
    ("tests/unit/test_catalog.py::test_x", "tests/unit/test_catalog.py::test_x"),
])
def test_xdist_scopes_a_drill_by_module_and_a_unit_test_alone(nodeid, scope):
    assert SuiteScopes._split_scope(None, nodeid) == scope
