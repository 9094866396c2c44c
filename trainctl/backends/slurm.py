"""The same job spec on Slurm (AWS ParallelCluster, the slurm stack): an sbatch script rendered from it,
and submit, status, logs, cancel and list through a shell on the head node (trainctl/backends/slurm_transport.py).

The script asks for min..max whole nodes of the node group's queue and runs one task per node: the
platform's launcher with torchrun's static rendezvous at the allocation's first node
(training.contract.slurm_launch_command). A lost node makes Slurm requeue the whole job
(``--requeue``): the script runs again on a fresh allocation, of any size from min to max, and the
trainer resumes from its newest checkpoint on /fsx, as after any restart on EKS. The workers' stop
budget lies inside the cluster's KillWait, Slurm's time between SIGTERM and SIGKILL.

Each node's output goes to its own file under the job's folder on /fsx (``logs/node-<index>.log``,
appended across incarnations, as a pod's log is per pod); the script's own output, with one line per
incarnation, to ``logs/batch.log``.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from config import PlatformConfig
from k8s_charts.job_charts import cache_environment, nccl_environment, spot_environment
from config.job_spec import JobSpec
from trainctl.errors import UserError
from trainctl.backends import (
    Backend, Connection, LogOptions, SubmitOptions, Submitted, metrics_events, newest_claim, rank_claim, say,
)
from trainctl.backends.slurm_transport import STDOUT_LIMIT, OutputTruncated
from training.contract import (
    EXIT_CONFIG, EXIT_RESTART_JOB, FSX_MOUNT, LAUNCH_ENVIRONMENT, LAUNCHER_ENTRY, LAUNCHER_MOUNT, NODE_RANKS_EVENT,
    PLATFORM_APP_DIR, RESTART_MARKER_ENV, SLURM_KILL_WAIT_S, cache_dir, launcher_copy_command, slurm_launch_command,
)

# A node's log is read from its last lines only; a job requeued more often shows its newest incarnations.
SCAN_LINES = 5000
MAX_INCARNATIONS = 100
# What `trainctl list` shows: jobs submitted by trainctl for this platform carry this comment.
COMMENT_PREFIX = "trainctl:"
NODE_LOG = "node-%n.log"  # srun --output: %n is the node's index in the job (srun(1), "filename pattern")
BATCH_LOG = "batch.log"
INCARNATION_EVENT = "slurm_incarnation"


def job_folder(name: str) -> str:
    """A Slurm job's logs and launcher copy on the shared file system, outside the S3-linked folders."""
    return f"{FSX_MOUNT}/slurm/{name}"


def log_folder(name: str) -> str:
    return f"{job_folder(name)}/logs"


@dataclass(frozen=True)
class SlurmRuntime:
    """How the nodes run the job: the job's image under Pyxis/Enroot (``python`` None), or a Python
    environment on the nodes where the platform's package is installed (a cluster without Pyxis)."""

    python: str | None = None

    @property
    def container(self) -> bool:
        return self.python is None


def pyxis_image(image: str) -> str:
    """An image reference as enroot reads it: the registry separated from the repository by '#'
    (enroot doc/cmd/import.md, ``docker://[USER@][REGISTRY#]IMAGE[:TAG]``; Pyxis's --container-image)."""
    registry, _, rest = image.partition("/")
    return f"{registry}#{rest}" if "." in registry or ":" in registry else image


class Expand(str):
    """A word of the script the shell expands (a Slurm variable in it): written in double quotes.
    Only the platform's own paths are ever one: no quote, backquote or backslash can be in them."""


def _words(parts: list[str]) -> str:
    return " ".join(f'"{part}"' if isinstance(part, Expand) else shlex.quote(part) for part in parts)


ECR_REGISTRY = re.compile(r"^(\d{12})\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com(\.cn)?$")


