"""Every rank's own step time and the straggler it names (issue 50, item 3): the watch's rules.
Real agents, one of whose nodes is throttled, are in test_stragglers.py."""

from __future__ import annotations

import time

import pytest
import torch

from training.loop.stragglers import ForwardTimer, Place, Spread, StragglerWatch, spread_slots
from training.loop.replacement import Replacement

# Timed (a deadline: a forward timed across a 0.05 s sleep must read under 0.5 s): make test runs it with the timed
# drills, not at the lowest priority beside them (tests/background.py), where a timed drill keeping both cores busy
# would make it late.
pytestmark = pytest.mark.timed


def test_a_rank_is_named_after_the_windows_in_a_row_over_the_margin_and_once_per_spell():
    watch = StragglerWatch(margin=0.25, windows=2)
    healthy = [1.0, 1.05, 0.98, 1.02]
    assert watch.observe([1.0, 1.0, 1.0, 9.0]) == []  # the round's first report: its warm-up, not judged
    assert watch.observe(healthy) == []
    assert watch.observe([1.0, 1.0, 1.0, 1.4]) == []  # one window over the margin is noise
    assert watch.observe(healthy) == []  # and it starts over
    assert watch.observe([1.0, 1.0, 1.0, 1.4]) == []
    assert watch.observe([1.0, 1.0, 1.0, 1.5]) == [(3, 1.5)]  # the second in a row names it
    assert watch.observe([1.0, 1.0, 1.0, 1.6]) == []  # named once while it stays behind
    assert watch.observe(healthy) == []  # caught up: a later spell is named again
    assert watch.observe([1.0, 1.0, 1.0, 1.3]) == []
    assert watch.observe([1.0, 1.0, 1.0, 1.3]) == [(3, 1.3)]
    assert watch.observe([1.0, 1.0, 1.0, 1.24]) == []  # within the margin


def test_a_new_round_starts_every_rank_afresh():
    watch = StragglerWatch(margin=0.25, windows=2)
    for _ in range(2):
        watch.observe([1.0, 1.0, 2.0])
    watch.reset()  # rank 2 is another process in the new round, warming up again
    assert [watch.observe([1.0, 1.0, 2.0]) for _ in range(3)] == [[], [], [(2, 2.0)]]


def test_the_spread_names_the_slowest_rank_and_where_it_runs():
    places = [Place("job-worker-0", "node-a", "p5.48xlarge"), Place("job-worker-1", "node-b", "p5.48xlarge")]
    spread = Spread.of([0.020, 0.031])
    assert spread.fields(places) == {"rank_step_s": {"min": 0.02, "median": 0.0255, "max": 0.031},
                                     "slowest_rank": 1, "slowest_pod": "job-worker-1", "slowest_node": "node-b"}


def test_each_rank_fills_its_own_slot_of_the_window_all_reduce():
    assert spread_slots(0.5, 2, 4, torch.device("cpu")).tolist() == [0.0, 0.0, 0.5, 0.0]


def test_the_forward_timer_measures_on_cpu_and_starts_a_fresh_window_when_read():
    timer = ForwardTimer(torch.device("cpu"))
    assert timer.measures
    timer.start()
    time.sleep(0.05)
    timer.stop()
    assert 0.05 <= timer.take_s() < 0.5
    assert timer.take_s() == 0.0


def test_replace_takes_the_slowest_named_node_one_at_a_time_and_never_below_the_minimum():
    pods = ["a", "a", "b", "b", "c", "c"]  # two ranks per node
    replacement = Replacement("replace", min_nodes=2)
    assert replacement.consider([], pods, nodes=3) is None
    decision = replacement.consider([(2, 1.6), (5, 2.1)], pods, nodes=3)
    assert (decision.pod, decision.rank, decision.nodes) == ("c", 5, 3)  # the slowest of those named
    assert replacement.take() == decision and replacement.pending is None
    # Under way until the job has its nodes back: no second replacement meanwhile.
    assert replacement.consider([(0, 3.0)], ["a", "a", "b", "b"], nodes=2) is None
    assert replacement.consider([(0, 3.0)], pods, nodes=3).pod == "a"
    replacement.take()
    # A job at its minimum keeps its straggler: named, not replaced.
    low = Replacement("replace", min_nodes=3)
    assert low.consider([(0, 3.0)], pods, nodes=3) is None


def test_report_only_names():
    assert Replacement("report", min_nodes=1).consider([(1, 5.0)], ["a", "b"], nodes=2) is None
