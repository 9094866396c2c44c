"""A pytest plugin: under ``pytest -n``, a timed drill has the machine to itself (issue 51, item 5).

Most drills time what they do to a job: a node killed and the next round formed within a budget, a
stall under a second, an agent that must arrive before a deadline. Two of them side by side on a
2-core machine make each other late (9 timed drills failed when the drills last ran three at a time).
The modules marked ``untimed`` (whole tools over the templates, the CLI against stand-ins, models and
decoders checked on fixed inputs) hold nothing a busy neighbour could break: they only need CPU, and
two of them side by side finish in about half the time.

``make test`` does not need this: it runs the timed drills in a pytest run of their own, one at a time, and the
untimed ones beside them at the lowest priority (tests/background.py). Under a plain ``pytest -n`` over the
drills, each xdist worker takes a turn on the machine through two ``flock`` locks in a folder the run's
workers share:

- a timed drill module (under tests/drills/, its module not marked ``untimed``) holds the machine lock
  exclusively from its first test's setup to its last test's teardown (its module fixtures run agents
  across its tests);
- every other test (an untimed drill, a unit test in a run that mixes them with drills) holds it
  shared, for that test alone;
- a turnstile lets a timed module in before further shared tests (writer preference): without it two
  workers passing shared tests back and forth could keep a timed module waiting for good.

The wait happens outside pytest-timeout's clock (this wrapper runs first) and outside the test's
reported duration. Only xdist's workers register the plugin: a plain ``pytest tests/drills`` runs one
test at a time and has nothing to share. ``untimed_first`` orders the drills in every run.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

UNTIMED = "untimed"


def module_of(item: pytest.Item | None) -> str | None:
    return item.nodeid.split("::", 1)[0] if item is not None else None


def is_timed_drill(item: pytest.Item) -> bool:
    """A drill whose module is not marked untimed. The mark is read from the module alone, so every test of
    a module takes the same kind of turn (test_project_layout refuses the mark anywhere else)."""
    if item.get_closest_marker("slow") is None:  # tests/conftest.py marks everything under tests/drills/
        return False
    module = item.getparent(pytest.Module)
    return module is None or module.get_closest_marker(UNTIMED) is None


class MachineTurns:
    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.turnstile = open(folder / "turnstile.lock", "a+")  # noqa: SIM115 - held until close()
        self.machine = open(folder / "machine.lock", "a+")  # noqa: SIM115 - likewise
        self.alone_in: str | None = None  # the timed module this worker holds the machine for

    def take_alone(self) -> None:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)  # shared turns asked for after this wait behind it
        fcntl.flock(self.machine, fcntl.LOCK_EX)  # until the shared turns already running end
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def take_shared(self) -> None:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)  # passes at once unless a timed module waits
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        fcntl.flock(self.machine, fcntl.LOCK_SH)

    def give_back(self) -> None:
        fcntl.flock(self.machine, fcntl.LOCK_UN)

    def close(self) -> None:
        self.turnstile.close()  # closing the files lets go of any lock still held
        self.machine.close()

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        module = module_of(item)
        if self.alone_in != module:  # already alone for this module: the turn goes on, whatever the test
            if self.alone_in is not None:  # xdist names the next item truly; this is in case it did not
                self.give_back()
                self.alone_in = None
            if is_timed_drill(item):
                self.take_alone()
                self.alone_in = module
            else:
                self.take_shared()
        try:
            return (yield)
        finally:
            if self.alone_in is None or module_of(nextitem) != module:
                self.give_back()
                self.alone_in = None

    def pytest_unconfigure(self):
        self.close()


def untimed_first(items: list[pytest.Item]) -> None:
    """Timed drills last, in place and otherwise in order: with ``--no-loadscope-reorder``, both workers
    start on the untimed modules together, and the timed modules, which run one at a time anyway, come
    after."""
    items.sort(key=is_timed_drill)


@pytest.hookimpl(trylast=True)  # after tests/conftest.py has marked the drills slow
def pytest_collection_modifyitems(items):
    untimed_first(items)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # set in an xdist worker alone
        return
    basetemp = config.option.basetemp
    if not basetemp:
        # xdist gives each local worker a base temp inside the run's own (xdist/workermanage.py, setup());
        # without one (remote workers, `-p no:tmpdir`) there is no folder the workers are known to share.
        raise pytest.UsageError("tests/machine_turns.py: an xdist worker without --basetemp cannot share the "
                                "machine with its peers; run the drills on local workers with pytest's tmpdir plugin")
    # The parent of a worker's base temp is the run's, shared by its workers and cleaned up with pytest's
    # other temporary folders.
    config.pluginmanager.register(MachineTurns(Path(basetemp).parent / "machine-turns"), "machine_turns")