def enroot_credentials(images: list[str]) -> list[str]:
    """Lines that give Enroot a login to each ECR registry of ``images``, once per user: an entry of its
    netrc-style credentials file whose password is a command Enroot runs at each import, so the 12-hour
    ECR token is never stale (enroot doc/cmd/import.md, "Amazon Elastic Container Registry"; the AWS CLI
    and the node role's ecr:GetAuthorizationToken, granted by the slurm stack, are on every node). The
    folder is Enroot's ENROOT_CONFIG_PATH, by default under $HOME, which ParallelCluster shares with
    every node."""
    registries = sorted({image.split("/", 1)[0] for image in images if ECR_REGISTRY.match(image.split("/", 1)[0])})
    if not registries:
        return []
    lines = ['enroot_config="${ENROOT_CONFIG_PATH:-${XDG_CONFIG_HOME:-$HOME/.config}/enroot}"',
             'mkdir -p "$enroot_config" && touch "$enroot_config/.credentials" && chmod 600 "$enroot_config/.credentials"']
    for registry in registries:
        region = ECR_REGISTRY.match(registry).group(2)
        entry = f"machine {registry} login AWS password $(aws ecr get-login-password --region {region})"
        lines.append(f'grep -qs {shlex.quote(f"^machine {registry} ")} "$enroot_config/.credentials" || '
                     f'echo {shlex.quote(entry)} >> "$enroot_config/.credentials"')
    return lines


def job_environment(config: PlatformConfig, spec: JobSpec) -> dict[str, str]:
    """The environment every node's task gets: the same functions the EKS pods' comes from."""
    group = spec.group(config)
    instance = group.instance
    return {**nccl_environment(spec.efa_devices(config) > 0, rdma=instance.efa_rdma),
            **cache_environment(spec, config), **LAUNCH_ENVIRONMENT, "OMP_NUM_THREADS": "1",
            **spot_environment(group), **spec.program_environment(), **spec.env}


def render_for(config: PlatformConfig, spec: JobSpec, runtime: SlurmRuntime = SlurmRuntime()) -> str:
    """The script of ``spec`` for its node group's queue on the platform's Slurm cluster (config.slurm)."""
    queues = [queue.node_group for queue in config.slurm.queues]
    if spec.node_group not in queues:
        raise UserError(f"node_group: got {spec.node_group!r}, which has no Slurm queue",
                        f"allowed with --backend slurm: {', '.join(queues)} (slurm.queues in the platform config)")
    if runtime.container and spec.program is not None and config.jobs.launcher_image is None:
        raise UserError("program: the job runs its own program, and jobs.launcher_image is not set",
                        "set jobs.launcher_image in the platform config, or pass --python")
    return render_script(config, spec, partition=spec.node_group, kill_wait_s=SLURM_KILL_WAIT_S,
                         runtime=runtime)


