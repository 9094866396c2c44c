"""``--backend local``: a job spec run on this machine, on CPU, with a real etcd and several real agents.

Like the charts, it builds every process from the contract (training/contract.py): etcd's flags
(:func:`etcd_arguments`) and each node's command (:func:`launch_command`, ``python -m
training.launcher ... -m training train`` with the job's trainer arguments). It imports nothing
else of the image: the agents and etcd are subprocesses, as pods are. Each agent is a process
group of its own, so ``kill -9`` of its pid is a node lost.

What it does to the job spec: ``min_nodes`` stays, the agents are ``--nodes`` (default: the
spec's ``max_nodes``, as many as fit this machine), each with ``--nproc-per-node`` CPU workers
(``train.device=cpu``); every ``/fsx`` path is under the work directory's ``fsx/``; ``image``
and ``node_group`` are not used (this checkout's code runs). What the job controller does on
EKS (k8s_charts/job_charts.py, the lifecycle policies) is done here: a node lost to a signal is
replaced (Volcano's RestartPod), an exit the platform treats as final ends the job, and the
job has completed once one agent exits 0 (Volcano's minSuccess 1).

Layout of the work directory (default ``~/.cache/trainctl-local``)::

    fsx/                 what /fsx is on the platform: checkpoints/<job>, staging/<job>, datasets/
    jobs/<job>/          state.json, metrics.jsonl (rank 0's events), node-<i>.log, etcd.log, etcd/
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from config import PlatformConfig
from config.job_spec import JobSpec
from trainctl.backends import Backend, Connection, LogOptions, SubmitOptions, Submitted, newest_claim, rank_claim
from trainctl.backends.local_cluster import ETCD_ENV, etcd_binary, free_ports, read_events, read_new_events
from trainctl.errors import UserError, check_name
from training.contract import (
    EXIT_CONFIG, EXIT_CRASH_LOOP, EXIT_DIVERGED, EXIT_RESTART_JOB, EXIT_STOPPED, FINAL_EXITS, FSX_MOUNT,
    LAUNCH_ENVIRONMENT, PLATFORM_TUNING, checkpoint_step, etcd_arguments, launch_command,
)

# Each worker is one thread (OMP_NUM_THREADS=1). More than two a core and the agents' 0.25 s
# lease keep-alives (1 s TTL, PLATFORM_TUNING) starve: nodes would be lost that are alive.
WORKERS_PER_CORE = 2
MAX_WORKERS = 16
# SIGTERM -> the agents -> the workers checkpoint, then SIGKILL: the pod's grace period, shortened
# (training.contract.shutdown_timeout leaves the workers 15 s of it).
STOP_GRACE_S = 30
# A lost node's replacement starts this long after the loss (on EKS: a new node, minutes).
REPLACE_AFTER_S = 5
# Once one agent has succeeded, the others (in the final round, or closing) get this long to end.
AFTER_SUCCESS_S = 60
POLL_S = 0.5
REPO_ROOT = Path(__file__).resolve().parent.parent
EXIT_MEANINGS = {
    EXIT_CONFIG: "the trainer's config, data or checkpoint directory, or the launcher's torch, is wrong (its log says which)",
    EXIT_DIVERGED: "the loss is not finite",
    EXIT_CRASH_LOOP: "the workers, or the launcher, failed with no checkpoint written since it started",
    EXIT_RESTART_JOB: "the workers failed max_restarts times after progress; submit again to resume",
    EXIT_STOPPED: "stopped by SIGTERM",
}


def default_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainctl-local"


# --- the plan: what runs --------------------------------------------------------------------------

@dataclass
class LocalPlan:
    name: str
    nodes: int
    min_nodes: int
    nproc: int
    root: Path
    trainer_args: list[str]
    checkpoint_dir: Path
    events: Path
    env: dict[str, str] = field(default_factory=dict)
    scale_up_after_s: float = PLATFORM_TUNING.scale_up_after_s
    max_restarts: int = 100

    @property
    def job_dir(self) -> Path:
        return self.root / "jobs" / self.name

    def command(self, endpoint: str) -> list[str]:
        tuning = replace(PLATFORM_TUNING, scale_up_after_s=self.scale_up_after_s)
        return launch_command(min_nodes=self.min_nodes, max_nodes=self.nodes, nproc_per_node=self.nproc,
                              endpoint=endpoint, run_id=self.name, max_restarts=self.max_restarts,
                              local_addr="127.0.0.1", python=sys.executable, grace_period_s=STOP_GRACE_S,
                              tuning=tuning) + self.trainer_args


def cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share, where known)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_limit() -> int:
    return min(MAX_WORKERS, WORKERS_PER_CORE * cores())


def local_path(value: str, fsx: Path) -> str:
    """A path under /fsx as the same path under the work directory's fsx/; anything else as it is."""
    if value == FSX_MOUNT or value.startswith(f"{FSX_MOUNT}/"):
        return str(fsx / value[len(FSX_MOUNT):].lstrip("/"))
    return value


