"""The same job spec on AWS Batch: submit, status, logs, cancel and list multi-node parallel jobs.

A Batch MNP job has a fixed size: it runs on ``max_nodes`` nodes (``min_nodes`` has no meaning
there). A job definition names its image, and a submission cannot override it, so each submit
registers a revision of the node group's job definition (declared by the batch stack: devices,
mounts, limits, retry strategy) with the job's image, node count and command, then submits it.

A job that runs its own program in its own image gets the launcher as on EKS, from an init
container: the revision is a multi-container one (ecsProperties) whose first container, from
the platform's image (config.jobs.launcher_image), copies the launcher into a volume of the task
and exits; the job's container starts once it succeeded (dependsOn SUCCESS) and runs the
launcher's entry script from that volume, read-only.
"""

from __future__ import annotations

import contextlib

from dataclasses import asdict, dataclass

from config import PlatformConfig
from config.job_spec import JobSpec
from trainctl.backends import Backend, Connection, LogOptions, SubmitOptions, Submitted, newest_claim, rank_claim
from trainctl.errors import UserError, check_name
from training.contract import (
    LAUNCHER_ENTRY, LAUNCHER_MOUNT, SPOT_NOTICE_ENV, batch_launch_command, launcher_copy_command,
)

# Batch's job states (Batch API, JobStatus); the first five are still to finish.
ACTIVE_STATES = ("SUBMITTED", "PENDING", "RUNNABLE", "STARTING", "RUNNING")


@dataclass
class BatchStatus:
    name: str
    job_id: str
    state: str
    reason: str
    attempts: list[str]  # each attempt's end, oldest first
    nodes: int

    @property
    def finished(self) -> bool:
        return self.state not in ACTIVE_STATES

    @property
    def succeeded(self) -> bool:
        return self.state == "SUCCEEDED"

    def summary(self) -> str:
        return f"{self.name}: {self.state}"

    def as_dict(self) -> dict:
        return {**asdict(self), "finished": self.finished}

    def format(self) -> str:
        lines = [f"job {self.name} (AWS Batch {self.job_id}): {self.state}" + (f" ({self.reason})" if self.reason else ""),
                 f"nodes: {self.nodes}"]
        lines += [f"attempt {i}: {text}" for i, text in enumerate(self.attempts, 1)]
        return "\n".join(lines)


