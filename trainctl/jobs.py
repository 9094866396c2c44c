"""Render, submit, watch and cancel training jobs (Volcano Jobs rendered from a job spec)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import yaml
from cdk8s import App

from config import PlatformConfig
from k8s_charts.job_charts import NcclCheckChart, TrainingJobChart
from k8s_charts.job_spec import JobSpec
from k8s_charts.render import manifests
from config.catalog import Accelerator
from trainctl.errors import UserError

GROUP, VERSION, PLURAL = "batch.volcano.sh", "v1alpha1", "jobs"
JOB_LABEL = "volcano.sh/job-name"


def render(config: PlatformConfig, spec: JobSpec, nccl_check: bool = False) -> list[dict]:
    if nccl_check and spec.group(config).instance.accelerator is not Accelerator.NVIDIA:
        raise UserError(f"--nccl-check: node group {spec.node_group} is Trainium, whose collectives run through the "
                        "Neuron runtime, not NCCL; allowed: a job on a GPU node group")
    app = App()
    chart = NcclCheckChart if nccl_check else TrainingJobChart
    chart(app, "job", config, spec)
    return manifests(app)["job"]


def render_yaml(objects: list[dict]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False)


class Jobs:
    """The jobs of the platform's namespace, through one kubernetes ApiClient."""

    def __init__(self, api_client, namespace: str):
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace

    def _call(self, fn, *args, **kwargs):
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            if exc.status in (401, 403):
                raise UserError(f"the cluster refused this identity (HTTP {exc.status})",
                                "add your role to cluster.admin_principal_arns and redeploy, or ask for an access "
                                "entry") from None
            raise

    def get(self, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._call(self.custom.get_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def submit(self, job: dict, replace: bool = False) -> str:
        name = job["metadata"]["name"]
        if self.get(name) is not None:
            if not replace:
                raise UserError(f"job {name!r} already exists in {self.namespace}",
                                "choose another name, or pass --replace to delete it first (checkpoints are kept)")
            self.cancel(name)
        self._call(self.custom.create_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL, job)
        return name

    def cancel(self, name: str) -> None:
        """Delete the Volcano job and its pods; checkpoints on the file system stay."""
        if self.get(name) is None:
            raise UserError(f"no job {name!r} in {self.namespace}", "see `trainctl list`")
        self._call(self.custom.delete_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL, name,
                   propagation_policy="Foreground")

    def list(self) -> list[dict]:
        return self._call(self.custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace,
                          PLURAL)["items"]

    def pods(self, name: str) -> list:
        return self._call(self.core.list_namespaced_pod, self.namespace, label_selector=f"{JOB_LABEL}={name}").items

    def log(self, pod: str, tail: int | None = None, follow: bool = False):
        if follow:
            return self._call(self.core.read_namespaced_pod_log, pod, self.namespace, follow=True,
                              _preload_content=False)
        return self._call(self.core.read_namespaced_pod_log, pod, self.namespace, tail_lines=tail)


@dataclass
class JobStatus:
    name: str
    phase: str
    pods: list[tuple[str, str, str, int]]  # pod, node, phase, restarts
    rendezvous: dict | None
    last_step: dict | None
    checkpoint: dict | None

    def format(self) -> str:
        lines = [f"job {self.name}: {self.phase}", "pods:"]
        lines += [f"  {pod:<40} {node or '-':<28} {phase:<10} restarts {restarts}"
                  for pod, node, phase, restarts in self.pods] or ["  (none)"]
        if self.rendezvous:
            r = self.rendezvous
            lines.append(f"rendezvous: world size {r['world_size']}, restart {r['restart_count']}, "
                         f"attempt {r['attempt']}")
        if self.last_step:
            s = self.last_step
            lines.append(f"last step: {s['step']} (epoch {s['epoch']}), loss {s['loss']}, "
                         f"{s['samples_per_s']} samples/s, {s['step_time_s']} s/step")
        if self.checkpoint:
            lines.append(f"newest checkpoint: {self.checkpoint['path']} (step {self.checkpoint['step']})")
        return "\n".join(lines)


def status(jobs: Jobs, name: str, tail: int = 2000) -> JobStatus:
    job = jobs.get(name)
    if job is None:
        raise UserError(f"no job {name!r} in {jobs.namespace}", "see `trainctl list`")
    pods = jobs.pods(name)
    rows, events = [], []
    for pod in sorted(pods, key=lambda p: p.metadata.name):
        restarts = sum(c.restart_count for c in (pod.status.container_statuses or []))
        rows.append((pod.metadata.name, pod.spec.node_name, pod.status.phase, restarts))
        if pod.status.phase in ("Running", "Succeeded", "Failed"):
            events += metrics_events(jobs.log(pod.metadata.name, tail=tail))
    events.sort(key=lambda e: e.get("time", 0))

    def last(kind):
        return next((e for e in reversed(events) if e["event"] == kind), None)

    phase = (job.get("status") or {}).get("state", {}).get("phase", "Pending")
    return JobStatus(name, phase, rows, last("rendezvous"), last("step"), last("checkpoint_saved"))


def metrics_events(log_text: str) -> list[dict]:
    """The trainer's JSON lines in a pod log (rank 0 writes them)."""
    events = []
    for line in log_text.splitlines():
        if line.startswith('{"event"'):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def pod_for_rank(jobs: Jobs, name: str, rank: int) -> str:
    """The pod whose worker index is ``rank`` (pods are <job>-worker-<index>)."""
    pods = sorted(p.metadata.name for p in jobs.pods(name))
    wanted = f"{name}-worker-{rank}"
    if wanted not in pods:
        raise UserError(f"no pod {wanted!r}", f"pick a rank from 0 to {len(pods) - 1}" if pods else "the job has no pods yet")
    return wanted
