"""An AWS Batch multi-node parallel job on loopback: two processes run the job definition's exact
container command as node 0 and node 1, with Batch's environment variables. The attempt is
killed (both nodes, as a lost host ends every node of the attempt) and a second attempt resumes
from the checkpoint on the shared file system, with the same result as an uninterrupted run.

The only change to the command is the shared file system's mount: /fsx is a temporary folder.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from config import parse_config
from config.job_spec import parse_job_spec
from tests.conftest import REPO, VARIANTS
from training.contract import batch_launch_command
from trainctl.backends.local_cluster import Agent, free_port, read_events, wait_until

pytestmark = pytest.mark.timeout(300)

CONFIG = parse_config(VARIANTS["batch"])
SAMPLES, GLOBAL_BATCH, INTERVAL = 12_000, 32, 25
STEPS = SAMPLES // GLOBAL_BATCH
JOB = {
    "name": "mnp-retry", "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainer:gpu-0.1.0",
    "node_group": "p4d", "min_nodes": 2, "max_nodes": 2,
    "trainer_args": {
        "model.name": "mlp", "model.image_size": 16, "model.num_classes": 10, "data.synthetic_samples": SAMPLES,
        "data.num_workers": 0, "train.global_batch_size": GLOBAL_BATCH, "train.micro_batch_size": 16,
        "train.epochs": 1, "train.precision": "fp32", "train.device": "cpu", "train.log_every_steps": 5,
        "optim.lr": 0.05, "checkpoint.interval_steps": INTERVAL, "distributed.timeout_s": 30,
    },
}


def node_command(fsx: Path, port: int) -> list[str]:
    """What trainctl registers for the job (trainctl.backends.batch), with this machine's python and /fsx."""
    spec = parse_job_spec(JOB, CONFIG)
    command = batch_launch_command(nproc_per_node=1, max_restarts=spec.max_restarts, python=sys.executable,
                                   master_port=port) + spec.trainer_flags(CONFIG)
    command = [arg.replace("/fsx/", f"{fsx}/") for arg in command]
    return command + [f"--metrics.jsonl_path={fsx}/metrics.jsonl"]


def batch_environment(node: int, attempt: int) -> dict[str, str]:
    env = {"AWS_BATCH_JOB_ID": f"0a1b2c3d-job#{node}", "AWS_BATCH_JOB_ATTEMPT": str(attempt),
           "AWS_BATCH_JOB_NODE_INDEX": str(node), "AWS_BATCH_JOB_NUM_NODES": "2", "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0"}
    if node != 0:  # Batch gives the main node's address to the other nodes only
        env["AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS"] = "127.0.0.1"
    return env


def attempt(fsx: Path, number: int) -> list[Agent]:
    port = free_port()
    return [Agent(f"attempt{number}-node{node}", "", "", fsx, [], command=node_command(fsx, port),
                  env=batch_environment(node, number)) for node in range(2)]


def steps(fsx: Path, after: float = 0.0) -> list[dict]:
    return [e for e in read_events(fsx / "metrics.jsonl") if e["event"] == "step" and e["time"] > after]


def final_state(fsx: Path) -> dict:
    return torch.load(sorted((fsx / "checkpoints" / "mnp-retry").glob("step-*.pt"))[-1], weights_only=True)


@pytest.fixture(scope="module")
def retried(tmp_path_factory):
    fsx = tmp_path_factory.mktemp("fsx")
    first = attempt(fsx, 1)
    try:
        wait_until(lambda: any(e["step"] >= 2 * INTERVAL + 10 for e in steps(fsx)), "attempt 1 training", 120, first)
        trained = max(e["step"] for e in steps(fsx))
        for node in first:
            node.kill_node()  # the attempt ends on every node
    finally:
        for node in first:
            node.stop()
    started = time.time()
    second = attempt(fsx, 2)
    try:
        codes = [node.wait(timeout=240) for node in second]
        outputs = [node.output() for node in second]
    finally:
        for node in second:
            node.stop()
    resumed = [e for e in read_events(fsx / "metrics.jsonl") if e["event"] == "resume"][-1]
    first_step = steps(fsx, after=started)[0]
    return {"fsx": fsx, "codes": codes, "outputs": outputs, "trained_before_kill": trained, "resumed": resumed,
            "first_step_s": first_step["time"] - started, "started": started}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    fsx = tmp_path_factory.mktemp("fsx-solo")
    nodes = attempt(fsx, 1)
    try:
        try:
            codes = [node.wait(timeout=240) for node in nodes]
        except subprocess.TimeoutExpired:
            pytest.fail("the uninterrupted run did not finish in 240 s\n" + "\n".join(
                f"--- {node.name}\n{node.output()[-3000:]}" for node in nodes))
        assert codes == [0, 0], nodes[0].output()[-3000:]
    finally:
        for node in nodes:
            node.stop()
    return fsx


def test_the_retry_resumes_from_the_checkpoint_and_finishes(retried):
    assert retried["codes"] == [0, 0], retried["outputs"][0][-3000:]
    resumed_step = retried["resumed"]["step"]
    lost = retried["trained_before_kill"] - resumed_step
    assert resumed_step > 0 and 0 <= lost <= INTERVAL + 5  # at most one checkpoint interval (+ one report)
    finished = [e for e in read_events(retried["fsx"] / "metrics.jsonl") if e["event"] == "finished"]
    assert finished[-1]["step"] == STEPS
    print(json.dumps({"steps_lost": lost, "retry_start_to_first_step_s": round(retried["first_step_s"], 2)}))
    (retried["fsx"] / "figures.json").write_text(json.dumps(
        {"steps_lost": lost, "retry_start_to_first_step_s": round(retried["first_step_s"], 2)}))


def test_each_attempt_is_its_own_rendezvous_with_both_nodes(retried):
    rendezvous = [e for e in read_events(retried["fsx"] / "metrics.jsonl") if e["event"] == "rendezvous"]
    assert {e["run_id"] for e in rendezvous} == {"0a1b2c3d-job-1", "0a1b2c3d-job-2"}
    assert {e["world_size"] for e in rendezvous} == {2}


def test_the_result_matches_an_uninterrupted_run(retried, uninterrupted):
    retried_state, solo_state = final_state(retried["fsx"]), final_state(uninterrupted)
    for name, tensor in solo_state["model"].items():
        assert torch.allclose(retried_state["model"][name], tensor, atol=1e-5), name

    def last(fsx):
        return [e for e in read_events(fsx / "metrics.jsonl") if e["event"] == "step"][-1]["loss"]

    assert last(retried["fsx"]) == pytest.approx(last(uninterrupted), rel=1e-4, abs=1e-6)


def test_outside_batch_the_command_refuses_in_one_line(tmp_path):
    import subprocess

    result = subprocess.run(node_command(tmp_path, free_port()), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 78
    assert result.stderr.strip().splitlines()[-1] == (
        "config error: --aws-batch-mnp: AWS Batch's job variables are missing or invalid ('AWS_BATCH_JOB_NODE_INDEX'); "
        "allowed: inside an AWS Batch multi-node parallel job")
