"""The charts' own etcd arguments and torchrun command, run for real on loopback, over mutual TLS.

Three etcd members start with the StatefulSet's args (only the pod's name and IP, the members'
addresses, ports, the data dir and the certificate files changed for loopback), and two agents
run the training job's command with the job's TLS environment (only the interpreter, $(POD_IP),
the rendezvous id, the etcd addresses, the certificate directory and the per-node process count
changed; the trainer is told to train a tiny model). They must rendezvous into one world of two
and finish. The certificates are a throwaway CA's, with the usages the platform's have.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.unit.test_charts import RENDERED, container, the_job
from tests.local_pki import platform_pki
from training.contract import CLIENT_TLS_DIR, TLS_ENVIRONMENT
from trainctl.backends.local_cluster import LocalEtcd, free_ports

pytestmark = pytest.mark.timeout(240)
MEMBER_HOST = "etcd-{}.etcd-peers.training-platform.svc.cluster.local"


TLS_FILES = {"/etc/etcd/tls/server/ca.crt": "ca.pem", "/etc/etcd/tls/server/tls.crt": "server.pem",
             "/etc/etcd/tls/server/tls.key": "server-key.pem", "/etc/etcd/tls/peer/tls.crt": "peer.pem",
             "/etc/etcd/tls/peer/tls.key": "peer-key.pem"}
CLIENT_TLS_FILES = {"ca.crt": "ca.pem", "tls.crt": "client.pem", "tls.key": "client-key.pem"}


def loopback_members(work, pki) -> list[LocalEtcd]:
    """The StatefulSet's three members, each started with the chart's args made local."""
    members = next(o for o in RENDERED["etcd"] if o["kind"] == "StatefulSet")
    args = members["spec"]["template"]["spec"]["containers"][0]["command"][1:]
    count = members["spec"]["replicas"]
    chosen = free_ports(3 * count)
    ports = [tuple(chosen[i::count]) for i in range(count)]
    started = []
    for i, (client, _, metrics) in enumerate(ports):
        swaps = {"$(POD_NAME)": f"etcd-{i}", "$(POD_IP):2380": f"127.0.0.1:{ports[i][1]}",
                 "0.0.0.0:2379": f"127.0.0.1:{client}", "0.0.0.0:2381": f"127.0.0.1:{metrics}",
                 "/var/lib/etcd/data": str(work / f"etcd-{i}"),
                 **{path: str(pki / name) for path, name in TLS_FILES.items()}}
        for j, (other_client, other_peer, _) in enumerate(ports):
            swaps[f"{MEMBER_HOST.format(j)}:2380"] = f"127.0.0.1:{other_peer}"
            swaps[f"{MEMBER_HOST.format(j)}:2379"] = f"127.0.0.1:{other_client}"
        local = []
        for arg in args:
            for old, new in swaps.items():
                arg = arg.replace(old, new)
            local.append(arg)
        assert not [a for a in local if "svc.cluster.local" in a or "$(" in a], local
        assert "--client-cert-auth=true" in local and "--peer-client-cert-auth=true" in local
        member = LocalEtcd(local, client_port=client)
        member.metrics_url = f"http://127.0.0.1:{metrics}"
        started.append(member)
    return started


def local_command(endpoint: str, run_id: str, work) -> list[str]:
    command = container(the_job(RENDERED, "resnet50-imagenet"))["command"]
    trainer_at = command.index("train")
    swapped = [
        part.replace("$(POD_IP)", "127.0.0.1").replace("$(PODGROUP)-v$(JOB_VERSION)", run_id)
        .replace(",".join(f"https://{MEMBER_HOST.format(i)}:2379" for i in range(3)), endpoint)
        for part in command[1:trainer_at + 1]
    ]
    swapped = [("--nproc-per-node=1" if p.startswith("--nproc-per-node=") else p) for p in swapped]
    # 2:2: the first round completes when the second node joins (2:4 waited the 2 s last call for more).
    swapped = [("--nnodes=2:2" if p.startswith("--nnodes=") else p) for p in swapped]
    tiny = ["--model.name=mlp", "--model.image_size=16", "--model.num_classes=4", "--data.synthetic_samples=256",
            "--data.num_workers=0", "--train.global_batch_size=32", "--train.micro_batch_size=16",
            "--train.max_steps=4", "--train.precision=fp32", f"--checkpoint.dir={work}/ck",
            f"--metrics.jsonl_path={work}/metrics.jsonl"]
    return [sys.executable, *swapped, *tiny]


def test_two_agents_rendezvous_through_three_members_started_with_the_charts_arguments(tmp_path):
    pki = tmp_path / "pki"
    pki.mkdir()
    platform_pki(pki)
    members = loopback_members(tmp_path, pki)
    try:
        for member in members:
            member.launch()
        for member in members:
            member.wait_ready(probe=member.metrics_url)  # the probes' plain-HTTP listener
        endpoint = ",".join(f"https://{member.endpoint}" for member in members)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        job_env = {e["name"]: e["value"] for e in container(the_job(RENDERED, "resnet50-imagenet"))["env"]
                   if "value" in e}
        container_env = {k: v for k, v in job_env.items() if k.startswith("TORCH")}
        env.update(container_env)
        # The job's TLS environment, its files in the local PKI.
        for name in TLS_ENVIRONMENT:
            directory, file = job_env[name].rsplit("/", 1)
            assert directory == CLIENT_TLS_DIR
            env[name] = str(pki / CLIENT_TLS_FILES[file])
        agents = [subprocess.Popen(local_command(endpoint, "chart-test-1", tmp_path), cwd=REPO, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        outputs = [agent.communicate(timeout=200)[0] for agent in agents]
    finally:
        for member in members:
            member.__exit__()
    assert [a.returncode for a in agents] == [0, 0], outputs[0][-3000:]
    assert container_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert next(e for e in events if e["event"] == "rendezvous")["world_size"] == 2
    assert events[-1]["event"] == "finished" and events[-1]["step"] == 4
    assert all((tmp_path / f"etcd-{i}" / "member").is_dir() for i in range(3))  # the data dirs the chart mounts