def render_script(config: PlatformConfig, spec: JobSpec, *, partition: str, kill_wait_s: int,
                  runtime: SlurmRuntime = SlurmRuntime()) -> str:
    """The sbatch script of ``spec`` (validated against ``config``), for the queue ``partition``."""
    own_program = spec.program is not None
    logs = log_folder(spec.name)
    launcher = None
    if runtime.container and own_program:
        launcher = LAUNCHER_ENTRY
    command = slurm_launch_command(
        nproc_per_node=spec.nproc_per_node(config), max_restarts=spec.max_restarts, kill_wait_s=kill_wait_s,
        python=runtime.python or "python", program=spec.program_arguments(config), launcher=launcher)
    nodes = f"{spec.min_nodes}-{spec.max_nodes}" if spec.min_nodes < spec.max_nodes else str(spec.max_nodes)
    lines = [
        "#!/bin/bash",
        f"# Rendered by trainctl from job spec {spec.name!r} for platform {config.name_prefix!r}: render it again,",
        "# rather than edit it (trainctl submit --backend slurm --dry-run prints it).",
        f"#SBATCH --job-name={spec.name}",
        f"#SBATCH --partition={partition}",
        # Whole instances, min..max of them: Slurm starts the job on as many as it can give at once.
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        # A failed node requeues the job (with the cluster's JobRequeue=1 this is the default; said here).
        "#SBATCH --requeue",
        f"#SBATCH --output={logs}/{BATCH_LOG}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --comment={COMMENT_PREFIX}{config.name_prefix}",
        "set -uo pipefail",
    ]
    env = job_environment(config, spec)
    lines += [f"export {key}={shlex.quote(value)}" for key, value in sorted(env.items())]
    # The launcher says here that it asked for a fresh incarnation: srun's own status cannot (RESTART_MARKER_ENV).
    lines.append(f'export {RESTART_MARKER_ENV}="{logs}/restart-${{SLURM_JOB_ID}}-${{SLURM_RESTART_COUNT:-0}}"')
    # The job's folders, made by the submitting user, whom Pyxis runs the container as: a folder the
    # user may not write fails here in one line, not at the first checkpoint. Their parents are the
    # cluster's shared folders (mode 1777, made by the head node's custom action).
    folders = [spec.checkpoint_dir(), cache_dir(spec.name), *([] if own_program else [spec.staging_dir()])]
    refused = (f"config error: cannot create the job's folders on {FSX_MOUNT} as the submitting user; allowed: "
               "folders this user may write (docs/slurm.md, Running jobs)")
    lines.append(f"mkdir -p {' '.join(map(shlex.quote, folders))} || "
                 f"{{ echo {shlex.quote(refused)} >&2; exit {EXIT_CONFIG}; }}")
    # One JSON line per incarnation in batch.log: trainctl status counts the requeues from them.
    lines.append(f'echo "{{\\"event\\": \\"{INCARNATION_EVENT}\\", \\"job\\": \\"{spec.name}\\", '
                 '\\"job_id\\": $SLURM_JOB_ID, \\"restart\\": ${SLURM_RESTART_COUNT:-0}, '
                 '\\"nodes\\": $SLURM_JOB_NUM_NODES, \\"nodelist\\": \\"$SLURM_JOB_NODELIST\\", '
                 '\\"time\\": $(date +%s.%N)}"')
    srun: list[str] = ["srun", "--ntasks-per-node=1",
                       # One node's task failing ends the step on every node: the trainer's exit statuses
                       # (config error, divergence) end the job, and a requeue starts every node afresh.
                       "--kill-on-bad-exit=1", f"--output={logs}/{NODE_LOG}", "--open-mode=append"]
    if runtime.container:
        lines += enroot_credentials([spec.image, *([config.jobs.launcher_image] if own_program else [])])
        mounts = [f"{FSX_MOUNT}:{FSX_MOUNT}"]
        if own_program:
            # The job's own image may lack the launcher: a copy from the platform's image, per
            # incarnation, mounted read-only (as the init container does on EKS).
            copy = f"{job_folder(spec.name)}/launcher-${{SLURM_JOB_ID}}-${{SLURM_RESTART_COUNT:-0}}"
            lines.append(f'mkdir -p "{copy}"')
            platform_image = pyxis_image(config.jobs.launcher_image)
            lines.append(_words(["srun", "--nodes=1", "--ntasks=1", f"--container-image={platform_image}",
                                 Expand(f"--container-mounts={copy}:{LAUNCHER_MOUNT}"),
                                 f"--container-workdir={PLATFORM_APP_DIR}", "--no-container-mount-home",
                                 *launcher_copy_command(LAUNCHER_MOUNT)]) + f" || exit {EXIT_CONFIG}")
            mounts.append(f"{copy}:{LAUNCHER_MOUNT}:ro")
        # Pyxis gives an image's own value of a variable precedence over the job's, unless the variable
        # is named in --container-env (NVIDIA/pyxis README, --container-env; pyxis_slurmstepd.c): named
        # here, the job's environment wins, as the pod's does on EKS.
        names = sorted([*env, RESTART_MARKER_ENV])
        srun += [f"--container-image={pyxis_image(spec.image)}", Expand(f"--container-mounts={','.join(mounts)}"),
                 "--no-container-mount-home", f"--container-env={','.join(names)}"]
        if not own_program:
            srun.append(f"--container-workdir={PLATFORM_APP_DIR}")
    lines.append(_words([*srun, *command]))
    lines += [
        "code=$?",
        # The launcher asked for a fresh incarnation (workers failed for good after progress): a requeue.
        f"if [ \"$code\" -eq {EXIT_RESTART_JOB} ] || [ -e \"${RESTART_MARKER_ENV}\" ]; then "
        "scontrol requeue \"$SLURM_JOB_ID\"; fi",
        "exit \"$code\"",
    ]
    return "\n".join(lines) + "\n"


