"""The generated sbatch script on a real Slurm (Debian's slurmctld and two slurmd on loopback).

A two-node job trains; the node running its batch script (the rendezvous host) is killed; Slurm
sets it DOWN, requeues the job, and the script runs again on the node left; the trainer resumes from
its newest checkpoint and the job completes with every sample trained once. trainctl's Slurm backend
reports the job throughout and cancels another one, which stops with a checkpoint inside KillWait.
"""

from __future__ import annotations

import json
import shutil
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.slurm_cluster import SlurmCluster, missing
from tests.trainctl_fixtures import one_error
from trainctl.backends.slurm import log_folder
from tests.drill_harness import GLOBAL_BATCH, INTERVAL, every_sample_once, final_checkpoint
from trainctl.backends.local_cluster import wait_until

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(missing() is not None, reason=f"no real Slurm here: {missing()}")]

PARTITION = "g5"
# 1,000 steps of the drills' global batch. The kill lands after step 150 (at about 240 here: the
# wait's poll and trainctl's status come first), while two nodes train about 100 steps a second on
# an idle 2-core machine: a machine three times as fast would still be killed near step 450, and the
# requeued incarnation has most of the job left to train (1,500 steps asserted nothing more and cost
# 4 s; 3,000 spent 19 s). The first incarnation has written 6 checkpoints by step 150 (about 9 where the
# kill lands here), so resuming from the newest of them is not resuming from any.
SAMPLES = 32_000
KILL_AFTER_STEP = 150


def platform_config() -> dict:
    raw = yaml.safe_load((REPO / "config/example.yaml").read_text())
    # One accelerator per node (the catalog's g5.xlarge): one worker per node, on CPU here.
    raw["accelerated_node_groups"].append(
        {"name": PARTITION, "instance_type": "g5.xlarge", "min_size": 0, "desired_size": 0, "max_size": 2})
    raw["slurm"] = {"queues": [{"node_group": PARTITION}]}
    return raw


def job_spec(name: str, samples: int = SAMPLES) -> dict:
    return {
        "name": name, "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainer:gpu-0.1.0",
        "node_group": PARTITION, "min_nodes": 1, "max_nodes": 2, "checkpoint_path": f"/fsx/{name}/checkpoints",
        "trainer_args": {
            "model.name": "mlp", "model.image_size": 16, "model.num_classes": 10, "eval.enabled": False,
            "data.synthetic_samples": samples, "data.num_workers": 0, "train.global_batch_size": GLOBAL_BATCH,
            "train.micro_batch_size": 16, "train.epochs": 1, "train.precision": "fp32", "train.log_every_steps": 5,
            "train.device": "cpu", "optim.lr": 0.05, "checkpoint.interval_steps": INTERVAL,
            "metrics.sample_log_dir": f"/fsx/{name}/samples",
        },
    }


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith('{"event"')]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), partition=PARTITION).start()
    (cluster.root / "platform.yaml").write_text(yaml.safe_dump(platform_config()))
    yield cluster
    cluster.stop()


def trainctl(slurm: SlurmCluster, *args: str) -> subprocess.CompletedProcess:
    """trainctl as an operator runs it on the head node (--on-head-node): Slurm's commands and /fsx are there."""
    argv = [sys.executable, "-m", "trainctl", "--config", str(slurm.root / "platform.yaml"), *args,
            "--backend", "slurm", "--on-head-node"]
    return subprocess.run(slurm.head_node(argv), cwd=REPO, capture_output=True, text=True, timeout=120)


def status(slurm: SlurmCluster, name: str) -> dict:
    done = trainctl(slurm, "status", name, "-o", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def submit(slurm: SlurmCluster, name: str, samples: int = SAMPLES) -> str:
    path = slurm.root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job_spec(name, samples)))
    # The nodes run the launcher from this project's Python (no Pyxis here): --python.
    done = trainctl(slurm, "submit", str(path), "--python", sys.executable)
    assert done.returncode == 0, done.stderr
    found = re.search(r"^submitted \S+ to Slurm \(job (\d+)\)", done.stdout, flags=re.M)
    assert found, done.stdout
    return found.group(1)


