"""(placeholder until the SSM transport lands) Shells that run Slurm's commands."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str


class LocalShell:
    where = "this machine"

    def __init__(self, env: Mapping[str, str] | None = None):
        self.env = dict(env) if env is not None else None

    def run(self, argv: Sequence[str], *, input: str | None = None, timeout: float = 60) -> Completed:
        done = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout, env=self.env)
        return Completed(done.returncode, done.stdout, done.stderr)