def plan(spec: JobSpec, config: PlatformConfig, root: Path, nodes: int | None, nproc: int) -> LocalPlan:
    """The local run of ``spec``; every problem is one line, before anything starts."""
    from training.config import check_overrides

    limit = worker_limit()
    if nproc < 1 or nproc > limit:
        raise UserError(f"--nproc-per-node: got {nproc}", f"allowed: 1 to {limit} on this machine")
    fits = limit // nproc
    if nodes is None:
        nodes = max(spec.min_nodes, min(spec.max_nodes, fits))
    elif not spec.min_nodes <= nodes <= spec.max_nodes:
        raise UserError(f"--nodes: got {nodes}", f"allowed: the job spec's min_nodes ({spec.min_nodes}) to "
                        f"max_nodes ({spec.max_nodes})")
    if nodes * nproc > limit:
        raise UserError(f"--nodes {nodes} × --nproc-per-node {nproc}: {nodes * nproc} CPU workers are too many for "
                        f"this machine", f"allowed: at most {limit} ({WORKERS_PER_CORE} a core, {cores()} "
                        f"cores); pass a smaller --nodes (the spec's min_nodes is {spec.min_nodes})")
    fsx = root / "fsx"
    job_dir = root / "jobs" / spec.name
    flags = [flag if "=" not in flag else flag.split("=", 1)[0] + "=" + local_path(flag.split("=", 1)[1], fsx)
             for flag in spec.trainer_flags(config)]
    given = {flag.split("=", 1)[0][2:]: flag.split("=", 1)[1] for flag in flags if flag.startswith("--") and "=" in flag}
    flags.append("--train.device=cpu")
    events = given.get("metrics.jsonl_path")
    if events is None:
        events = str(job_dir / "metrics.jsonl")
        flags.append(f"--metrics.jsonl_path={events}")
    problems = check_overrides([f for f in flags if not f.startswith("--config=")], partial=bool(spec.trainer_config))
    if problems:
        raise UserError(f"--backend local runs the job on CPU, and then trainer_args.{problems[0]}",
                        "change that key in the job spec's trainer_args")
    for key in ("config", "data.path", "eval.path"):
        path = given.get(key)
        if path is not None and not Path(path).exists():
            what = "trainer_config" if key == "config" else f"trainer_args.{key}"
            raise UserError(f"{what}: {path} does not exist on this machine",
                            f"put it there ({fsx} stands for {FSX_MOUNT}), or use synthetic data (data.kind: synthetic)")
    env = {**spec.env, "CUDA_VISIBLE_DEVICES": ""}
    return LocalPlan(spec.name, nodes, spec.min_nodes, nproc, root, flags, Path(given["checkpoint.dir"]), Path(events),
                     env, spec.scale_up_after_s, spec.max_restarts)


def check_torch() -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise UserError(f"--backend local runs the trainer with {sys.executable}, which has no torch",
                        "`make test` installs torch (CPU) into .venv; run .venv/bin/trainctl from there")


# --- state on disk: what status, logs, cancel and list read ----------------------------------------

def read_state(root: Path, name: str) -> dict:
    path = root / "jobs" / check_name("job name", name) / "state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        raise UserError(f"no local job {name!r} in {root}", "see `trainctl list --backend local`"
                        " (--workdir if it ran elsewhere)") from None


def write_state(job_dir: Path, state: dict) -> None:
    tmp = job_dir / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(job_dir / "state.json")


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) no longer runs.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def phase(state: dict) -> str:
    if state["phase"] == "Running" and not alive(state.get("pid")):
        return "Lost (the trainctl that ran it is gone)"
    return state["phase"]


