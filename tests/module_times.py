"""A pytest plugin: the suite's time by module, printed after --durations (issue 51, item 5).

--durations names the slowest tests; a module's cost is its tests together with its fixtures, and
where the suite's time goes is a question of modules. For each module it prints the wall seconds of
its tests' setup, call and teardown, and, when the tests run one at a time (no xdist), the core-seconds
the whole machine spent meanwhile, from /proc/stat: a drill's agents, trainers and etcd are processes
that pytest does not reap, so the test process's own rusage misses them. Its last line sums the timed
drill modules apart: under ``pytest -n`` they run one at a time (tests/machine_turns.py), so their sum
is the least wall time the drills can take that way.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

SHOWN = 15  # modules; --modules-shown changes it
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_core_seconds() -> float | None:
    """Core-seconds every core of this machine has spent busy since boot (None where /proc is absent)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(value) for value in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    return (sum(ticks[:8]) - idle) / _TICKS_PER_S  # guest time is already counted in user time


class ModuleTimes:
    def __init__(self, serial: bool, shown: int = SHOWN):
        self.serial, self.shown = serial, shown  # core-seconds mean something only when one test runs at a time
        self.wall: dict[str, float] = defaultdict(float)
        self.cores: dict[str, float] = defaultdict(float)
        self.tests: dict[str, set[str]] = defaultdict(set)
        self.timed: set[str] = set()  # drill modules (marked slow) not marked untimed

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        before = busy_core_seconds() if self.serial else None
        yield
        after = busy_core_seconds() if before is not None else None
        if after is not None:
            self.cores[item.nodeid.split("::", 1)[0]] += after - before

    def pytest_runtest_logreport(self, report):
        module = report.nodeid.split("::", 1)[0]
        self.wall[module] += report.duration
        self.tests[module].add(report.nodeid)
        if "slow" in report.keywords and "untimed" not in report.keywords:  # a report carries its module's marks
            self.timed.add(module)

    def pytest_terminal_summary(self, terminalreporter):
        if not self.wall:
            return
        total = sum(self.wall.values())
        terminalreporter.write_sep("=", f"slowest {min(self.shown, len(self.wall))} modules (of {len(self.wall)})")
        cores = self.serial and bool(self.cores)
        heading = f"{'wall s':>8} {'share':>6} {'tests':>6}" + (f" {'core-s':>8} {'busy':>5}" if cores else "")
        terminalreporter.write_line(f"{heading}  module")
        for module, wall in sorted(self.wall.items(), key=lambda kv: -kv[1])[:self.shown]:
            line = f"{wall:8.1f} {wall / total:6.1%} {len(self.tests[module]):6d}"
            if cores:
                used = self.cores.get(module, 0.0)
                line += f" {used:8.1f} {used / wall / os.cpu_count() if wall else 0:5.0%}"
            terminalreporter.write_line(f"{line}  {module}")
        summary = f"{total:8.1f} in all"
        if cores:
            used = sum(self.cores.values())
            summary += f"; {used:.0f} core-seconds, {used / total / os.cpu_count():.0%} of {os.cpu_count()} cores busy"
        terminalreporter.write_line(summary)
        if self.timed:
            timed = sum(self.wall[module] for module in self.timed)
            terminalreporter.write_line(f"{timed:8.1f} in the {len(self.timed)} timed drill modules, which take the "
                                        "machine one at a time under -n")


def pytest_addoption(parser):
    parser.addoption("--modules-shown", type=int, default=SHOWN, metavar="N",
                     help=f"how many of the slowest modules the suite's time by module names (default {SHOWN})")


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller sums its reports
        return
    serial = not getattr(config.option, "numprocesses", None)
    config.pluginmanager.register(ModuleTimes(serial, config.getoption("modules_shown")), "module-times")
