"""tests/background.py: what make test runs beside the timed drills gets the lowest priority, in a session of its
own, and its exit status comes back."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

PROBE = """
import os, pathlib
autogroup = pathlib.Path("/proc/self/autogroup")
print(os.sched_getscheduler(0) == os.SCHED_IDLE, os.getsid(0) == os.getpid(),
      autogroup.read_text().split()[-1] if autogroup.exists() else "-")
"""


def background(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.background", *command], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_the_command_and_what_it_starts_run_at_the_lowest_priority_in_a_session_of_their_own():
    nested = background(sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {PROBE!r}])")
    idle, own_session, autogroup_nice = nested.stdout.split()
    assert idle == "True"  # inherited by a grandchild: every process of the unit tests and untimed drills
    assert own_session == "False"  # the grandchild is in the command's session, not a leader of its own
    direct = background(sys.executable, "-c", PROBE)
    assert direct.stdout.split()[:2] == ["True", "True"]
    if Path("/proc/self/autogroup").exists():  # a kernel with autogroups: the session's group weighs least
        assert autogroup_nice == direct.stdout.split()[2] == "19"


def test_the_commands_exit_status_comes_back():
    assert background(sys.executable, "-c", "raise SystemExit(3)").returncode == 3
    assert background(sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)").returncode == (
        128 + signal.SIGTERM)
    assert background().returncode == 2


def test_a_sigterm_to_the_wrapper_reaches_the_commands_session():
    wrapper = subprocess.Popen([sys.executable, "-m", "tests.background", sys.executable, "-c",
                                "import sys, time; print('up', flush=True); time.sleep(60)"],
                               cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert wrapper.stdout.readline() == "up\n"
    os.kill(wrapper.pid, signal.SIGTERM)
    assert wrapper.wait(timeout=30) == 128 + signal.SIGTERM


def test_a_ctrl_c_stops_the_command_though_bash_started_the_wrapper_with_sigint_ignored():
    # A non-interactive bash starts a command run with `&` (make test's recipe) with SIGINT ignored; the command
    # must not inherit that, or a Ctrl-C on make test would leave the unit tests running.
    sleeper = "import time; print('up', flush=True); time.sleep(60)"
    script = (f"{sys.executable} -m tests.background {sys.executable} -c \"{sleeper}\" & wrapper=$!; "
              "trap '' INT; wait $wrapper; echo status $?")
    shell = subprocess.Popen(["bash", "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    assert shell.stdout.readline() == "up\n"
    os.killpg(shell.pid, signal.SIGINT)  # what a terminal's Ctrl-C does to make's process group
    try:
        out, _ = shell.communicate(timeout=20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
    assert out == f"status {128 + signal.SIGINT}\n"
