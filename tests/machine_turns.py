"""A pytest plugin: under ``pytest -n``, a timed drill has the machine to itself (issue 51, item 5).

Most drills time what they do to a job: a node killed and the next round formed within a budget, a
stall under a second, an agent that must arrive before a deadline. Two of them side by side on a
2-core machine make each other late (9 timed drills failed when the drills last ran three at a time).
The others (whole tools over the templates, the CLI against stand-ins, models and decoders checked on
fixed inputs: the modules marked ``untimed``) only need CPU, and two of them side by side finish in
about half the time.

So each xdist worker takes a turn on the machine through two ``flock`` locks in a folder the run's
workers share:

- a drill module not marked ``untimed`` holds the machine lock exclusively from its first test's
  setup to its last test's teardown (its module fixtures run agents across its tests);
- an ``untimed`` test holds it shared, for that test alone;
- a turnstile lets a timed module in before further untimed tests (writer preference): without it
  two workers passing untimed tests back and forth could keep a timed module waiting for good.

The wait happens outside pytest-timeout's clock (this wrapper runs first) and outside the test's
reported duration. Without xdist (``pytest tests/drills``, one test, a debugger) there is nothing to
share and the plugin does nothing; unit tests never wait.
"""

from __future__ import annotations

import fcntl
import tempfile
from pathlib import Path

import pytest

UNTIMED = "untimed"


def _module(item: pytest.Item | None) -> str | None:
    return item.nodeid.split("::", 1)[0] if item is not None else None


class MachineTurns:
    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.turnstile = open(folder / "turnstile.lock", "a+")  # noqa: SIM115 - held for the whole session
        self.machine = open(folder / "machine.lock", "a+")  # noqa: SIM115 - likewise
        self.alone_in: str | None = None  # the timed module this worker holds the machine for

    def take_alone(self) -> None:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)  # untimed tests that come after wait behind this
        fcntl.flock(self.machine, fcntl.LOCK_EX)  # until the untimed tests already running end
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def take_shared(self) -> None:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)  # passes at once unless a timed module waits
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        fcntl.flock(self.machine, fcntl.LOCK_SH)

    def give_back(self) -> None:
        fcntl.flock(self.machine, fcntl.LOCK_UN)

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if item.get_closest_marker("slow") is None:  # a unit test
            yield
            return
        module = _module(item)
        untimed = item.get_closest_marker(UNTIMED) is not None
        if untimed:
            self.take_shared()
        elif self.alone_in != module:
            self.take_alone()
            self.alone_in = module
        try:
            yield
        finally:
            if untimed or _module(nextitem) != module:
                self.give_back()
                self.alone_in = None


def untimed_first(items: list[pytest.Item]) -> None:
    """Untimed drill modules first, in place and otherwise in order: with ``--no-loadscope-reorder``,
    both workers start on them together, and the timed modules, which run one at a time anyway,
    come after."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None and item.get_closest_marker(UNTIMED) is None)


@pytest.hookimpl(trylast=True)  # after tests/conftest.py has marked the drills slow
def pytest_collection_modifyitems(items):
    untimed_first(items)


def pytest_configure(config):
    worker = getattr(config, "workerinput", None)  # set in an xdist worker alone
    if worker is None:
        return
    # xdist gives each local worker a base temp inside the run's own (xdist/workermanage.py): the parent is
    # the run's, shared by its workers and cleaned up with pytest's other temporary folders.
    basetemp = config.option.basetemp
    run = Path(basetemp).parent if basetemp else Path(tempfile.gettempdir()) / f"pytest-run-{worker['testrunuid']}"
    config.pluginmanager.register(MachineTurns(run / "machine-turns"), "machine_turns")