class BatchJobs:
    def __init__(self, session, config: PlatformConfig):
        if config.batch is None:
            raise UserError("--backend batch: this platform has no batch section",
                            "add `batch: {node_groups: [...]}` to the config and deploy (see config/batch-example.yaml)")
        self.config = config
        self.batch = session.client("batch", region_name=config.region)
        self.logs = session.client("logs", region_name=config.region)

    def _queue(self, spec: JobSpec) -> str:
        if spec.node_group not in self.config.batch.node_groups:
            raise UserError(f"node_group: got {spec.node_group!r}, which has no Batch compute environment",
                            f"allowed with --backend batch: {', '.join(self.config.batch.node_groups)}")
        return self.config.batch_name(spec.node_group)

    def job_definition(self, spec: JobSpec) -> dict:
        """The RegisterJobDefinition request for this job: the stack's definition with the job's
        image, node count, command and environment."""
        name = self._queue(spec)
        found = self.batch.describe_job_definitions(jobDefinitionName=name, status="ACTIVE")["jobDefinitions"]
        if not found:
            raise UserError(f"no Batch job definition {name!r} in {self.config.region}",
                            f"deploy the batch stack (npx cdk deploy {self.config.stack_name('batch')})")
        base = max(found, key=lambda d: d["revision"])
        config = self.config
        node_range = dict(base["nodeProperties"]["nodeRangeProperties"][0])
        container = dict(node_range["container"])
        container["image"] = spec.image
        container["command"] = batch_launch_command(
            nproc_per_node=spec.nproc_per_node(config), max_restarts=spec.max_restarts,
            program=spec.program_arguments(config), launcher=LAUNCHER_ENTRY if spec.program is not None else None)
        env = {e["name"]: e["value"] for e in container.get("environment", [])}
        if spec.group(config).capacity_type.value == "SPOT":
            env[SPOT_NOTICE_ENV] = "imds"
        env.update(spec.program_environment())
        env.update(spec.env)
        container["environment"] = [{"name": k, "value": v} for k, v in sorted(env.items())]
        container["resourceRequirements"] = [
            {**r, "value": str(spec.accelerators(config))} if r["type"] == "GPU" else r
            for r in container.get("resourceRequirements", [])]
        node_range["container"] = container
        if spec.program is not None:
            node_range = self._with_launcher(node_range)
        return {
            "jobDefinitionName": name, "type": "multinode", "platformCapabilities": ["EC2"], "propagateTags": True,
            "nodeProperties": {"numNodes": spec.max_nodes, "mainNode": 0, "nodeRangeProperties": [node_range]},
            "retryStrategy": base["retryStrategy"], "tags": {"platform": config.name_prefix, "job": spec.name},
        }

    def _with_launcher(self, node_range: dict) -> dict:
        """The node range as a multi-container task: the launcher's init container, then the job's.

        AWS Batch's ecsProperties (API reference, NodeRangeProperty and TaskContainerProperties):
        a task's volumes are shared by its containers; a host volume without a source path is a
        Docker volume of the task's own. The init container runs the platform image's copy in its
        working directory (/app, the images' WORKDIR: TaskContainerProperties has no workingDir),
        as root, because Docker creates that volume root-owned; it is not essential, so its exit
        ends nothing. Exit statuses and retries are the job container's, as before.
        """
        container = dict(node_range.pop("container"))
        task_members = self.batch.meta.service_model.shape_for("TaskContainerProperties").members
        moved = {"volumes": "volumes", "jobRoleArn": "taskRoleArn", "executionRoleArn": "executionRoleArn"}
        task = {moved[key]: container.pop(key) for key in list(container) if key in moved}
        unplaced = sorted(key for key, value in container.items() if key not in task_members and value)
        if unplaced:
            raise UserError(f"the stack's job definition has {', '.join(unplaced)}, which a multi-container job "
                            "cannot carry", "run this job with the packaged trainer, or on EKS")
        volume = "platform-launcher"
        launcher = {
            "name": volume, "image": self.config.jobs.launcher_image, "essential": False, "user": "0",
            "command": launcher_copy_command(LAUNCHER_MOUNT),
            "resourceRequirements": [{"type": "VCPU", "value": "1"}, {"type": "MEMORY", "value": "64"}],
            "mountPoints": [{"sourceVolume": volume, "containerPath": LAUNCHER_MOUNT, "readOnly": False}],
        }
        if container.get("logConfiguration"):
            launcher["logConfiguration"] = container["logConfiguration"]
        job = {key: value for key, value in container.items() if key in task_members}
        job.update(name="trainer", essential=True, dependsOn=[{"containerName": volume, "condition": "SUCCESS"}],
                   mountPoints=[*job.get("mountPoints", []),
                                {"sourceVolume": volume, "containerPath": LAUNCHER_MOUNT, "readOnly": True}])
        task["volumes"] = [*task.get("volumes", []), {"name": volume, "host": {}}]
        return {**node_range, "ecsProperties": {"taskProperties": [{**task, "containers": [launcher, job]}]}}

    def find(self, name: str) -> dict | None:
        """The newest job of that name in any of the platform's queues."""
        check_name("job name", name)
        newest = None
        for group in self.config.batch.node_groups:
            pages = self.batch.get_paginator("list_jobs").paginate(
                jobQueue=self.config.batch_name(group), filters=[{"name": "JOB_NAME", "values": [name]}])
            for page in pages:
                for job in page["jobSummaryList"]:
                    if job["jobName"] == name and (newest is None or job["createdAt"] > newest["createdAt"]):
                        newest = job
        return newest

    def submit(self, spec: JobSpec, replace: bool = False) -> str:
        queue = self._queue(spec)
        existing = self.find(spec.name)
        if existing is not None and existing["status"] in ACTIVE_STATES:
            if not replace:
                raise UserError(f"job {spec.name!r} is {existing['status']} on AWS Batch",
                                "choose another name, or pass --replace to end it first (checkpoints are kept)")
            self.batch.terminate_job(jobId=existing["jobId"], reason="trainctl submit --replace")
        definition = self.batch.register_job_definition(**self.job_definition(spec))
        submitted = self.batch.submit_job(jobName=spec.name, jobQueue=queue,
                                          jobDefinition=definition["jobDefinitionArn"],
                                          tags={"platform": self.config.name_prefix, "job": spec.name})
        return submitted["jobId"]

    def _job(self, name: str) -> dict:
        found = self.find(name)
        if found is None:
            raise UserError(f"no AWS Batch job {name!r} in the platform's queues", "see `trainctl list --backend batch`")
        return self.batch.describe_jobs(jobs=[found["jobId"]])["jobs"][0]

    def status(self, name: str) -> BatchStatus:
        job = self._job(name)
        attempts = [f"{a.get('statusReason') or 'ended'}" + (
            f", exit {a['container']['exitCode']}" if a.get("container", {}).get("exitCode") is not None else "")
            for a in job.get("attempts", [])]
        nodes = job.get("nodeProperties", {}).get("numNodes", 0)
        return BatchStatus(name, job["jobId"], job["status"], job.get("statusReason", ""), attempts, nodes)

    def log(self, name: str, rank: int = 0) -> str:
        """A node's log from CloudWatch Logs (node ``rank`` of the newest attempt)."""
        job = self._job(name)
        node = self.batch.describe_jobs(jobs=[f"{job['jobId']}#{rank}"])["jobs"]
        stream = node[0].get("container", {}).get("logStreamName") if node else None
        if not stream:
            raise UserError(f"node {rank} of {name!r} has no log yet", "wait until it runs (trainctl status)")
        events = self.logs.get_log_events(logGroupName=self.config.batch_log_group,
                                          logStreamName=stream, startFromHead=True)["events"]
        return "".join(e["message"] + "\n" for e in events)

    def node_for_rank(self, name: str, rank: int) -> int:
        """The node whose workers hold global rank ``rank``, from its agent's newest ``node_ranks``
        line, as on EKS (trainctl.backends.eks.pod_for_rank)."""
        claims = {}
        for node in range(self.status(name).nodes):
            with contextlib.suppress(UserError):  # no log yet
                claims[node] = rank_claim(self.log(name, node), rank)
        return newest_claim(claims, rank, name, "node", "once it runs")

    def cancel(self, name: str) -> None:
        job = self._job(name)
        if job["status"] not in ACTIVE_STATES:
            raise UserError(f"job {name!r} already ended ({job['status']})", "nothing to cancel")
        self.batch.terminate_job(jobId=job["jobId"], reason="trainctl cancel")

    def list(self) -> list[tuple[str, str]]:
        jobs = []
        for group in self.config.batch.node_groups:
            for state in ACTIVE_STATES:
                for page in self.batch.get_paginator("list_jobs").paginate(
                        jobQueue=self.config.batch_name(group), jobStatus=state):
                    jobs += [(j["jobName"], j["status"]) for j in page["jobSummaryList"]]
        return sorted(jobs)


