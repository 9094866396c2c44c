"""How the drills share the machine under `pytest -n` (tests/machine_turns.py): the real flock locks,
one MachineTurns a worker (each opens the lock files itself, as each xdist worker process does)."""

from __future__ import annotations

import threading

import pytest

from tests.conftest import SuiteScopes
from tests.machine_turns import MachineTurns, untimed_first

WAIT_S = 10  # how long a step that must happen may take; a step that must not happen is checked after 0.3 s


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
    waiting.join(0.3)
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
    waiting_timed.join(0.3)
    waiting_untimed = in_thread(later.take_shared, record, "untimed")  # would pass a plain shared lock at once
    waiting_untimed.join(0.3)
    assert record == []
    running.give_back()
    waiting_timed.join(WAIT_S)
    assert record == ["timed"]
    timed.give_back()
    waiting_untimed.join(WAIT_S)
    assert record == ["timed", "untimed"]


class FakeItem:
    def __init__(self, nodeid: str, *marks: str):
        self.nodeid, self.marks = nodeid, set(marks)

    def get_closest_marker(self, name):
        return name if name in self.marks else None


def test_untimed_drills_come_first_and_each_group_keeps_its_order():
    items = [FakeItem("tests/unit/test_a.py::t"), FakeItem("tests/drills/test_b.py::t", "slow"),
             FakeItem("tests/drills/test_c.py::t", "slow", "untimed"), FakeItem("tests/drills/test_d.py::t", "slow"),
             FakeItem("tests/drills/test_e.py::t", "slow", "untimed")]
    untimed_first(items)
    assert [item.nodeid.split("/")[-1] for item in items] == [
        "test_a.py::t", "test_c.py::t", "test_e.py::t", "test_b.py::t", "test_d.py::t"]


@pytest.mark.parametrize(("nodeid", "scope"), [
    ("tests/unit/cdk/test_cluster_stack.py::test_x", "tests/unit/cdk/"),
    ("tests/drills/test_lost_node.py::test_x[a]", "tests/drills/test_lost_node.py"),
    ("tests/unit/test_catalog.py::test_x", "tests/unit/test_catalog.py::test_x"),
])
def test_xdist_scopes_a_drill_by_module_and_a_unit_test_alone(nodeid, scope):
    assert SuiteScopes._split_scope(None, nodeid) == scope