# --- operating jobs through the head node's shell ------------------------------------------------

# squeue's states of a job that has not ended (squeue(1), "JOB STATE CODES").
ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
                 "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD")
_FIELDS = ("job_id", "name", "state", "reason", "nodes", "nodelist", "elapsed", "comment")
# squeue --format: %i id, %j name, %T state, %r reason, %D nodes, %N node list, %M time used, %k comment.
_FORMAT = "%i|%j|%T|%r|%D|%N|%M|%k"


@dataclass
class SlurmStatus:
    name: str
    job_id: str
    state: str
    reason: str
    nodes: int
    nodelist: str
    restarts: int
    exit_code: str
    incarnations: list[dict]
    last_step: dict | None
    checkpoint: dict | None
    where: str

    @property
    def finished(self) -> bool:
        return self.state not in ACTIVE_STATES

    @property
    def succeeded(self) -> bool:
        return self.state == "COMPLETED"

    def summary(self) -> str:
        return f"{self.name}: {self.state}" + (f" (requeued {self.restarts})" if self.restarts else "")

    def as_dict(self) -> dict:
        return {"name": self.name, "job_id": self.job_id, "state": self.state, "reason": self.reason,
                "finished": self.finished, "nodes": self.nodes, "nodelist": self.nodelist, "restarts": self.restarts,
                "exit_code": self.exit_code, "incarnations": self.incarnations, "last_step": self.last_step,
                "checkpoint": self.checkpoint}

    def format(self) -> str:
        reason = f" ({self.reason})" if self.reason and self.reason != "None" else ""
        lines = [f"job {self.name} (Slurm job {self.job_id}, {self.where}): {self.state}{reason}",
                 f"nodes: {self.nodes}" + (f" ({self.nodelist})" if self.nodelist else ""),
                 f"requeued: {self.restarts} time(s)" + (f"; exit code {self.exit_code}" if self.finished else "")]
        for i in self.incarnations:
            lines.append(f"  incarnation {i['restart']}: {i['nodes']} node(s) {i['nodelist']}")
        if self.last_step:
            s = self.last_step
            lines.append(f"last step: {s['step']} (epoch {s['epoch']}), loss {s['loss']}, world size "
                         f"{s.get('world_size', '?')}, {s['samples_per_s']} samples/s")
        if self.checkpoint:
            lines.append(f"newest checkpoint: {self.checkpoint['path']} (step {self.checkpoint['step']})")
        return "\n".join(lines)