class BatchBackend(Backend):
    name = "batch"
    options = {
        "submit": frozenset({"--replace", "--wait"}),
        "status": frozenset({"--watch", "-o"}),
        "logs": frozenset({"--rank", "--pod"}),
        "list": frozenset({"-o"}),
    }
    hints = {"logs": "each node's log in CloudWatch Logs, the newest attempt",
             "submit": "`trainctl render JOB` shows what would run"}

    def __init__(self, connection: Connection):
        super().__init__(connection)
        self._jobs: BatchJobs | None = None

    @classmethod
    def where(cls, connection: Connection, command: str) -> str:
        return f"AWS Batch in {connection.config.region}"

    @property
    def client(self) -> BatchJobs:
        if self._jobs is None:
            self._jobs = BatchJobs(self.connection.aws_session(), self.config)
        return self._jobs

    def submit(self, spec: JobSpec, options: SubmitOptions) -> Submitted:
        job_id = self.client.submit(spec, options.replace)
        print(f"submitted {spec.name} to AWS Batch ({job_id}), {spec.max_nodes} nodes")
        return Submitted(spec.name)

    def status(self, name: str) -> BatchStatus:
        return self.client.status(check_name("job name", name))

    def jobs(self) -> list[dict]:
        return [{"name": name, "state": state} for name, state in self.client.list()]

    def nothing_listed(self) -> str:
        return "no active jobs in the platform's AWS Batch queues"

    def logs(self, name: str, options: LogOptions) -> None:
        check_name("job name", name)
        node = options.pod if options.pod is not None else self.client.node_for_rank(name, options.rank or 0)
        print(self.client.log(name, node), end="")

    def cancel(self, name: str) -> str:
        self.client.cancel(check_name("job name", name))
        return f"cancelled {name} on AWS Batch; checkpoints stay on the file system and in S3"


BACKEND = BatchBackend