def describe(event: dict) -> str | None:
    """One of rank 0's events (training/loop/metrics.py) as a line, or None for those not shown."""
    kind, e = event.get("event"), event
    if kind == "step":
        rate = f"  {e['samples_per_s']:,.0f} samples/s" if e.get("samples_per_s") else ""
        return f"step {e['step']} (epoch {e.get('epoch', 0)})  loss {e['loss']:.4f}{rate}  world size {e['world_size']}"
    if kind == "rendezvous":
        return (f"round of {e['world_size']} worker(s) on {e.get('device', '?')}, global batch {e.get('global_batch')}"
                + (f", restart {e['restart_count']}" if e.get("restart_count") else ""))
    if kind == "resume":
        return f"resuming from step {e['step']}" + (f" ({e['checkpoint']})" if e.get("checkpoint") else "")
    if kind == "start":
        return "starting from step 0"
    if kind == "checkpoint_saved":
        return f"checkpoint saved: step {e['step']}"
    if kind == "finished":
        return f"finished at step {e['step']}" + (f", loss {e['loss']:.4f}" if e.get("loss") is not None else "")
    if kind == "stop" and e.get("regroup"):  # no checkpoint: the same workers go on in the next round
        return f"changing rounds at step {e['step']}: nodes came or went; the state stays in memory"
    if kind == "stop":
        return f"stopped at step {e['step']} ({e.get('signal') or 'a peer stopped'}); checkpoint saved"
    return None


def how_it_ended(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}" + (f" ({EXIT_MEANINGS[code]})" if code in EXIT_MEANINGS else "")


# --- the foreground run ---------------------------------------------------------------------------

def _with_this_process(parent: int):
    """A child's first act (Linux): SIGTERM it when trainctl dies, so even a killed trainctl leaves no
    agent or etcd behind (prctl(2), PR_SET_PDEATHSIG; an agent's workers do the same with it)."""
    def preexec() -> None:
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
            if os.getppid() != parent:
                os._exit(1)
    return preexec


@dataclass
class Node:
    name: str
    log: Path
    proc: subprocess.Popen | None = None
    started: float = 0.0
    code: int | None = None


