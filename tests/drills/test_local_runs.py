"""``trainctl submit --backend local`` as users run it: a real etcd and real agents on this machine.

A node's agent is SIGKILLed mid-run and the job still completes, every sample trained once; a
Ctrl-C stops everything with a checkpoint, and the next submit resumes and completes. After each
command, none of its processes is left.
"""

from __future__ import annotations

import json

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from tests.trainctl_fixtures import one_error
from tests.conftest import REPO
from tests.drill_harness import GLOBAL_BATCH, every_sample_once
from trainctl.backends.local_cluster import wait_until

pytestmark = pytest.mark.timeout(400)

# 8,000 steps of the drills' global batch: one node alone needs ~35 s on an idle 2-core machine, time enough
# for the cancel drill's status and cancel.
SAMPLES = 256_000
# The killed run is held to 100 steps/s a node alone (3,200 samples/s each: 200 steps/s for two, more than
# 2 cores give them), 2,500 steps: the survivor alone needs at least 25 s on any machine, against about 10 s
# for the replacement's 5 s wait and its start here, admitted at once (the round has trained its 3 s by
# then); 4,000 steps asserted nothing more and cost 15 s at two nodes after the replacement joined.
# Unpaced, 8,000 steps, it was sized for the fastest machine (the survivor alone needed ~35 s here:
# 225 steps/s) and trained 45 s more at two nodes after the replacement joined; with 600 steps it
# finished in 2 s, before the replacement came.
KILLED_SAMPLES = 2_500 * 32
KILLED_SAMPLES_PER_S = 3_200


def job_spec(tmp_path: Path, name: str, samples: int = SAMPLES, samples_per_s: float | None = None) -> Path:
    """A two-node job of the drills' small MLP, logging every sample id it trains on; ``samples_per_s``: each
    node's pace (data.synthetic_samples_per_s)."""
    spec = {
        "name": name, "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainer:gpu-0.1.0", "node_group": "p4d",
        "min_nodes": 1, "max_nodes": 2, "scale_up_after_s": 3, "checkpoint_path": f"/fsx/{name}/checkpoints",
        "trainer_args": {
            "model.name": "mlp", "model.image_size": 16, "model.num_classes": 10, "eval.enabled": False,
            "data.synthetic_samples": samples, "data.num_workers": 0, "train.global_batch_size": GLOBAL_BATCH,
            "train.micro_batch_size": 16, "train.epochs": 1, "train.precision": "fp32", "train.log_every_steps": 5,
            "optim.lr": 0.05, "checkpoint.interval_steps": 25, "metrics.sample_log_dir": f"/fsx/{name}/samples",
        },
    }
    if samples_per_s:
        spec["trainer_args"]["data.synthetic_samples_per_s"] = samples_per_s
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


class Submit:
    """``trainctl submit`` in the foreground, its output collected line by line as it comes."""

    def __init__(self, spec: Path, workdir: Path, nodes: int = 2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.proc = subprocess.Popen([sys.executable, "-m", "trainctl", "submit", str(spec), "--backend", "local",
                                      "--workdir", str(workdir), "--nodes", str(nodes)], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.seen: set[int] = set()  # every process it started, workers too
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, count: int = 1) -> list[re.Match]:
        def found():
            self.note_processes()
            matches = [m for line in list(self.lines) if (m := re.search(pattern, line))]
            return matches if len(matches) >= count else None

        try:
            return wait_until(found, pattern, timeout=180, poll=0.2)
        except TimeoutError:
            raise AssertionError(f"no {pattern!r} in:\n{self.output}") from None

    def note_processes(self) -> None:
        """The agents and etcd it printed, and the agents' workers (their children) now."""
        for line in list(self.lines):
            if m := re.search(r"pid (\d+)", line):
                pid = int(m.group(1))
                self.seen.add(pid)
                for task in Path(f"/proc/{pid}/task").glob("*"):
                    try:
                        self.seen.update(int(p) for p in (task / "children").read_text().split())
                    except (OSError, ValueError):
                        continue

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=300)
        finally:
            self.stop()
            self.reader.join(timeout=10)  # every line it wrote is in self.lines

    def stop(self) -> None:
        """After a failed wait: stop it as cancel does (it ends its agents and etcd), then for good."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def left_over(pids: set[int]) -> list[str]:
    """Those of ``pids`` still running (a zombie has ended), with their command lines."""
    found = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        if state != "Z":
            found.append(f"{pid} {command[:120]}")
    return found


def trainctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainctl", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """Two nodes; node-1's agent is SIGKILLed once both train; the job runs to its end."""
    tmp = tmp_path_factory.mktemp("local")
    workdir = tmp / "work"
    submit = Submit(job_spec(tmp, "killed", KILLED_SAMPLES, KILLED_SAMPLES_PER_S), workdir)
    try:
        victim = int(submit.wait_for(r"^  node-1 +pid (\d+)")[0].group(1))
        submit.wait_for(r"world size 2$", count=3)
        submit.note_processes()
        os.kill(victim, signal.SIGKILL)
        replacement = int(submit.wait_for(r"^node-1 replaced: pid (\d+)")[0].group(1))
    finally:
        code = submit.wait()
    return {"code": code, "submit": submit, "victim": victim, "replacement": replacement, "workdir": workdir}


