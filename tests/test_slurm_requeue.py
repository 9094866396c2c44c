"""The generated sbatch script on a real Slurm (Debian's slurmctld and two slurmd on loopback).

A two-node job trains; the node running its batch script (the rendezvous host) is killed; Slurm
sets it DOWN, requeues the job, and the script runs again on the node left; the trainer resumes from
its newest checkpoint and the job completes with every sample trained once. trainctl's Slurm backend
reports the job throughout and cancels another one, which stops with a checkpoint inside KillWait.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from config import PlatformConfig
from k8s_charts.job_spec import parse_job_spec
from tests.slurm_cluster import SlurmCluster, missing
from trainctl.slurm import SlurmJobs, SlurmRuntime, log_folder, render_script
from trainctl.slurm_transport import LocalShell
from training.devtools.drills import GLOBAL_BATCH, INTERVAL, every_sample_once
from training.devtools.local_cluster import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(missing() is not None, reason=f"no real Slurm here: {missing()}")]

PARTITION = "g5"
# 3,000 steps of the drills' global batch: ~10 s on two nodes of an idle 2-core machine, so the kill
# lands mid-run (after step 300) and the requeued incarnation has most of the job left to train.
SAMPLES = 96_000
KILL_AFTER_STEP = 300


def platform_config() -> PlatformConfig:
    raw = yaml.safe_load(Path("config/example.yaml").read_text())
    # One accelerator per node (the catalog's g5.xlarge): one worker per node, on CPU here.
    raw["accelerated_node_groups"].append(
        {"name": PARTITION, "instance_type": "g5.xlarge", "min_size": 0, "desired_size": 0, "max_size": 2})
    return PlatformConfig.model_validate(raw)


def job_spec(config: PlatformConfig, name: str, samples: int = SAMPLES):
    return parse_job_spec({
        "name": name, "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainer:gpu-0.1.0",
        "node_group": PARTITION, "min_nodes": 1, "max_nodes": 2, "checkpoint_path": f"/fsx/{name}/checkpoints",
        "trainer_args": {
            "model.name": "mlp", "model.image_size": 16, "model.num_classes": 10, "eval.enabled": False,
            "data.synthetic_samples": samples, "data.num_workers": 0, "train.global_batch_size": GLOBAL_BATCH,
            "train.micro_batch_size": 16, "train.epochs": 1, "train.precision": "fp32", "train.log_every_steps": 5,
            "train.device": "cpu", "optim.lr": 0.05, "checkpoint.interval_steps": INTERVAL,
            "metrics.sample_log_dir": f"/fsx/{name}/samples",
        },
    }, config)


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith('{"event"')]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), partition=PARTITION).start()
    yield cluster
    cluster.stop()


class HeadNode(LocalShell):
    """trainctl's commands as on the head node: Slurm's tools, and the shared file system at /fsx."""

    def __init__(self, slurm: SlurmCluster):
        self.slurm = slurm

    def run(self, argv, *, input=None, timeout=60):
        return super().run(self.slurm.head_node(list(argv)), input=input, timeout=timeout)


@pytest.fixture(scope="module")
def jobs(slurm):
    return SlurmJobs(HeadNode(slurm), platform_config())


def submit(jobs: SlurmJobs, slurm: SlurmCluster, name: str, samples: int = SAMPLES) -> str:
    config = jobs.config
    script = render_script(config, job_spec(config, name, samples), partition=PARTITION,
                           kill_wait_s=slurm.kill_wait_s, runtime=SlurmRuntime(python=sys.executable))
    return jobs.submit(job_spec(config, name, samples), script)


def requeue_time(slurm: SlurmCluster, job_id: str) -> float:
    """When slurmctld requeued the job, from its log (local time, as slurmctld writes it)."""
    for line in (slurm.root / "log" / "slurmctld.log").read_text().splitlines():
        if found := re.match(rf"\[(\S+)\] requeue job JobId={job_id} due to failure of node", line):
            return datetime.fromisoformat(found.group(1)).timestamp()
    raise AssertionError(f"slurmctld never requeued job {job_id}")


@pytest.fixture(scope="module")
def requeued(slurm, jobs):
    """The drill: two nodes train, the batch host is killed mid-run, the job is requeued and completes."""
    name = "requeue"
    job_id = submit(jobs, slurm, name)
    node0 = slurm.fsx / log_folder(name).removeprefix("/fsx/") / "node-0.log"

    def trained_past_kill_point():
        steps = [e for e in events(node0) if e["event"] == "step"]
        return steps and steps[-1]["step"] >= KILL_AFTER_STEP and steps[-1]["world_size"] == 2

    wait_until(trained_past_kill_point, "two nodes training past the kill point", timeout=180, poll=0.2)
    before = jobs.status(name)
    batch_host = dict(f.split("=", 1) for f in slurm.run("scontrol", "show", "job", job_id, "--oneline").stdout.split()
                      if "=" in f)["BatchHost"]
    killed_at = time.time()
    slurm.kill_node(batch_host)
    wait_until(lambda: jobs.status(name).finished, "the requeued job to finish", timeout=300, poll=1)
    return {"name": name, "job_id": job_id, "before": before, "after": jobs.status(name), "batch_host": batch_host,
            "killed_at": killed_at, "node0": events(node0), "requeued_at": requeue_time(slurm, job_id)}


def test_the_job_trains_on_two_nodes_and_trainctl_reports_it(requeued):
    before = requeued["before"]
    assert before.state == "RUNNING" and before.nodes == 2 and before.restarts == 0
    assert [i["nodes"] for i in before.incarnations] == [2]
    assert before.last_step["world_size"] == 2 and before.last_step["step"] >= KILL_AFTER_STEP


def test_a_lost_node_requeues_the_job_which_resumes_exactly_and_completes(requeued, slurm):
    after = requeued["after"]
    assert after.state == "COMPLETED", after.format()
    assert after.restarts == 1
    assert [(i["restart"], i["nodes"]) for i in after.incarnations] == [(0, 2), (1, 1)]
    assert requeued["batch_host"] not in after.incarnations[1]["nodelist"]
    node0 = requeued["node0"]
    incarnation = [i for i, e in enumerate(node0) if e["event"] == "resume"]
    assert len(incarnation) == 1, "exactly one resume, in the requeued incarnation"
    first_run, second_run = node0[:incarnation[0]], node0[incarnation[0]:]
    saved = [e["step"] for e in first_run if e["event"] == "checkpoint_saved"]
    resume = second_run[0]
    # From the newest checkpoint the first incarnation wrote: nothing it saved is lost.
    assert resume["step"] == max(saved)
    assert [e["world_size"] for e in second_run if e["event"] == "step"] and {
        e["world_size"] for e in second_run if e["event"] == "step"} == {1}
    assert second_run[-1]["event"] == "finished" and second_run[-1]["step"] == SAMPLES // GLOBAL_BATCH
    assert every_sample_once(slurm.fsx / requeued["name"], SAMPLES)
    reached = max(e["step"] for e in first_run if e["event"] == "step")
    first_step = next(e for e in second_run if e["event"] == "step")
    figures = {"steps_lost": reached - resume["step"],
               "requeue_to_first_step_s": round(first_step["time"] - requeued["requeued_at"], 1),
               "kill_to_requeue_s": round(requeued["requeued_at"] - requeued["killed_at"], 1),
               "hold_s": slurm.cred_expire_s + 1}
    print(f"\nslurm requeue drill: {json.dumps(figures)}")


def test_cancel_stops_the_job_with_a_checkpoint_inside_kill_wait(slurm, jobs):
    name = "cancelled"
    submit(jobs, slurm, name, samples=2_000_000)
    node0 = slurm.fsx / log_folder(name).removeprefix("/fsx/") / "node-0.log"
    wait_until(lambda: any(e["event"] == "checkpoint_saved" for e in events(node0)), "a first checkpoint",
               timeout=180, poll=0.2)
    ids = jobs.cancel(name)
    assert len(ids) == 1
    wait_until(lambda: jobs.status(name).finished, "the cancelled job to end", timeout=slurm.kill_wait_s + 30, poll=1)
    status = jobs.status(name)
    assert status.state == "CANCELLED"
    ended = events(node0)
    assert ended[-1]["event"] == "stop" or any(e["event"] == "stop" for e in ended), ended[-3:]
    stop = next(e for e in reversed(ended) if e["event"] == "stop")
    saved = [e for e in ended if e["event"] == "checkpoint_saved"]
    assert saved[-1]["step"] == stop["step"], "the stop wrote a checkpoint at the step it stopped on"
    # Nothing of the job is left on either node.
    for node in slurm.nodes:
        assert slurm.node_processes_left(node) == []
    listed = {row["name"]: row["state"] for row in jobs.jobs()}
    assert listed == {"requeue": "COMPLETED", "cancelled": "CANCELLED"}


def test_a_second_submit_of_an_active_job_is_refused(slurm, jobs):
    name = "twice"
    submit(jobs, slurm, name, samples=2_000_000)
    try:
        with pytest.raises(Exception, match="already (PENDING|RUNNING)"):
            submit(jobs, slurm, name)
    finally:
        jobs.cancel(name)
        subprocess.run(["true"])
