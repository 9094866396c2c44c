"""``--backend eks`` (the default): Volcano Jobs rendered from the job spec, on the platform's EKS cluster,
through the Kubernetes API (an EKS token, or a kubeconfig context)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import yaml

from config import PlatformConfig
from config.catalog import Accelerator
from config.job_spec import JobSpec
from trainctl.backends import (
    Backend, Connection, LogOptions, SubmitOptions, Submitted, metrics_events, newest_claim, rank_claim, say,
)
from trainctl.errors import UserError, check_name, from_kube

GROUP, VERSION, PLURAL = "batch.volcano.sh", "v1alpha1", "jobs"
QUEUES = ("scheduling.volcano.sh", "v1beta1", "queues")
JOB_LABEL = "volcano.sh/job-name"
# Volcano's job phases that do not change any more (pkg/apis/batch/v1alpha1 JobPhase).
FINISHED_PHASES = ("Completed", "Failed", "Terminated", "Aborted")


def render_text(config: PlatformConfig, spec: JobSpec, nccl_check: bool = False) -> str:
    """The job's manifests as YAML, written by cdk8s as ``make synth`` writes them into dist/
    (App.synth_yaml): what `trainctl render` prints is byte for byte what dist/ holds. cdk8s runs
    on Node (found or named by k8s_charts.node_runtime); the other commands don't need it."""
    if nccl_check and spec.group(config).instance.accelerator is not Accelerator.NVIDIA:
        raise UserError(f"--nccl-check: node group {spec.node_group} is Trainium, whose collectives run through the "
                        "Neuron runtime, not NCCL; allowed: a job on a GPU node group")
    from k8s_charts.node_runtime import select_node

    select_node()
    from cdk8s import App

    from k8s_charts.job_charts import NcclCheckChart, TrainingJobChart

    app = App()
    chart = NcclCheckChart if nccl_check else TrainingJobChart
    chart(app, "job", config, spec)
    return app.synth_yaml()


def manifests_of(text: str) -> list[dict]:
    return [obj for obj in yaml.safe_load_all(text) if obj]


def render(config: PlatformConfig, spec: JobSpec, nccl_check: bool = False) -> list[dict]:
    """The job's manifests, as objects."""
    return manifests_of(render_text(config, spec, nccl_check))