class SlurmJobs:
    """Jobs of this platform on a Slurm cluster, through ``shell`` (a trainctl.backends.slurm_transport.SlurmShell)."""

    def __init__(self, shell, config: PlatformConfig):
        self.shell = shell
        self.config = config
        self.comment = f"{COMMENT_PREFIX}{config.name_prefix}"
        self.note: str | None = None  # what the last logs() left out, said on stderr

    def _run(self, *argv: str, input: str | None = None, ok: tuple[int, ...] = (0,)) -> str:
        done = self.shell.run(list(argv), input=input)
        if done.returncode not in ok:
            detail = (done.stderr or done.stdout).strip().splitlines()
            raise UserError(f"{argv[0]} on {self.shell.where} failed (exit {done.returncode}): "
                            f"{detail[-1] if detail else 'no output'}",
                            "check the cluster with `sinfo` on the head node, then retry")
        return done.stdout

    def jobs(self, name: str | None = None) -> list[dict]:
        """This platform's jobs Slurm still knows (running, or ended within MinJobAge), oldest first."""
        argv = ["squeue", "--noheader", "--states=all", f"--format={_FORMAT}"]
        if name:
            argv.append(f"--name={name}")
        rows = []
        for line in self._run(*argv).splitlines():
            values = line.split("|", len(_FIELDS) - 1)
            if len(values) == len(_FIELDS):
                row = dict(zip(_FIELDS, values, strict=True))
                if row["comment"] == self.comment:
                    rows.append(row)
        return sorted(rows, key=lambda r: int(r["job_id"].split("_")[0]))

    def active(self, name: str) -> list[dict]:
        return [row for row in self.jobs(name) if row["state"] in ACTIVE_STATES]

    def submit(self, spec: JobSpec, script: str) -> str:
        running = self.active(spec.name)
        if running:
            row = running[-1]
            raise UserError(f"job {spec.name!r} is already {row['state']} as Slurm job {row['job_id']}",
                            f"wait for it, cancel it (`trainctl cancel {spec.name} --backend slurm`), or rename the job")
        # sbatch opens --output before the script runs: its folder must exist (sbatch(1), --output).
        out = self._run("bash", "-ec", 'mkdir -p "$1" && exec sbatch --parsable', "sbatch", log_folder(spec.name),
                        input=script)
        return out.strip().split(";")[0]

    def newest(self, name: str) -> dict:
        rows = self.jobs(name)
        if not rows:
            raise UserError(f"no Slurm job {name!r} of platform {self.config.name_prefix} on {self.shell.where}",
                            "see `trainctl list --backend slurm` (Slurm forgets an ended job after MinJobAge)")
        return rows[-1]

    def _last_events(self, path: str, kinds: tuple[str, ...], count: int = 1) -> list[dict]:
        """The newest ``count`` JSON lines of each kind in a log file, filtered on the head node: through
        SSM a command returns at most 24,000 characters (trainctl/backends/slurm_transport.py), a few hundred
        lines of a node's log. Only the file's last SCAN_LINES lines are read."""
        script = 'for kind in "${@:2}"; do tail -n %d "$1" | grep -F "{\\"event\\": \\"$kind\\"" | tail -n %d; done' % (
            SCAN_LINES, count)
        return metrics_events(self._run("bash", "-c", script, "last-events", path, *kinds, ok=(0, 1)))

    def status(self, name: str) -> SlurmStatus:
        row = self.newest(name)
        # Slurm may forget the job between the two calls (MinJobAge): then no details, not an error.
        details = dict(field.split("=", 1) for field in self._run(
            "scontrol", "show", "job", row["job_id"], "--oneline", ok=(0, 1)).split() if "=" in field)
        logs = log_folder(name)
        incarnations = self._last_events(f"{logs}/{BATCH_LOG}", (INCARNATION_EVENT,), count=MAX_INCARNATIONS)
        node0 = self._last_events(f"{logs}/node-0.log", ("step", "checkpoint_saved"))

        def last(kind):
            return next((e for e in reversed(node0) if e["event"] == kind), None)

        return SlurmStatus(
            name=name, job_id=row["job_id"], state=row["state"], reason=row["reason"], nodes=int(row["nodes"] or 0),
            nodelist=row["nodelist"], restarts=int(details.get("Restarts", "0")),
            exit_code=details.get("ExitCode", ""), where=self.shell.where,
            incarnations=[e for e in incarnations if str(e["job_id"]) == row["job_id"]],
            last_step=last("step"), checkpoint=last("checkpoint_saved"))

    def logs(self, name: str, *, rank: int | None = None, pod: int | None = None, tail: int = 200) -> str:
        """The last ``tail`` lines of a node's log: by node index (``pod``), or of the node whose agent last
        said it holds global rank ``rank``. Through SSM, fewer lines when they pass its limit (``self.note``)."""
        self.newest(name)
        folder = log_folder(name)
        files = sorted(f for f in self._run("ls", folder, ok=(0, 2)).split() if f.startswith("node-"))
        if pod is not None:
            wanted = f"node-{pod}.log"
            if wanted not in files:
                raise UserError(f"--pod: got {pod}, and job {name} has no node {pod}",
                                f"allowed: 0 to {len(files) - 1}" if files else "the job has not started yet")
            chosen = wanted
        else:
            rank = 0 if rank is None else rank
            claims = {f: rank_claim(json.dumps(events[-1]) if (events := self._last_events(
                f"{folder}/{f}", (NODE_RANKS_EVENT,))) else "", rank) for f in files}
            chosen = newest_claim(claims, rank, name, "node", f"in `trainctl status {name} --backend slurm`")
        self.note = None
        lines = tail
        while True:
            try:
                return self._run("tail", "-n", str(lines), f"{folder}/{chosen}")
            except OutputTruncated:
                if lines <= 1:
                    raise
                lines //= 2
                self.note = (f"showing the last {lines} lines of {chosen}: SSM returns at most "
                             f"{STDOUT_LIMIT:,} characters (`--on-head-node` on the head node shows more)")

    def cancel(self, name: str) -> list[str]:
        """scancel the job's active incarnation: SIGTERM, then SIGKILL after KillWait (scancel(1))."""
        ids = [row["job_id"] for row in self.active(name)]
        if not ids:
            raise UserError(f"no active Slurm job {name!r} of platform {self.config.name_prefix}",
                            "nothing to cancel; see `trainctl list --backend slurm`")
        self._run("scancel", *ids)
        return ids