def test_a_node_killed_mid_run_is_survived_and_the_job_completes(killed_run):
    submit = killed_run["submit"]
    assert killed_run["code"] == 0, submit.output
    output = submit.output
    assert f"node-1 (pid {killed_run['victim']}) ended: killed by SIGKILL" in output
    after_kill = output[output.index("killed by SIGKILL"):]
    assert re.search(r"round of 1 worker\(s\) on cpu", after_kill) and "resuming from step" in after_kill
    # Replaced, as Volcano's RestartPod does: it joins the job, or comes after its end and has nothing to do.
    assert f"node-1 (pid {killed_run['replacement']}) ended: exit 0" in after_kill
    assert output.splitlines()[-1].startswith("killed: completed; checkpoints in ")
    assert every_sample_once(killed_run["workdir"] / "fsx" / "killed", KILLED_SAMPLES)


def test_nothing_it_started_is_left_running(killed_run):
    submit = killed_run["submit"]
    assert len(submit.seen) >= 5  # etcd, two agents, their workers
    assert left_over(submit.seen) == []


def test_status_logs_and_list_read_the_finished_job(killed_run):
    work = ["--backend", "local", "--workdir", str(killed_run["workdir"])]
    status = trainctl("status", "killed", *work)
    assert status.returncode == 0 and status.stdout.startswith("job killed (local): Completed\n"), status
    assert "newest checkpoint:" in status.stdout and f"(step {KILLED_SAMPLES // GLOBAL_BATCH})" in status.stdout
    assert f"node-1   pid {killed_run['replacement']}" in status.stdout  # the replacement, not the lost node
    logs = trainctl("logs", "killed", *work, "--rank", "0")
    assert logs.returncode == 0 and "training.launcher" in logs.stdout
    # --rank: the node holding global rank 0 in the last round (the survivor, node-0, which finished
    # alone or with node-1 after it rejoined); --pod 1: the replacement's log, whatever its rank.
    last = [line for line in logs.stdout.splitlines() if line.startswith('{"event": "node_ranks"')][-1]
    assert 0 in json.loads(last)["global_ranks"]
    replacement = trainctl("logs", "killed", *work, "--pod", "1")
    assert replacement.returncode == 0 and replacement.stdout != logs.stdout
    listed = trainctl("list", *work)
    assert listed.stdout.split() == ["killed", "Completed"]
    cancel = trainctl("cancel", "killed", *work)
    assert cancel.returncode == 2 and one_error(cancel.stderr) == (
        "error: local job 'killed' is not running (Completed); fix: nothing to cancel")


def test_ctrl_c_stops_everything_with_a_checkpoint_and_the_next_submit_resumes(tmp_path):
    # 1,000 steps, held to 100 steps/s for a node alone: a second node that comes late still finds the job
    # running when it is admitted (the SIGINT waits for a step at world size 2), on a fast machine too.
    spec = job_spec(tmp_path, "stopped", samples=32_000, samples_per_s=KILLED_SAMPLES_PER_S)
    first = Submit(spec, tmp_path / "work")
    try:
        first.wait_for(r"^step \d+ .*world size 2$")
        first.note_processes()
    finally:
        first.proc.send_signal(signal.SIGINT)
    assert first.wait() == 130, first.output
    # The stop the SIGINT asked for; a round changed before it (a late second node admitted in place)
    # prints "changing rounds at step N", which is not a stop and saves no checkpoint.
    stops = re.findall(r"^stopped at step (\d+) \(SIGTERM\); checkpoint saved$", first.output, re.M)
    assert "stopping (SIGINT)" in first.output and len(stops) == 1, first.output
    assert left_over(first.seen) == []
    status = trainctl("status", "stopped", "--backend", "local", "--workdir", str(tmp_path / "work"))
    assert status.stdout.startswith("job stopped (local): Cancelled"), status
    assert re.findall(r"node-\d +pid \d+ +(.+)", status.stdout) == ["exit 143 (stopped by SIGTERM)"] * 2, status.stdout

    stopped_at = int(stops[0])
    second = Submit(spec, tmp_path / "work")
    assert second.wait() == 0, second.output
    assert f"resuming from step {stopped_at}" in second.output, second.output
    assert second.output.splitlines()[-1].startswith("stopped: completed")
    assert left_over(second.seen) == []


def test_cancel_stops_a_running_submit_and_waits_until_it_is_gone(tmp_path):
    submit = Submit(job_spec(tmp_path, "cancelled"), tmp_path / "work", nodes=1)
    try:
        submit.wait_for(r"^round of 1 worker")
        submit.note_processes()
        work = ["--backend", "local", "--workdir", str(tmp_path / "work")]
        running = trainctl("status", "cancelled", *work)
        cancel = trainctl("cancel", "cancelled", *work)
        exit_when_cancel_returned = submit.proc.poll()
    finally:
        submit.wait()
    assert running.stdout.startswith("job cancelled (local): Running\n"), running
    assert cancel.returncode == 0 and cancel.stdout.startswith("cancelled cancelled; checkpoints stay in "), cancel
    assert exit_when_cancel_returned == 130 and "stopping (SIGTERM)" in submit.output
    assert left_over(submit.seen) == []