class Jobs:
    """The jobs of the platform's namespace, through one kubernetes ApiClient.

    Every name is checked before it reaches a URL: an empty one would address the collection.
    """

    def __init__(self, api_client, namespace: str, clock=time.monotonic, sleep=time.sleep):
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.scheduling = client.SchedulingV1Api(api_client)
        self.namespace = check_name("namespace", namespace)
        self.server = api_client.configuration.host
        self._clock, self._sleep = clock, sleep

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # API and transport errors users cause become one line
            error = from_kube(exc, self.server)
            if error is None:
                raise
            raise error from None

    def _get(self, fn, *args):
        """The object, or None when the API server answers 404."""
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(*args)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def get(self, name: str) -> dict | None:
        check_name("job name", name)
        return self._call(self._get, self.custom.get_namespaced_custom_object, GROUP, VERSION, self.namespace,
                          PLURAL, name)

    def submit(self, job: dict, replace: bool = False, on_wait=None, dry_run: bool = False) -> str:
        """Create the job; with ``replace``, delete a job of the same name first, but only once the
        API server has accepted the new one in a dry run, and say exactly what state things are in
        if the create still fails after the delete. ``dry_run``: every check, and the create as a
        server-side dry run, deleting nothing."""
        name = check_name("job name", job["metadata"]["name"])
        self.check_scheduling(job)
        if self.get(name) is None:
            if dry_run:
                self.check_create(job, probe=False)
            else:
                self._create(job)
            return name
        if not replace:
            raise UserError(f"job {name!r} already exists in {self.namespace}",
                            "choose another name, or pass --replace to delete it first (checkpoints are kept)")
        self.check_create(job)
        if dry_run:
            return name
        self.cancel(name)
        self.wait_gone(name, on_wait)
        try:
            self._create(job)
        except UserError as error:
            raise UserError(f"job {name!r} was deleted to be replaced, and creating the new one failed: {error.cause}",
                            f"{error.fix}; then submit the spec again without --replace: the job resumes from its "
                            "checkpoints, which were kept") from None
        return name

    def check_create(self, job: dict, probe: bool = True) -> None:
        """Would the API server create ``job``? A server-side dry run (dryRun=All: nothing is
        stored) runs the schema, the admission webhooks and the caller's create permission; with
        ``probe``, under a name no object has (the job's own name is taken while it is replaced).
        Volcano's webhooks take dry runs: every one is declared ``sideEffects: NoneOnDryRun``
        (installer/helm/chart/volcano/templates/webhooks.yaml, v1.15.1)."""
        if probe:
            job = {**job, "metadata": {**job["metadata"], "name": f"{job['metadata']['name'][:40]}-replace-check"}}
        self._call(self.custom.create_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL, job,
                   dry_run="All")

    def _create(self, job: dict) -> None:
        self._call(self.custom.create_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL, job)

    def check_scheduling(self, job: dict) -> None:
        """The job's queue and PriorityClass exist in the cluster (Volcano would leave it Pending forever)."""
        spec = job.get("spec", {})
        queue, priority = spec.get("queue"), spec.get("priorityClassName")
        if queue and self._call(self._get, self.custom.get_cluster_custom_object, *QUEUES, queue) is None:
            queues = self._call(self._get, self.custom.list_cluster_custom_object, *QUEUES)
            if queues is None:  # the resource itself is not served: no Volcano on this cluster
                raise UserError(f"queue: got {queue!r}, but the cluster at {self.server} has no Volcano queues "
                                f"({QUEUES[0]}/{QUEUES[1]} {QUEUES[2]}: HTTP 404)",
                                "deploy the platform's cluster stack, which installs Volcano, or name the platform's "
                                "cluster with --context")
            names = [q["metadata"]["name"] for q in queues["items"]]
            raise UserError(f"queue: got {queue!r}, which the cluster does not have",
                            f"allowed: {', '.join(sorted(names)) or 'none (deploy the platform)'}")
        if priority and self._call(self._get, self.scheduling.read_priority_class, priority) is None:
            raise UserError(f"priority_class: got {priority!r}, which the cluster does not have",
                            "allowed: the platform's (jobs.priority_class.name) or one your cluster defines")

    def wait_gone(self, name: str, on_wait=None, timeout_s: float = 600, poll_s: float = 2) -> None:
        """Until the job and its pods are deleted (a new job of the same name must not meet its pods)."""
        deadline = self._clock() + timeout_s
        while self.get(name) is not None or self.pods(name):
            if self._clock() > deadline:
                raise UserError(f"job {name!r} is still being deleted after {timeout_s:.0f} s",
                                "see `trainctl status` for pods that do not terminate, then retry")
            if on_wait is not None:
                on_wait(name)
            self._sleep(poll_s)

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
        check_name("job name", name)
        return self._call(self.core.list_namespaced_pod, self.namespace, label_selector=f"{JOB_LABEL}={name}").items

    def why_waiting(self, name: str, limit: int = 5) -> list[str]:
        """The newest warnings about the job's pods and PodGroup (e.g. Volcano's "0/3 nodes are
        available: 3 Insufficient nvidia.com/gpu"), oldest first, repeats folded."""
        check_name("job name", name)
        events = self._call(self.core.list_namespaced_event, self.namespace).items
        mine = [e for e in events if e.type == "Warning" and (e.involved_object.name or "").startswith(f"{name}-")]
        mine.sort(key=lambda e: e.last_timestamp or e.event_time or e.metadata.creation_timestamp or 0)
        lines: list[str] = []
        for event in reversed(mine):
            line = f"{event.involved_object.kind} {event.involved_object.name}: {event.reason}: " + " ".join(
                (event.message or "").split())
            if line not in lines:
                lines.append(line)
            if len(lines) == limit:
                break
        return lines[::-1]

    def log(self, pod: str, tail: int | None = None, follow: bool = False, previous: bool = False,
            since_s: int | None = None):
        check_name("pod", pod)
        options = {"tail_lines": tail, "previous": previous or None, "since_seconds": since_s}
        options = {k: v for k, v in options.items() if v is not None}
        if follow:
            return self._call(self.core.read_namespaced_pod_log, pod, self.namespace, follow=True,
                              _preload_content=False, **options)
        return self._call(self.core.read_namespaced_pod_log, pod, self.namespace, **options)