def requeue_time(slurm: SlurmCluster, job_id: str) -> float:
    """When slurmctld requeued the job, from its log (local time, as slurmctld writes it)."""
    for line in (slurm.root / "log" / "slurmctld.log").read_text().splitlines():
        if found := re.match(rf"\[(\S+)\] requeue job JobId={job_id} due to failure of node", line):
            return datetime.fromisoformat(found.group(1)).timestamp()
    raise AssertionError(f"slurmctld never requeued job {job_id}")


@pytest.fixture(scope="module")
def requeued(slurm):
    """The drill: two nodes train, the batch host is killed mid-run, the job is requeued and completes."""
    name = "requeue"
    job_id = submit(slurm, name)
    node0 = slurm.fsx / log_folder(name).removeprefix("/fsx/") / "node-0.log"

    def trained_past_kill_point():
        steps = [e for e in events(node0) if e["event"] == "step"]
        return steps and steps[-1]["step"] >= KILL_AFTER_STEP and steps[-1]["world_size"] == 2

    wait_until(trained_past_kill_point, "two nodes training past the kill point", timeout=180, poll=0.2)
    before = status(slurm, name)
    details = slurm.run("scontrol", "show", "job", job_id, "--oneline").stdout.split()
    batch_host = dict(f.split("=", 1) for f in details if "=" in f)["BatchHost"]
    killed_at = time.time()
    slurm.kill_node(batch_host)
    wait_until(lambda: status(slurm, name)["finished"], "the requeued job to finish", timeout=300, poll=1)
    # The instance comes back (ReturnToService=2): the later jobs have both nodes again.
    slurm.start_node(batch_host)
    slurm._wait(lambda: slurm.idle_nodes() == set(slurm.nodes), "both nodes idle again")
    return {"name": name, "job_id": job_id, "before": before, "after": status(slurm, name), "batch_host": batch_host,
            "killed_at": killed_at, "node0": events(node0), "requeued_at": requeue_time(slurm, job_id)}


def test_the_job_trains_on_two_nodes_and_trainctl_reports_it(requeued):
    before = requeued["before"]
    assert before["state"] == "RUNNING" and before["nodes"] == 2 and before["restarts"] == 0
    assert [i["nodes"] for i in before["incarnations"]] == [2]
    assert before["last_step"]["world_size"] == 2 and before["last_step"]["step"] >= KILL_AFTER_STEP


def test_a_lost_node_requeues_the_job_which_resumes_exactly_and_completes(requeued, slurm):
    after = requeued["after"]
    assert after["state"] == "COMPLETED", after
    assert after["restarts"] == 1
    assert [(i["restart"], i["nodes"]) for i in after["incarnations"]] == [(0, 2), (1, 1)]
    assert requeued["batch_host"] not in after["incarnations"][1]["nodelist"]
    node0 = requeued["node0"]
    incarnation = [i for i, e in enumerate(node0) if e["event"] == "resume"]
    assert len(incarnation) == 1, "exactly one resume, in the requeued incarnation"
    first_run, second_run = node0[:incarnation[0]], node0[incarnation[0]:]
    saved = [e["step"] for e in first_run if e["event"] == "checkpoint_saved"]
    resume = second_run[0]
    # From the newest checkpoint the first incarnation wrote: nothing it saved is lost.
    assert resume["step"] == max(saved)
    assert {e["world_size"] for e in second_run if e["event"] == "step"} == {1}
    assert second_run[-1]["event"] == "finished" and second_run[-1]["step"] == SAMPLES // GLOBAL_BATCH
    assert every_sample_once(slurm.fsx / requeued["name"], SAMPLES)
    first_step = next(e for e in second_run if e["event"] == "step")
    figures = {"steps_lost": steps_trained_twice(slurm.fsx / requeued["name"]),
               "requeue_to_first_step_s": round(first_step["time"] - requeued["requeued_at"], 1),
               "requeue_to_script_start_s": round(after["incarnations"][1]["time"] - requeued["requeued_at"], 1),
               "kill_to_requeue_s": round(requeued["requeued_at"] - requeued["killed_at"], 1),
               "hold_s": slurm.cred_expire_s + 1}
    print(f"\nslurm requeue drill: {json.dumps(figures)}")


