"""Run a command on the CPU time the timed drills leave idle (issue 51, item 5): ``python -m tests.background CMD``.

``make test`` runs the timed drills one at a time in the foreground (each one's agents, etcd members and Slurm
daemons are timed, so a neighbour at the same priority makes them late: tests/machine_turns.py) and, beside
them, the unit tests and the untimed drills through this wrapper. A timed drill keeps the two cores busy about
half the time (its agents wait on rendezvous rounds, paced steps, outages and kills); the untimed work, which
has no deadline a slower pace could break, runs in those gaps.

The command gets its own session and, in it, the lowest priorities Linux gives without privileges:

- ``SCHED_IDLE`` (sched(7)): a runnable task of any other policy on the same run queue goes first; it is
  inherited across fork and exec, so every process the command starts has it too;
- where the kernel groups tasks by session (``CONFIG_SCHED_AUTOGROUP``, on in most distributions' kernels),
  the scheduler shares the CPU between sessions first and between their tasks second, so a task's own policy
  weighs only inside its session. The wrapper's new session is its own autogroup, and its nice value is set
  to 19 through ``/proc/self/autogroup`` (sched(7), "The autogroup feature"): against the drills' agents,
  which start their own sessions (trainctl/backends/local_cluster.py), the whole group weighs 15 to their
  1,024 each.

A process the command starts in a session of its own (benchmarks/gpu_check.py's agents) leaves that autogroup
and keeps only ``SCHED_IDLE``. The wrapper forwards SIGINT and SIGTERM to the command's session (a Ctrl-C on
``make test`` reaches the terminal's process group, which the new session has left) and exits with its status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

AUTOGROUP_NICE = 19


def _lowest_priority() -> None:  # in the child, between fork and exec: no output, nothing that can raise
    try:
        with open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write(str(AUTOGROUP_NICE))
    except OSError:
        pass  # no autogroups (a kernel without them, or a task in a cgroup of its own): SCHED_IDLE alone
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.background COMMAND [ARG ...]", file=sys.stderr)
        return 2
    command = subprocess.Popen(argv, start_new_session=True, preexec_fn=_lowest_priority)

    def forward(signum, _frame):
        with contextlib.suppress(ProcessLookupError):  # it has ended already
            os.killpg(command.pid, signum)

    for forwarded in (signal.SIGINT, signal.SIGTERM):
        signal.signal(forwarded, forward)
    status = command.wait()
    return 128 - status if status < 0 else status  # killed by a signal: the shell's number for it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
