"""The suite prints its time by module (tests/module_times.py): wall seconds with every fixture counted,
and the machine's busy core-seconds when the tests run one at a time."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO

SLOW_FIXTURE = """
import time
import pytest

@pytest.fixture(scope="module")
def spinning():
    end = time.process_time() + 0.6
    while time.process_time() < end:  # busy: it must show as core-seconds too
        pass

def test_one(spinning):
    pass

def test_two(spinning):
    pass
"""


def test_a_modules_time_counts_its_fixtures_and_its_busy_cores(tmp_path):
    (tmp_path / "test_slow.py").write_text(SLOW_FIXTURE)
    (tmp_path / "test_quick.py").write_text("def test_quick():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.module_times", "--noconftest",
                           "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout
    table = done.stdout[done.stdout.index("slowest 2 modules (of 2)"):]
    rows = re.findall(r"^ +([\d.]+) +([\d.]+)% +(\d+) +([\d.]+) +(\d+)%  (\S+)$", table, re.M)
    assert [(row[2], row[5].rsplit("/", 1)[-1]) for row in rows] == [("2", "test_slow.py"), ("1", "test_quick.py")]
    slow = rows[0]
    assert float(slow[0]) >= 0.6 and float(slow[3]) >= 0.5  # the module fixture's spin, in wall and in core-seconds
    assert re.search(r"^ +[\d.]+ in all; \d+ core-seconds, \d+% of \d+ cores busy$", table, re.M)


def test_the_timed_drill_modules_are_summed_apart(tmp_path):
    """A module marked slow (a drill) and not untimed takes the machine alone under -n: their sum is the floor."""
    (tmp_path / "test_timed.py").write_text("import time, pytest\npytestmark = pytest.mark.slow\n"
                                            "def test_a():\n    time.sleep(0.5)\n")
    (tmp_path / "test_untimed.py").write_text("import time, pytest\n"
                                              "pytestmark = [pytest.mark.slow, pytest.mark.untimed]\n"
                                              "def test_b():\n    time.sleep(0.3)\n")
    (tmp_path / "test_unit.py").write_text("def test_c():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.module_times", "--noconftest",
                           "-p", "no:cacheprovider", "-o", "addopts=", "-W", "ignore::pytest.PytestUnknownMarkWarning",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout
    timed = re.search(r"^ +([\d.]+) in the (\d+) timed drill modules, which take the machine one at a time under -n$",
                      done.stdout, re.M)
    # One module, the timed one: the untimed and the unit modules are left out.
    assert timed and timed[2] == "1" and 0.5 <= float(timed[1]) < 3, done.stdout


def test_the_table_names_as_many_modules_as_asked(tmp_path):
    """--modules-shown=N: the table names the N slowest modules (15 by default; make test asks for every drill module)."""
    for name in ("a", "b", "c"):
        (tmp_path / f"test_{name}.py").write_text("def test_x():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.module_times", "--noconftest",
                           "-p", "no:cacheprovider", "-o", "addopts=", "--modules-shown=2", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout
    table = done.stdout[done.stdout.index("slowest 2 modules (of 3)"):]
    assert len(re.findall(r"^ +[\d.]+ +[\d.]+% +1 .*  (\S+/)?test_[abc]\.py$", table, re.M)) == 2, table