def steps_trained_twice(work: Path) -> int:
    """Steps the first incarnation trained past the checkpoint the job resumed from (from every rank's
    sample log, which records each step trained; the checkpoint's history says which steps counted)."""
    (first_attempt, _first, counted_end), *_ = final_checkpoint(work)["progress"]["history"]
    trained = {json.loads(line)["step"] for log in (work / "samples").glob("*.jsonl")
               for line in log.read_text().splitlines() if json.loads(line)["attempt"] == first_attempt}
    return len({step for step in trained if step >= counted_end})


def test_logs_by_rank_and_by_node(requeued, slurm):
    rank0 = trainctl(slurm, "logs", requeued["name"], "--rank", "0")
    assert rank0.returncode == 0, rank0.stderr
    assert '"event": "finished"' in rank0.stdout  # node 0 of the last incarnation held rank 0
    node1 = trainctl(slurm, "logs", requeued["name"], "--pod", "1")
    assert node1.returncode == 0 and '"global_ranks": [1]' in node1.stdout  # the killed incarnation's second node
    missing_rank = trainctl(slurm, "logs", requeued["name"], "--rank", "5")
    assert missing_rank.returncode == 2 and one_error(missing_rank.stderr).startswith(
        "error: --rank: got 5, which no node of requeue holds now")


def test_a_second_submit_is_refused_and_cancel_stops_the_job_with_a_checkpoint_inside_kill_wait(slurm, requeued):
    name = "cancelled"
    submit(slurm, name, samples=2_000_000)
    node0 = slurm.fsx / log_folder(name).removeprefix("/fsx/") / "node-0.log"
    wait_until(lambda: any(e["event"] == "checkpoint_saved" for e in events(node0)), "a first checkpoint",
               timeout=180, poll=0.2)
    # The job is running (it checkpointed): the same job submitted again is refused, and nothing else
    # changes (one job of that name in the list below). This job, not one of its own: a job's start is 3-5 s.
    again = trainctl(slurm, "submit", str(slurm.root / f"{name}.yaml"), "--python", sys.executable)
    assert again.returncode == 2 and re.fullmatch(
        rf"error: job '{name}' is already RUNNING as Slurm job \d+; fix: wait for it, cancel it "
        rf"\(`trainctl cancel {name} --backend slurm`\), or rename the job", one_error(again.stderr))
    cancel = trainctl(slurm, "cancel", name)
    assert cancel.returncode == 0 and cancel.stdout.startswith(f"cancelled {name} (Slurm job "), cancel
    wait_until(lambda: status(slurm, name)["finished"], "the cancelled job to end", timeout=slurm.kill_wait_s + 30,
               poll=1)
    assert status(slurm, name)["state"] == "CANCELLED"
    ended = events(node0)
    stop = next(e for e in reversed(ended) if e["event"] == "stop")
    saved = [e for e in ended if e["event"] == "checkpoint_saved"]
    assert stop["signal"] == "SIGTERM" and saved[-1]["step"] == stop["step"], "a stop checkpoint where it stopped"
    for node in slurm.nodes:  # nothing of the job is left on either node
        assert slurm.node_processes_left(node) == []
    listed = trainctl(slurm, "list", "-o", "json")
    assert {row["name"]: row["state"] for row in json.loads(listed.stdout)} == {
        "requeue": "COMPLETED", "cancelled": "CANCELLED"}
    again = trainctl(slurm, "cancel", name)
    assert again.returncode == 2 and one_error(again.stderr) == (
        f"error: no active Slurm job '{name}' of platform mltrain; fix: nothing to cancel; "
        "see `trainctl list --backend slurm`")


