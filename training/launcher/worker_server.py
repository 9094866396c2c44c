"""Imported by the node's forkserver alone (``workers.PRELOAD``), before it forks any worker.

The server is in the agent's process group, so a signal sent to the whole group (a Ctrl-C, a stop
sent to the pod's processes, ``kill -TERM -<pgid>``) reaches it too. Its default action would end
it, and with it every worker at once (they die with their parent: ``die_with_agent``), before they
write their stop checkpoint. So the server blocks the agent's stop signals (it ignores SIGINT
itself, but only once its imports are done: CPython 3.11 multiprocessing/forkserver.py, ``main``);
each worker unblocks them first thing
(``workers.train_worker``), and one sent meanwhile is delivered then. The server ends when the
agent does: its end of the server's pipe closes, or the agent dies (``die_with_agent``).

What a worker needs is imported here, once: torch.optim imports torch._dynamo when the first
optimizer is built (torch 2.13 torch/_compile.py, ``_disable_dynamo``): 1.7 s of a worker's 1.72 s
start on this project's CI machine (mlp, profiled), paid by every worker of every restart unless
the server has it. None of these touches a device (tests/drills/test_launcher_torches.py forks after them
with torch's CUDA build and finds no poison).
"""

import signal

from training.launcher.workers import SERVER_BLOCKED_SIGNALS
from training.loop.worker_guard import die_with_agent

signal.pthread_sigmask(signal.SIG_BLOCK, SERVER_BLOCKED_SIGNALS)
die_with_agent()  # first: an agent killed while the server imports takes the server with it

import torch._dynamo  # noqa: E402, F401 - imported for its side effect: loaded before the fork

import training.__main__  # noqa: E402 - likewise
import training.loop.trainer  # noqa: E402, F401 - likewise