class LocalRun:
    """One foreground run of a plan: etcd, the agents, the events streamed, everything stopped at the end."""

    def __init__(self, plan: LocalPlan, etcd: str, out=sys.stdout):
        self.plan, self.etcd_binary, self.out = plan, etcd, out
        self.job_dir = plan.job_dir
        self.nodes = [Node(f"node-{i}", self.job_dir / f"node-{i}.log") for i in range(plan.nodes)]
        self.etcd: subprocess.Popen | None = None
        self.endpoint = ""
        self.stop_requested = 0  # 1: stop gracefully; 2: kill now
        self.finished = False  # rank 0 said so: a lost node is no longer replaced
        self._offset = 0
        self.state: dict = {}

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    # processes

    def _popen(self, command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(log, "ab") as output:
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                    cwd=self.job_dir, env=env, start_new_session=True,
                                    preexec_fn=_with_this_process(os.getpid()))

    def start_etcd(self) -> None:
        data = self.job_dir / "etcd"
        shutil.rmtree(data, ignore_errors=True)  # a fresh rendezvous store for every submission
        client, peer = free_ports(2)
        self.endpoint = f"127.0.0.1:{client}"
        args = etcd_arguments("local", str(data), peers={"local": f"http://127.0.0.1:{peer}"},
                              listen_client_urls=[f"http://{self.endpoint}"], advertise_client_url=f"http://{self.endpoint}",
                              listen_peer_url=f"http://127.0.0.1:{peer}", cluster_token=self.plan.name)
        log = self.job_dir / "etcd.log"
        self.etcd = self._popen([self.etcd_binary, *args], log)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1).read()
                return
            except OSError:
                if self.etcd.poll() is not None or time.monotonic() > deadline:
                    self.etcd.kill()
                    last = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
                    raise UserError(f"etcd ({self.etcd_binary}) did not start: {last[-300:]}",
                                    f"see {log}; set {ETCD_ENV} to another etcd 3.5 binary") from None
                time.sleep(0.1)

    def start_node(self, node: Node) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **LAUNCH_ENVIRONMENT, **self.plan.env,
               # The launcher and the trainer from this checkout, wherever trainctl runs from.
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        node.proc = self._popen(self.plan.command(self.endpoint), node.log, env)
        node.started, node.code = time.monotonic(), None

    @staticmethod
    def _children(pid: int) -> set[int]:
        """An agent's workers now: its children, whichever of its threads started them (Linux's /proc)."""
        found: set[int] = set()
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                found.update(int(child) for child in (task / "children").read_text().split())
        return found

    def stop_all(self) -> None:
        """SIGTERM to every agent (its workers checkpoint), SIGKILL after STOP_GRACE_S or a second Ctrl-C; then etcd."""
        running = [n for n in self.nodes if n.proc and n.proc.poll() is None]
        for node in running:
            with contextlib.suppress(ProcessLookupError):
                node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while any(n.proc.poll() is None for n in running) and time.monotonic() < deadline and self.stop_requested < 2:
            time.sleep(0.1)
        workers: set[int] = set()
        for node in self.nodes:
            if node.proc is not None:
                if node.proc.poll() is None:
                    # The workers are in a session of their own: SIGKILLed with their agent, not through its group.
                    node_workers = self._children(node.proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(node.proc.pid, signal.SIGKILL)
                    for pid in node_workers:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    workers |= node_workers
                node.proc.wait()
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.terminate()
            try:
                self.etcd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.etcd.kill()
                self.etcd.wait()
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)

    # the run

    def _save(self, phase_: str, exit_code: int | None = None) -> None:
        self.state.update(phase=phase_, exit_code=exit_code, etcd={"endpoint": self.endpoint,
                                                                    "pid": self.etcd.pid if self.etcd else None},
                          nodes=[{"name": n.name, "pid": n.proc.pid if n.proc else None, "log": str(n.log),
                                  "ended": None if n.code is None else how_it_ended(n.code)} for n in self.nodes])
        write_state(self.job_dir, self.state)

    def _on_signal(self, signum, _frame) -> None:
        self.stop_requested += 1
        if self.stop_requested == 1:
            self.say(f"stopping ({signal.Signals(signum).name}): the workers checkpoint, up to {STOP_GRACE_S} s; "
                     "Ctrl-C again to kill them now")

    def run(self) -> int:
        plan = self.plan
        self.job_dir.mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            node.log.unlink(missing_ok=True)
        newest = max((s for p in plan.checkpoint_dir.glob("*") if (s := checkpoint_step(p.name)) is not None), default=None)
        self.state = {"name": plan.name, "pid": os.getpid(), "started": time.time(), "workdir": str(plan.root),
                      "checkpoints": str(plan.checkpoint_dir), "events": str(plan.events), "job_dir": str(self.job_dir),
                      "nodes_wanted": plan.nodes, "min_nodes": plan.min_nodes, "nproc_per_node": plan.nproc}
        self._offset = plan.events.stat().st_size if plan.events.exists() else 0  # this run's events only
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start_etcd()
            for node in self.nodes:
                self.start_node(node)
            self._save("Running")
            self._announce(newest)
            return self._supervise()
        finally:
            self.stop_all()
            self._drain_events()
            for node in self.nodes:  # how the agents stopped above ended
                if node.proc is not None and node.code is None:
                    node.code = node.proc.returncode
            if self.state.get("phase") == "Running":  # an error of trainctl's own ended the run
                self._save("Failed", 1)
            elif "phase" in self.state:  # not when etcd failed to start: nothing ran
                self._save(self.state["phase"], self.state["exit_code"])
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _announce(self, newest: int | None) -> None:
        plan, jobs = self.plan, self.job_dir
        self.say(f"local job {plan.name}: {plan.nodes} nodes × {plan.nproc} CPU worker(s), min_nodes {plan.min_nodes}")
        self.say(f"  etcd         {self.endpoint} (pid {self.etcd.pid}, log {jobs / 'etcd.log'})")
        self.say(f"  checkpoints  {plan.checkpoint_dir}"
                 + (f" (resuming: it holds step {newest}; delete it to start over)" if newest is not None else ""))
        self.say(f"  events       {plan.events}")
        self.say(f"  logs         {jobs}/node-<i>.log (trainctl logs {plan.name} --backend local --rank <i>)")
        for node in self.nodes:
            self.say(f"  {node.name}       pid {node.proc.pid}")
        self.say("lose a node: kill -9 <its pid> (it is replaced, as on EKS); stop: Ctrl-C or "
                 f"`trainctl cancel {plan.name} --backend local` (checkpoints are kept)")

    def _drain_events(self) -> None:
        found, self._offset = read_new_events(self.plan.events, self._offset)
        for event in found:
            self.finished |= event.get("event") == "finished"
            line = describe(event)
            if line:
                self.say(line)

    def _supervise(self) -> int:
        replacements: dict[str, float] = {}  # node -> when its replacement starts
        succeeded_at = None
        while True:
            self._drain_events()
            if self.stop_requested:
                self._save("Cancelled", 130)
                return 130
            now = time.monotonic()
            for node in self.nodes:
                if node.proc is None or node.code is not None:
                    continue
                code = node.proc.poll()
                if code is None:
                    continue
                node.code = code
                self.say(f"{node.name} (pid {node.proc.pid}) ended: {how_it_ended(code)}")
                if code == 0:
                    succeeded_at = succeeded_at or now
                elif code in FINAL_EXITS or code == EXIT_CRASH_LOOP:
                    self._drain_events()
                    self.say(f"{self.plan.name}: failed ({node.name}: {how_it_ended(code)}); see {node.log}")
                    self._save("Failed", 1)
                    return 1
                elif (code < 0 or code == EXIT_STOPPED) and succeeded_at is None:
                    replacements[node.name] = now + REPLACE_AFTER_S  # a lost node: Volcano's RestartPod
                self._save("Running")
            for node in self.nodes:
                due = replacements.get(node.name)
                if due is not None and now >= due and succeeded_at is None and not self.finished:
                    del replacements[node.name]
                    self.start_node(node)
                    self.say(f"{node.name} replaced: pid {node.proc.pid}")
                    self._save("Running")
            if self.etcd.poll() is not None:
                self.say(f"etcd (pid {self.etcd.pid}) ended: {how_it_ended(self.etcd.returncode)}; the job cannot go on")
                self._save("Failed", 1)
                return 1
            ended = [n for n in self.nodes if n.code is not None]
            if len(ended) == len(self.nodes) and (not replacements or self.finished):
                if succeeded_at is not None:
                    return self._completed()
                self.say(f"{self.plan.name}: failed; every node ended: "
                         + ", ".join(f"{n.name} {how_it_ended(n.code)}" for n in self.nodes))
                self._save("Failed", 1)
                return 1
            if succeeded_at is not None and now - succeeded_at > AFTER_SUCCESS_S:
                return self._completed()  # stop_all ends the rest
            time.sleep(POLL_S)

    def _completed(self) -> int:
        self._drain_events()
        self.say(f"{self.plan.name}: completed; checkpoints in {self.plan.checkpoint_dir}")
        self._save("Completed", 0)
        return 0