def test_a_jobs_own_program_runs_under_the_same_script(slurm, requeued):
    """A torchrun program of the job's own (FSDP2 and DCP, tests/programs/fsdp_dcp.py) on both nodes."""
    name = "own-program"
    program = slurm.fsx / "programs" / "fsdp_dcp.py"
    program.parent.mkdir(exist_ok=True)
    shutil.copy(REPO / "tests" / "programs" / "fsdp_dcp.py", program)
    spec = {key: value for key, value in job_spec(name).items() if key != "trainer_args"}
    spec["program"] = {"script": "/fsx/programs/fsdp_dcp.py",
                       "args": ["--steps=40", "--interval=10", f"--loss-file=/fsx/{name}/loss.jsonl"]}
    (slurm.fsx / name).mkdir()
    path = slurm.root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    # A poll a second: at the default 10 s, --wait returned up to 10 s after the job ended.
    done = trainctl(slurm, "submit", str(path), "--python", sys.executable, "--wait", "--interval", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [json.loads(line) for line in (slurm.fsx / name / "loss.jsonl").read_text().splitlines()]
    assert [e["world_size"] for e in losses if e["event"] == "start"] == [2]  # both nodes, the killed one back
    assert [e["step"] for e in losses if e["event"] == "step"] == list(range(1, 41))
    # Its checkpoints went where the platform told it: $PLATFORM_CHECKPOINT_DIR, the spec's checkpoint_path.
    assert sorted(p.name for p in (slurm.fsx / name / "checkpoints").iterdir() if not p.name.startswith("."))[-1] == (
        "step-40")


def test_the_same_status_through_ssm_run_command(slurm, requeued, tmp_path, monkeypatch):
    """trainctl's default path: SSM Run Command on the head node (a loopback stand-in that really runs what
    it is sent, tests/local_ssm.py), here reaching the real Slurm; the head node found by its tags (moto)."""
    from moto import mock_aws

    from tests.local_ssm import LocalSsm
    from tests.drills.test_slurm_transport import REGION, launch
    from trainctl.backends.slurm import SlurmJobs
    from trainctl.backends.slurm_transport import SsmShell
    from config import PlatformConfig

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.setenv(key, "testing")
    config = PlatformConfig.model_validate(platform_config())
    # No sudo or second user here: a `sudo` that checks SsmShell's options and runs the rest as on the head node.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    head_node = " ".join(f"'{word}'" for word in slurm.head_node([]))
    (bin_dir / "sudo").write_text('#!/bin/sh\n[ "$1" = -H ] && [ "$2" = -u ] && [ "$3" = ec2-user ] && [ "$4" = -- ] '
                                  '|| exit 90\nshift 4\nexec ' + head_node + ' "$@"\n')
    (bin_dir / "sudo").chmod(0o755)
    with mock_aws():
        import boto3

        session = boto3.Session(region_name=REGION)
        instance = launch(session, config.slurm_cluster_name)
        with LocalSsm({instance: "Online"}, env={"PATH": f"{bin_dir}:/usr/bin:/bin"}) as ssm:
            monkeypatch.setenv("AWS_ENDPOINT_URL_SSM", ssm.url)
            shell = SsmShell(session, region=REGION, cluster_name=config.slurm_cluster_name, poll_s=0.05)
            report = SlurmJobs(shell, config).status(requeued["name"])
    assert report.as_dict() == requeued["after"]  # what `trainctl status -o json` said on the head node
    assert report.where == f"head node {instance} of cluster {config.slurm_cluster_name} (SSM)"
    assert all(sent["Parameters"]["commands"] for sent in ssm.sent)


def test_a_launcher_asking_for_a_fresh_incarnation_requeues_the_job(slurm, requeued):
    """Node 0's workers fail for good after progress: its launcher exits 79 while srun stops node 1's
    (143) and returns the highest status, 143; the marker file still makes the script requeue the job."""
    name = "fresh-incarnation"
    program = slurm.fsx / "programs" / "fail_once.py"
    program.parent.mkdir(exist_ok=True)
    shutil.copy(REPO / "tests" / "programs" / "fail_once.py", program)
    spec = {key: value for key, value in job_spec(name).items() if key != "trainer_args"}
    spec.update(min_nodes=2, max_restarts=0, program={"script": "/fsx/programs/fail_once.py"})
    path = slurm.root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    done = trainctl(slurm, "submit", str(path), "--python", sys.executable, "--wait", "--interval", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    report = status(slurm, name)
    assert report["state"] == "COMPLETED" and report["restarts"] == 1
    logs = slurm.fsx / log_folder(name).removeprefix("/fsx/")
    node0 = (logs / "node-0.log").read_text()
    assert "rank 0: failing for good" in node0 and "a fresh incarnation finds ['step-1'], done" in node0
    assert "srun: error: node2: task 1: Exited with exit code 143" in (logs / "batch.log").read_text()
    assert sorted(p.name for p in logs.glob("restart-*")) == [f"restart-{report['job_id']}-0"]