@dataclass
class JobStatus:
    name: str
    phase: str
    pods: list[tuple[str, str, str, int]]  # pod, node, phase, restarts
    rendezvous: dict | None
    last_step: dict | None
    checkpoint: dict | None
    waiting: list[str]
    # the trainer's straggler and straggler_replaced events, newest last
    stragglers: list[dict] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED_PHASES

    @property
    def succeeded(self) -> bool:
        return self.phase == "Completed"

    def summary(self) -> str:
        return f"{self.name}: {self.phase}" + (f" ({self.waiting[-1]})" if self.waiting else "")

    def as_dict(self) -> dict:
        """For ``-o json|yaml``: the text's fields, the pods as mappings."""
        return {"name": self.name, "phase": self.phase, "finished": self.finished,
                "pods": [dict(zip(("pod", "node", "phase", "restarts"), row, strict=True)) for row in self.pods],
                "rendezvous": self.rendezvous, "last_step": self.last_step, "checkpoint": self.checkpoint,
                "waiting": self.waiting, "stragglers": self.stragglers}

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
            if s.get("rank_step_s"):
                spread = s["rank_step_s"]
                lines.append(f"ranks' own step time: min {spread['min']} s, median {spread['median']} s, max "
                             f"{spread['max']} s (rank {s['slowest_rank']}, pod {s.get('slowest_pod', '-')})")
        for e in self.stragglers[-3:]:
            if e["event"] == "straggler_replaced":
                lines.append(f"straggler replaced at step {e['step']}: pod {e['pod']} left node {e['node']} (tainted); "
                             f"the job went on with {e['nodes'] - 1} of its {e['nodes']} nodes")
                continue
            lines.append(f"straggler at step {e['step']}: rank {e['rank']}, pod {e['pod']}, node {e['node']}"
                         f"{', ' + e['instance'] if e.get('instance') else ''}: {e['times_median']} times the "
                         f"median's own step time for {e['windows']} reports")
        if self.checkpoint:
            lines.append(f"newest checkpoint: {self.checkpoint['path']} (step {self.checkpoint['step']})")
        if self.waiting:
            lines += ["waiting because:", *(f"  {line}" for line in self.waiting)]
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
    pending = phase == "Pending" or any(row[2] == "Pending" for row in rows)
    waiting = jobs.why_waiting(name) if pending else []
    stragglers = [e for e in events if e["event"] in ("straggler", "straggler_replaced")]
    return JobStatus(name, phase, rows, last("rendezvous"), last("step"), last("checkpoint_saved"), waiting,
                     stragglers)


def pod_for_rank(jobs: Jobs, name: str, rank: int) -> str:
    """The pod whose workers hold global rank ``rank`` now. A pod's index is not its rank: a
    regroup hands places out in the order nodes join."""
    pods = sorted(p.metadata.name for p in jobs.pods(name))
    return newest_claim({pod: rank_claim(jobs.log(pod), rank) for pod in pods}, rank, name, "pod",
                        f"in `trainctl status {name}`")


def pod_at_index(jobs: Jobs, name: str, index: int) -> str:
    """The pod <job>-worker-<index>, whatever rank it holds."""
    pods = sorted(p.metadata.name for p in jobs.pods(name))
    wanted = f"{name}-worker-{index}"
    if wanted not in pods:
        raise UserError(f"--pod: got {index}, and there is no pod {wanted!r}",
                        f"allowed: an index from 0 to {len(pods) - 1}" if pods else "the job has no pods yet")
    return wanted