# --- the commands ---------------------------------------------------------------------------------

@dataclass
class LocalStatus:
    name: str
    phase: str
    nodes: list[dict]
    etcd: dict
    rendezvous: dict | None
    last_step: dict | None
    checkpoint: dict | None
    job_dir: str

    @property
    def finished(self) -> bool:
        return self.phase != "Running"

    @property
    def succeeded(self) -> bool:
        return self.phase == "Completed"

    def summary(self) -> str:
        return f"{self.name}: {self.phase}"

    def as_dict(self) -> dict:
        return {**asdict(self), "finished": self.finished}

    def format(self) -> str:
        lines = [f"job {self.name} (local): {self.phase}", "nodes:"]
        lines += [f"  {node['name']:<8} pid {node['pid']:<8} {node['ended'] or 'running'}" for node in self.nodes]
        lines.append(f"etcd: {self.etcd.get('endpoint')} (pid {self.etcd.get('pid')})")
        if (r := self.rendezvous) is not None:
            lines.append(f"rendezvous: world size {r['world_size']}, restart {r.get('restart_count', 0)}")
        if (s := self.last_step) is not None:
            lines.append(f"last step: {s['step']} (epoch {s.get('epoch', 0)}), loss {s['loss']}, "
                         f"{s.get('samples_per_s')} samples/s")
        if self.checkpoint:
            lines.append(f"newest checkpoint: {self.checkpoint['path']} (step {self.checkpoint['step']})")
        lines.append(f"logs: {self.job_dir}/node-<i>.log")
        return "\n".join(lines)


def read_status(root: Path, name: str) -> LocalStatus:
    state = read_state(root, name)
    events = read_events(state["events"])
    events = [e for e in events if e.get("time", 0) >= state["started"] - 1]

    def last(kind):
        return next((e for e in reversed(events) if e.get("event") == kind), None)

    steps = sorted(p for p in Path(state["checkpoints"]).glob("*") if checkpoint_step(p.name) is not None)
    checkpoint = {"path": str(steps[-1]), "step": checkpoint_step(steps[-1].name)} if steps else None
    return LocalStatus(name, phase(state), state.get("nodes", []), state.get("etcd") or {}, last("rendezvous"),
                       last("step"), checkpoint, state["job_dir"])


