"""Where trainctl runs jobs: one interface, a module per backend, each loaded only when named.

The model is torchx's ``Scheduler`` (torchx/schedulers/api.py: submit, describe, list, cancel,
log_iter, with each scheduler's options declared by the scheduler): every backend here answers the
same five commands, and declares, per command, which of trainctl's options it honours. Any other
option is refused in one line, by :func:`refuse_unsupported`, before the backend is even built; an
option is never silently ignored. ``-o json|yaml``, ``--wait`` and ``status --watch`` are served
the same way on every backend from what :meth:`Backend.status` and :meth:`Backend.jobs` return.

No backend imports another: what they share (the agents' rank claims in a log, an AWS session)
lives here.
"""

from __future__ import annotations

import importlib
import json
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from trainctl.errors import UserError
from training.contract import NODE_RANKS_EVENT

if TYPE_CHECKING:
    from config import PlatformConfig
    from config.job_spec import JobSpec

# Each backend's module: imported only when a command names it (boto3, kubernetes or a Slurm shell
# are then loaded for that backend alone).
BACKENDS = {
    "eks": "trainctl.backends.eks",
    "batch": "trainctl.backends.batch",
    "slurm": "trainctl.backends.slurm",
    "local": "trainctl.backends.local",
}
DEFAULT_BACKEND = "eks"
# The commands every backend answers.
JOB_COMMANDS = ("submit", "status", "cancel", "logs", "list")


@dataclass(frozen=True)
class Connection:
    """How a backend reaches where its jobs run: the options every job command takes."""

    config: PlatformConfig
    profile: str | None = None       # AWS profile (eks, batch, slurm through SSM)
    context: str | None = None       # kubeconfig context instead of an EKS token (eks)
    on_head_node: bool = False       # run Slurm's commands here (slurm)
    workdir: Path | None = None      # the local backend's folder (local)

    def aws_session(self):
        return aws_session(self.profile)


def aws_session(profile: str | None):
    """A boto3 session of ``profile``, else of the usual credential chain."""
    import boto3

    return boto3.Session(profile_name=profile) if profile else boto3.Session()


@dataclass(frozen=True)
class SubmitOptions:
    replace: bool = False
    dry_run: str | None = None       # None, "client" or "server"
    nccl_check: bool = False
    python: str | None = None        # slurm: a Python on the nodes instead of the image
    nodes: int | None = None         # local: agents to start
    nproc_per_node: int | None = None  # local: workers per agent


@dataclass(frozen=True)
class LogOptions:
    rank: int | None = None
    pod: int | None = None
    all: bool = False
    follow: bool = False
    previous: bool = False
    since_s: int | None = None


@dataclass(frozen=True)
class Submitted:
    """What a submit left: the job to wait for or follow (None: a dry run, nothing runs), and, where the
    backend ran the job in the foreground, how it ended."""

    name: str | None
    exit_code: int | None = None


class Report(Protocol):
    """A job's state as each backend knows it."""

    @property
    def finished(self) -> bool: ...
    @property
    def succeeded(self) -> bool: ...
    def summary(self) -> str: ...   # one line: what --wait says at each change
    def format(self) -> str: ...    # the text people read
    def as_dict(self) -> dict: ...  # -o json|yaml: the text's fields


class Backend(ABC):
    """A place trainctl runs jobs. Subclasses declare ``name``, ``options`` and ``hints``."""

    name: ClassVar[str]
    # Per command, the options it honours, spelled as users type them ("-o" for every output format).
    options: ClassVar[dict[str, frozenset[str]]]
    # Per command, what a refusal adds after the options allowed (what this backend's logs are, ...).
    hints: ClassVar[dict[str, str]] = {}

    def __init__(self, connection: Connection):
        self.connection = connection
        self.config = connection.config

    @classmethod
    @abstractmethod
    def where(cls, connection: Connection, command: str) -> str:
        """What the command acts on, for the line trainctl says before it acts."""

    @abstractmethod
    def submit(self, spec: JobSpec, options: SubmitOptions) -> Submitted:
        """Check everything the backend can before anything is created, then create the job."""

    @abstractmethod
    def status(self, name: str) -> Report: ...

    @abstractmethod
    def jobs(self) -> list[dict]:
        """This platform's jobs, one mapping each (``-o json`` prints them as they are)."""

    @abstractmethod
    def logs(self, name: str, options: LogOptions) -> None:
        """Print the chosen log (rank 0's by default) on stdout."""

    @abstractmethod
    def cancel(self, name: str) -> str:
        """Stop the job; the line to say afterwards."""

    def list_line(self, row: dict) -> str:
        return f"{row['name']:<40} {row['state']}"

    def nothing_listed(self) -> str:
        return "no jobs"

    # Only where ``options`` declares them: --follow, cancel --all.
    def follow(self, name: str, interval_s: float) -> int:
        raise NotImplementedError

    def cancel_all(self, yes: bool) -> int:
        raise NotImplementedError


def load(name: str) -> type[Backend]:
    """The backend class of ``name``, importing its module now."""
    if name not in BACKENDS:
        raise UserError(f"--backend: got {name!r}", f"allowed: {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name]).BACKEND


def refuse_unsupported(backend: type[Backend], command: str, given: list[tuple[str, str]]) -> None:
    """One line for the first option ``backend`` does not honour for ``command``. ``given``: each option
    the user gave, as (declared spelling, as typed), e.g. ("-o", "-o json")."""
    supported = backend.options.get(command, frozenset())
    for option, typed in given:
        if option in supported:
            continue
        allowed = ", ".join(sorted(supported)) or "no options"
        hint = backend.hints.get(command)
        elsewhere = [other for other in BACKENDS if other != backend.name and option in load(other).options.get(command, ())]
        fix = f"allowed with {backend.name}: {allowed}" + (f" ({hint})" if hint else "")
        if elsewhere:
            fix += f"; {typed} is for --backend {' or '.join(elsewhere)}"
        raise UserError(f"{command} --backend {backend.name}: got {typed}", fix)


def say(line: str) -> None:
    """A line for the person at the terminal, on stderr: stdout stays what scripts read."""
    print(line, file=sys.stderr, flush=True)


# --- what the backends share: which node holds a rank, read from the agents' own lines ------------

def metrics_events(log_text: str) -> list[dict]:
    """The platform's JSON lines in a log: the trainer's (rank 0 writes them) and the agent's."""
    events = []
    for line in log_text.splitlines():
        if line.startswith('{"event"'):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def rank_claim(log_text: str, rank: int) -> float | None:
    """When a node's agent last said its workers hold global rank ``rank`` (its newest
    ``node_ranks`` line, training/launcher/agent.py), or None if that line does not name it."""
    rounds = [e for e in metrics_events(log_text) if e["event"] == NODE_RANKS_EVENT]
    return rounds[-1]["time"] if rounds and rank in rounds[-1]["global_ranks"] else None


def newest_claim(claims: dict, rank: int, name: str, what: str, where: str):
    """The key of the newest claim on ``rank``, or one line saying none holds it. A node's index is not
    its rank: a regroup hands places out in the order nodes join."""
    held = {key: at for key, at in claims.items() if at is not None}
    if not held:
        raise UserError(f"--rank: got {rank}, which no {what} of {name} holds now",
                        f"allowed: a rank below the world size {where} once the job has formed its group; "
                        f"`--pod INDEX` picks a {what} by its index instead")
    return max(held, key=held.get)
