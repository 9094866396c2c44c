"""A real Slurm on this machine: Debian's slurmctld and one slurmd per node on loopback, with munge.

Debian's slurm-wlm (22.05) runs several slurmd on one host, each started with ``-N <node>`` and its
own port (slurmd(8) ``-N``; slurm.conf(5) ``Port`` per NodeName, ``%n`` in SlurmdSpoolDir and
SlurmdPidFile). Each slurmd runs in a mount namespace of its own where the test's folder is
bind-mounted at /fsx, so the jobs see one shared file system at the path they use on ParallelCluster
and nothing outside the test's folder is written. A node is "lost" by SIGKILLing its slurmd, its
step daemons and its tasks: slurmctld notices the silence after SlurmdTimeout, sets the node DOWN
and requeues the job, as it does for a failed instance.

Everything runs as root (slurmd must, to start tasks as the job's user); `make test` installs the
packages (Makefile DEB_PACKAGES) and the tests skip without them or without root.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from training.contract import FSX_MOUNT, SLURM_KILL_WAIT_S
from trainctl.backends.local_cluster import free_ports
import contextlib

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "sinfo", "scontrol", "scancel", "unshare")


def missing() -> str | None:
    """Why a real Slurm cannot run here, or None."""
    absent = [name for name in DAEMONS if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()]
    if absent:
        return f"no {', '.join(absent)} (Debian's slurmctld, slurmd, slurm-client and munge: make test installs them)"
    if os.geteuid() != 0:
        return "slurmd must run as root"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class SlurmCluster:
    root: Path
    partition: str
    nodes: tuple[str, ...] = ("node1", "node2")
    cpus: int = 2
    kill_wait_s: int = SLURM_KILL_WAIT_S  # the slurm stack's
    # How long a requeued job is held: Slurm makes it eligible cred_expire + 1 s after the requeue
    # (its old credentials must expire first); 120 s by default (slurm.conf AuthInfo cred_expire).
    cred_expire_s: int = 5  # the least Slurm accepts (slurm.conf(5), AuthInfo cred_expire)
    slurmd_timeout_s: int = 5
    # How long slurmctld waits for a node to answer a message (slurm.conf(5) MessageTimeout, 10 s by
    # default). A lost node's ping and the requeue's order to end the job there each wait it out: at 10 s
    # the requeue drill's kill-to-requeue took 25 s and the requeue to the script's start 16 s, at 3 s
    # 12 s and 10 s (docs/slurm.md). Loopback answers in milliseconds, and the cluster has the machine alone.
    message_timeout_s: int = 3
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.fsx = self.root / "fsx"
        self.fsx.mkdir(exist_ok=True)
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge.sock"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # --- configuration ----------------------------------------------------------------------

    def _write_config(self) -> None:
        controller, *node_ports = free_ports(1 + len(self.nodes))
        r = self.root
        lines = [
            "ClusterName=loopback",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={controller}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire_s}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool-%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            # No cgroups in a test container: processes are tracked by their parent chain.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/linear",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "JobRequeue=1",
            "ReturnToService=2",
            f"SlurmdTimeout={self.slurmd_timeout_s}",
            f"MessageTimeout={self.message_timeout_s}",
            f"KillWait={self.kill_wait_s}",
            "MinJobAge=3600",
            # The scheduler tries pending jobs every second, not every 60 s (main) and 30 s (backfill) as by default.
            "SchedulerParameters=sched_interval=1,bf_interval=1",
        ]
        for name, port in zip(self.nodes, node_ports, strict=True):
            lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs={self.cpus} RealMemory=2000 State=UNKNOWN")
        lines.append(f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        for folder in ("state", "log", *(f"spool-{n}" for n in self.nodes)):
            (r / folder).mkdir(exist_ok=True)

    # --- daemons ----------------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        self._write_config()
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._spawn("munged", [_binary("munged"), "-F", "-f", f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--log-file={self.root}/log/munged.log", f"--pid-file={self.root}/munged.pid",
                               f"--seed-file={self.root}/munged.seed"])
        self._wait(lambda: self.munge_socket.exists(), "munged's socket")
        self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, "slurmctld")
        if not Path(FSX_MOUNT).exists():
            Path(FSX_MOUNT).mkdir()  # the mount point; the bind itself stays in the daemons' namespaces
        for name in self.nodes:
            self.start_node(name)
        self._wait(lambda: self.idle_nodes() == set(self.nodes), "every node idle")
        return self

    def start_node(self, name: str) -> None:
        script = f'mount --bind "$1" {FSX_MOUNT} && exec "$2" -D -N "$3" -f "$4"'
        self._spawn(f"slurmd-{name}", [_binary("unshare"), "--mount", "--propagation", "private", "sh", "-c", script,
                                       "sh", str(self.fsx), _binary("slurmd"), name, str(self.conf)])

    def head_node(self, argv: list[str]) -> list[str]:
        """``argv`` run as on the head node: Slurm's commands find this cluster, and the shared file system is at /fsx."""
        return ["env", f"SLURM_CONF={self.conf}", _binary("unshare"), "--mount", "--propagation", "private", "sh", "-c",
                f'mount --bind "$0" {FSX_MOUNT} && exec "$@"', str(self.fsx), *argv]

    def _spawn(self, key: str, argv: list[str]) -> None:
        with open(self.root / "log" / f"{key}.out", "ab") as log:  # the child keeps its own descriptor
            self.processes[key] = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True)

    def _wait(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.2)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((self.root / "log").glob("*")))
        raise TimeoutError(f"Slurm on loopback: no {what} after {timeout} s\n{logs}")

    def run(self, *argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, input=input, timeout=60)
        if check and done.returncode:
            raise AssertionError(f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout}{done.stderr}")
        return done

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def idle_nodes(self) -> set[str]:
        return {name for name, state in self.node_states().items() if state == "idle"}

    # --- failures ---------------------------------------------------------------------------

    def node_processes(self, name: str) -> list[int]:
        """The node's slurmd, and every task it started (SLURMD_NODENAME in their environment) with
        the step daemon above each."""
        found = {self.processes[f"slurmd-{name}"].pid} if f"slurmd-{name}" in self.processes else set()
        daemon = self.root / f"slurmd-{name}.pid"
        if daemon.exists():
            found.add(int(daemon.read_text().split()[0]))
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                environ = (proc / "environ").read_bytes().split(b"\0")
                if f"SLURMD_NODENAME={name}".encode() not in environ:
                    continue
                found.add(int(proc.name))
                parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if b"slurmstepd" in Path(f"/proc/{parent}/cmdline").read_bytes():
                    found.add(parent)
            except (OSError, ValueError, IndexError):
                continue
        return sorted(found)

    def kill_node(self, name: str) -> list[int]:
        """The node fails at once: its slurmd, step daemons and tasks are SIGKILLed together."""
        victims = self.node_processes(name)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.processes.pop(f"slurmd-{name}").wait(timeout=10)
        return victims

    def stop(self) -> None:
        self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False)
        for key in sorted(self.processes, key=lambda k: k.startswith("munged")):  # munged last
            proc = self.processes[key]
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        # Tasks outlive a killed slurmd (they are the step daemons' children): none may stay behind.
        for name in self.nodes:
            for pid in self.node_processes_left(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def node_processes_left(self, name: str) -> list[int]:
        return [pid for pid in self.node_processes(name) if Path(f"/proc/{pid}").exists()
                and pid not in {p.pid for p in self.processes.values()}]
