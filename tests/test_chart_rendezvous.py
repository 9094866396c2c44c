"""The charts' own etcd arguments and torchrun command, run for real on loopback.

etcd starts with the Deployment's args (only addresses, ports and the data dir changed for
loopback), and two agents run the training job's command (only the interpreter, $(POD_IP),
the rendezvous id, the etcd address and the per-node process count changed; the trainer is
told to train a tiny model). They must rendezvous into one world of two and finish.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.test_charts import RENDERED, container, the_job
from training.local_cluster import LocalEtcd, free_port

pytestmark = pytest.mark.timeout(240)


def loopback_etcd_args(data_dir: str, client: int, peer: int) -> list[str]:
    deployment = next(o for o in RENDERED["etcd"] if o["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    swaps = {":2379": f":{client}", ":2380": f":{peer}", "0.0.0.0": "127.0.0.1",
             "etcd.training-platform.svc.cluster.local": "127.0.0.1", "/var/lib/etcd": data_dir}
    out = []
    for arg in args:
        for old, new in swaps.items():
            arg = arg.replace(old, new)
        out.append(arg)
    return out


def local_command(endpoint: str, run_id: str, work) -> list[str]:
    command = container(the_job(RENDERED, "resnet50-imagenet"))["command"]
    trainer_at = command.index("train")
    swapped = [
        part.replace("$(POD_IP)", "127.0.0.1").replace("$(PODGROUP)-v$(JOB_VERSION)", run_id)
        .replace("etcd.training-platform.svc.cluster.local:2379", endpoint)
        for part in command[1:trainer_at + 1]
    ]
    swapped = [("--nproc-per-node=1" if p.startswith("--nproc-per-node=") else p) for p in swapped]
    swapped = [("--nnodes=2:4" if p.startswith("--nnodes=") else p) for p in swapped]
    tiny = ["--model.name=mlp", "--model.image_size=16", "--model.num_classes=4", "--data.synthetic_samples=256",
            "--data.num_workers=0", "--train.global_batch_size=32", "--train.micro_batch_size=16",
            "--train.max_steps=4", "--train.precision=fp32", f"--checkpoint.dir={work}/ck",
            f"--metrics.jsonl_path={work}/metrics.jsonl"]
    return [sys.executable, *swapped, *tiny]


def test_two_agents_rendezvous_through_an_etcd_started_with_the_charts_arguments(tmp_path):
    client = free_port()
    data_dir = tmp_path / "etcd-data"
    with LocalEtcd(loopback_etcd_args(str(data_dir), client, free_port()), client_port=client) as endpoint:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        container_env = {e["name"]: e["value"] for e in container(the_job(RENDERED, "resnet50-imagenet"))["env"]
                         if "value" in e and e["name"].startswith("TORCH")}
        env.update(container_env)
        agents = [subprocess.Popen(local_command(endpoint, "chart-test-1", tmp_path), cwd=REPO, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        outputs = [agent.communicate(timeout=200)[0] for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs[0][-3000:]
    assert container_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert next(e for e in events if e["event"] == "rendezvous")["world_size"] == 2
    assert events[-1]["event"] == "finished" and events[-1]["step"] == 4
    assert data_dir.is_dir()  # etcd used the data dir the chart mounts
