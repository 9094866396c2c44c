"""Run a command on the CPU time the timed drills leave idle (issue 51, item 5): ``python -m tests.background CMD``.

``make test`` runs the timed drills one at a time in the foreground (each one's agents, etcd members and Slurm
daemons are timed, so a neighbour at the same priority makes them late: tests/machine_turns.py) and, beside
them, the unit tests and the untimed drills through this wrapper. A timed drill keeps the two cores busy about
half the time (its agents wait on rendezvous rounds, paced steps, outages and kills); the untimed work, which
has no deadline a slower pace could break, runs in those gaps.

The command gets its own session and, in it, the lowest priorities Linux gives without privileges:

- ``SCHED_IDLE`` (sched(7)): a task of this policy weighs 3 against a nice-0 task's 1,024 on the same run
  queue, and one waking of any other policy preempts it. It is inherited across fork and kept across execve,
  so every process the command starts has it too;
- where the kernel groups tasks by session (``CONFIG_SCHED_AUTOGROUP``, on in most distributions' kernels,
  and only for tasks in the root CPU cgroup), the scheduler shares the CPU between sessions first and between
  their tasks second, so a task's own policy weighs only inside its session. The wrapper's new session is its
  own autogroup, and its nice value is set to 19 through ``/proc/self/autogroup`` (sched(7), "The autogroup
  feature"): against the drills' agents, which start sessions of their own (trainctl/backends/local_cluster.py),
  the whole group weighs 15 to their 1,024 each. Inside a container's or a service's CPU cgroup there are no
  autogroups, the write changes nothing, and SCHED_IDLE alone sets the weight, against every task of the cgroup.

A process the command starts in a session of its own leaves that autogroup for a new one at nice 0, where it
competes at full weight: such a drill is timed (tests/drills/test_gpu_check.py). The wrapper warns when the
autogroup's nice did not take. It forwards SIGINT and SIGTERM to the command's session (a Ctrl-C on ``make
test`` reaches the terminal's process group, which the new session has left), the command gets SIGTERM if the
wrapper dies (prctl(2), PR_SET_PDEATHSIG), and the wrapper exits with the command's status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from trainctl.backends.local import _with_this_process

AUTOGROUP_NICE = 19
FORWARDED = (signal.SIGINT, signal.SIGTERM)


def _lowest_priority(parent: int) -> None:
    """In the child, between fork and exec."""
    # bash starts a command run with `&` with SIGINT ignored, and an ignored signal stays ignored across exec:
    # the command would not stop on the Ctrl-C the wrapper forwards.
    for forwarded in FORWARDED:
        signal.signal(forwarded, signal.SIG_DFL)
    _with_this_process(parent)()  # SIGTERM when the wrapper dies, as trainctl's local backend does for its nodes
    # The kernel takes one write to any /proc/*/autogroup in 100 ms (EAGAIN otherwise; kernel/sched/autogroup.c,
    # proc_sched_autogroup_set_nice), and other wrappers may be starting too.
    deadline = time.monotonic() + 2
    while True:
        try:
            with open("/proc/self/autogroup", "w") as autogroup:
                autogroup.write(str(AUTOGROUP_NICE))
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        except OSError:
            break  # no autogroups in this kernel: SCHED_IDLE alone
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def autogroup_nice(pid: int) -> int | None:
    """The nice value of ``pid``'s autogroup ("/autogroup-3558 nice 19"), None without autogroups."""
    try:
        with open(f"/proc/{pid}/autogroup") as autogroup:
            return int(autogroup.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.background COMMAND [ARG ...]", file=sys.stderr)
        return 2
    command: subprocess.Popen | None = None
    pending: list[int] = []  # a signal that came before the command had a process group to send it to

    def forward(signum, _frame):
        if command is None:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):  # it has ended already
            os.killpg(command.pid, signum)

    for forwarded in FORWARDED:
        signal.signal(forwarded, forward)
    parent = os.getpid()
    command = subprocess.Popen(argv, start_new_session=True, preexec_fn=lambda: _lowest_priority(parent))
    for signum in pending:
        forward(signum, None)
    nice = autogroup_nice(command.pid)
    if nice is not None and nice != AUTOGROUP_NICE and command.poll() is None:
        print(f"tests/background.py: the command's autogroup is at nice {nice}, not {AUTOGROUP_NICE}: it competes "
              "with the timed drills at more than the lowest weight", file=sys.stderr)
    status = command.wait()
    return 128 - status if status < 0 else status  # killed by a signal: the shell's number for it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