def _cancel(state: dict) -> None:
    """SIGTERM to the foreground trainctl, which stops its agents (they checkpoint) and etcd; wait until it is gone."""
    pid = state["pid"]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S + 20
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        raise UserError(f"trainctl (pid {pid}) running {state['name']} did not stop within {STOP_GRACE_S + 20} s",
                        f"kill -9 {pid} (its agents and etcd end with it)")


def _node_of(name: str, options: LogOptions, nodes: list[dict]) -> int:
    """--pod INDEX: node INDEX (the pod's analog); --rank N (default 0): the node whose agent says,
    in its newest ``node_ranks`` line, that its workers hold global rank N, as on EKS."""
    if options.pod is not None:
        if not 0 <= options.pod < len(nodes):
            raise UserError(f"--pod: got {options.pod}", f"allowed: a node from 0 to {len(nodes) - 1}")
        return options.pod
    rank = options.rank or 0
    claims = {}
    for index, node in enumerate(nodes):
        with contextlib.suppress(OSError):
            claims[index] = rank_claim(Path(node["log"]).read_text(errors="replace"), rank)
    return newest_claim(claims, rank, name, "node", f"in `trainctl status {name} --backend local`")


class LocalBackend(Backend):
    name = "local"
    options = {
        "submit": frozenset({"--replace", "--wait", "--nodes", "--nproc-per-node", "--workdir"}),
        "status": frozenset({"--watch", "-o", "--workdir"}),
        "logs": frozenset({"--rank", "--pod", "--all", "--follow", "--workdir"}),
        "cancel": frozenset({"--workdir"}),
        "list": frozenset({"-o", "--workdir"}),
    }
    hints = {"logs": "each node's log holds all its runs", "submit": "there is no EFA or NCCL on CPU; "
             "`trainctl render JOB` for a dry run; the job runs in the foreground"}

    @property
    def root(self) -> Path:
        workdir = self.connection.workdir
        return Path(workdir).expanduser().resolve() if workdir else default_root()

    @classmethod
    def where(cls, connection: Connection, command: str) -> str:
        return "this machine (--backend local, CPU)"

    def submit(self, spec: JobSpec, options: SubmitOptions) -> Submitted:
        root = self.root
        local = plan(spec, self.config, root, options.nodes, options.nproc_per_node or 1)
        etcd = etcd_binary()
        check_torch()
        state = None
        with contextlib.suppress(UserError):
            state = read_state(root, spec.name)
        if state is not None and state["phase"] == "Running" and alive(state.get("pid")):
            if not options.replace:
                raise UserError(f"job {spec.name!r} is running locally (trainctl pid {state['pid']})",
                                "choose another name, pass --replace to stop it first, or "
                                f"`trainctl cancel {spec.name} --backend local`")
            _cancel(state)
        return Submitted(spec.name, exit_code=LocalRun(local, etcd).run())

    def status(self, name: str) -> LocalStatus:
        return read_status(self.root, name)

    def jobs(self) -> list[dict]:
        rows = []
        for path in sorted((self.root / "jobs").glob("*/state.json")):
            with contextlib.suppress(UserError):
                rows.append({"name": path.parent.name, "state": phase(read_state(self.root, path.parent.name))})
        return rows

    def nothing_listed(self) -> str:
        return f"no local jobs in {self.root}"

    def logs(self, name: str, options: LogOptions) -> None:
        nodes = read_state(self.root, name).get("nodes", [])
        if options.all:
            for node in nodes:
                with contextlib.suppress(OSError):
                    for line in Path(node["log"]).read_text(errors="replace").splitlines():
                        print(f"[{node['name']}] {line}")
            return
        path = Path(nodes[_node_of(name, options, nodes)]["log"])
        offset = 0
        while True:
            with contextlib.suppress(OSError), open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
                offset += len(chunk)
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            if not options.follow or phase(read_state(self.root, name)) != "Running":
                return
            time.sleep(POLL_S)

    def cancel(self, name: str) -> str:
        state = read_state(self.root, name)
        if phase(state) != "Running":
            raise UserError(f"local job {name!r} is not running ({phase(state)})", "nothing to cancel")
        _cancel(state)
        return f"cancelled {name}; checkpoints stay in {state['checkpoints']}"


BACKEND = LocalBackend