class SlurmBackend(Backend):
    name = "slurm"
    options = {
        "submit": frozenset({"--dry-run", "--wait", "--python", "--on-head-node"}),
        "status": frozenset({"--watch", "-o", "--on-head-node"}),
        "logs": frozenset({"--rank", "--pod", "--on-head-node"}),
        "cancel": frozenset({"--on-head-node"}),
        "list": frozenset({"-o", "--on-head-node"}),
    }
    hints = {"logs": "each node's log file on /fsx, every incarnation appended",
             "submit": "--dry-run prints the sbatch script"}

    def __init__(self, connection: Connection):
        super().__init__(connection)
        if self.config.slurm is None:
            raise UserError("--backend slurm: this platform has no slurm section",
                            "add `slurm: {queues: [{node_group: ...}]}` to the config and deploy "
                            "(see config/slurm-example.yaml)")
        self._jobs: SlurmJobs | None = None

    @classmethod
    def where(cls, connection: Connection, command: str) -> str:
        config = connection.config
        how = "this machine as its head node" if connection.on_head_node else "its head node through SSM"
        return f"Slurm cluster {config.slurm_cluster_name if config.slurm else '(none)'} in {config.region}, {how}"

    @property
    def client(self) -> SlurmJobs:
        """The head node is reached on first use: a dry run never does."""
        if self._jobs is None:
            from trainctl.backends.slurm_transport import LocalShell, SsmShell

            shell = LocalShell() if self.connection.on_head_node else SsmShell(
                self.connection.aws_session(), region=self.config.region, cluster_name=self.config.slurm_cluster_name)
            self._jobs = SlurmJobs(shell, self.config)
        return self._jobs

    def submit(self, spec: JobSpec, options: SubmitOptions) -> Submitted:
        script = render_for(self.config, spec, SlurmRuntime(python=options.python))
        if options.dry_run:
            print(script, end="")
            return Submitted(None)
        job_id = self.client.submit(spec, script)
        print(f"submitted {spec.name} to Slurm (job {job_id}), {spec.min_nodes}..{spec.max_nodes} nodes "
              f"of queue {spec.node_group}")
        return Submitted(spec.name)

    def status(self, name: str) -> SlurmStatus:
        return self.client.status(name)

    def jobs(self) -> list[dict]:
        return [{"name": row["name"], "job_id": row["job_id"], "state": row["state"], "nodes": row["nodes"]}
                for row in self.client.jobs()]

    def list_line(self, row: dict) -> str:
        return f"{row['name']:<40} {row['state']:<12} job {row['job_id']}, {row['nodes']} node(s)"

    def nothing_listed(self) -> str:
        return f"no jobs of platform {self.config.name_prefix} on {self.client.shell.where}"

    def logs(self, name: str, options: LogOptions) -> None:
        text = self.client.logs(name, rank=options.rank, pod=options.pod)
        if self.client.note:
            say(self.client.note)
        print(text, end="")

    def cancel(self, name: str) -> str:
        ids = self.client.cancel(name)
        return (f"cancelled {name} (Slurm job {', '.join(ids)}): its nodes checkpoint within KillWait; "
                "checkpoints stay on /fsx")


BACKEND = SlurmBackend