class EksBackend(Backend):
    name = "eks"
    options = {
        "submit": frozenset({"--nccl-check", "--replace", "--dry-run", "--dry-run=server", "--wait", "--follow"}),
        "status": frozenset({"--watch", "-o"}),
        "logs": frozenset({"--rank", "--pod", "--all", "--follow", "--previous", "--since"}),
        "cancel": frozenset({"--all", "--yes"}),
        "list": frozenset({"-o"}),
    }

    render = staticmethod(render_text)

    def __init__(self, connection: Connection):
        super().__init__(connection)
        self._jobs: Jobs | None = None

    @property
    def namespace(self) -> str:
        return self.config.jobs.namespace

    @classmethod
    def where(cls, connection: Connection, command: str) -> str:
        config = connection.config
        cluster = (f"kubeconfig context {connection.context}" if connection.context
                   else f"cluster {config.name_prefix} in {config.region}")
        if command == "nodes":
            return cluster
        return f"{'for ' if command == 'render' else ''}{cluster}, namespace {config.jobs.namespace}"

    @property
    def client(self) -> Jobs:
        """The API server is reached on first use: a client-side dry run never does."""
        if self._jobs is None:
            from trainctl.kube import api_client

            config = self.config
            self._jobs = Jobs(api_client(self.connection.aws_session(), config.name_prefix, config.region,
                                         self.connection.context), self.namespace)
        return self._jobs

    def submit(self, spec: JobSpec, options: SubmitOptions) -> Submitted:
        text = render_text(self.config, spec, options.nccl_check)
        objects = manifests_of(text)
        if options.dry_run:
            # --dry-run=server: each object also created with dryRun=All (schema, admission webhooks, quota and the
            # caller's create permission, nothing stored), after the same checks as a real submit.
            for obj in objects if options.dry_run == "server" else ():
                self.client.submit(obj, options.replace, dry_run=True)
                say(f"{obj['metadata']['name']}: the API server would accept it (server dry run, nothing created)")
            print(text, end="")
            return Submitted(None)
        for obj in objects:
            name = self.client.submit(obj, options.replace, on_wait=lambda n: say(f"waiting until the old {n} is gone"))
            print(f"submitted {name} to {self.namespace}")
        return Submitted(objects[-1]["metadata"]["name"])

    def status(self, name: str) -> JobStatus:
        return status(self.client, name)

    def jobs(self) -> list[dict]:
        return [{"name": job["metadata"]["name"], "state": (job.get("status") or {}).get("state", {}).get(
            "phase", "Pending")} for job in self.client.list()]

    def nothing_listed(self) -> str:
        return f"no jobs in {self.namespace}"

    def logs(self, name: str, options: LogOptions) -> None:
        jobs = self.client
        if jobs.get(name) is None:
            raise UserError(f"no job {name!r} in {self.namespace}", "see `trainctl list`")
        read = {"previous": options.previous, "since_s": options.since_s}
        if options.all:
            pods = sorted(p.metadata.name for p in jobs.pods(name))
            if not pods:
                raise UserError(f"job {name!r} has no pods", f"see `trainctl status {name}`")
        elif options.pod is not None:
            pods = [pod_at_index(jobs, name, options.pod)]
        else:
            pods = [pod_for_rank(jobs, name, options.rank or 0)]
        for pod in pods:
            if options.follow:
                for chunk in jobs.log(pod, follow=True, **read).stream():
                    sys.stdout.write(chunk.decode(errors="replace"))
            elif options.all:
                for line in jobs.log(pod, **read).splitlines():
                    print(f"[{pod}] {line}")
            else:
                print(jobs.log(pod, **read), end="")

    def follow(self, name: str, interval_s: float) -> int:
        """Rank 0's log from when its pod runs until the job ends (again after each restart or regroup:
        rank 0 may then be on another pod)."""
        jobs = self.client
        while True:
            report = status(jobs, name)
            if report.finished:
                say(report.summary())
                return 0 if report.succeeded else 1
            try:
                pod = pod_for_rank(jobs, name, 0)
            except UserError:  # no group formed yet
                pod = None
            if any(row[0] == pod and row[2] == "Running" for row in report.pods):
                for chunk in jobs.log(pod, follow=True).stream():
                    sys.stdout.write(chunk.decode(errors="replace"))
                continue
            say(report.summary())
            time.sleep(interval_s)

    def cancel(self, name: str) -> str:
        self.client.cancel(name)
        return f"cancelled {name}; checkpoints stay on the file system and in S3"

    def cancel_all(self, yes: bool) -> int:
        names = [job["metadata"]["name"] for job in self.client.list()]
        if not names:
            print(f"no jobs in {self.namespace}")
            return 0
        if not yes:
            if not sys.stdin.isatty():
                raise UserError(f"cancel --all would delete {len(names)} jobs in {self.namespace} and nobody can "
                                "confirm", "run it in a terminal, or add --yes")
            answer = input(f"delete {len(names)} jobs in {self.namespace} ({', '.join(names)})? "
                           f"type the namespace to confirm: ")
            if answer.strip() != self.namespace:
                print("nothing deleted")
                return 1
        for name in names:  # one DELETE per named job, never one on the collection
            self.client.cancel(name)
            print(f"cancelled {name}")
        print("checkpoints stay on the file system and in S3")
        return 0


BACKEND = EksBackend
