"""The typed job spec: what a user writes to run a training job; the charts and the CLI both read it.

It is checked against the platform config and the instance catalog before anything is
rendered: a node group the platform does not define, more accelerators, EFA or network topology
than the type has, or min > max nodes each give one line naming the field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, model_validator

from config import AcceleratedNodeGroupConfig, PlatformConfig
from config.catalog import NETWORK_LAYERS, Accelerator, InstanceType
from config.fields import IMAGE_HELP, K8S_NAME_HELP, K8S_NAME_PATTERN, K8sName, pinned_image
from training.config import check_overrides
from training.contract import (
    CHECKPOINT_DIR_ENV, FSX_MOUNT, PLATFORM_TUNING, TRAINER_PROGRAM, checkpoint_dir, program_arguments, staging_dir,
)
from typed_config import ConfigError, FieldProblem, StrictModel, raise_problems, read_yaml_mapping, validate

# GPU jobs: a peer that stops answering fails the step after this long (the post-warm-up
# process-group timeout; NCCL's watchdog then aborts the communicator).
GPU_COLLECTIVE_TIMEOUT_S = 30
# Trainer settings the job spec owns: set through the spec's own fields.
_OWNED_TRAINER_ARGS = {"checkpoint.dir": "checkpoint_path", "metrics.straggler_policy": "straggler_policy"}
# Pod names are <job>-<task>-<index>; leave room for both within 63 characters.
JobName = Annotated[str, Field(pattern=r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")]
_PATTERN_HELP = {
    r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$": "lowercase letters, digits and '-', starting with a letter, at most 40",
    K8S_NAME_PATTERN: K8S_NAME_HELP,
}
# A module torchrun runs with -m: dotted Python identifiers (ASCII, as module file names on an image are).
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# Fields of the packaged trainer that a job running its own program cannot use.
_TRAINER_FIELDS = ("trainer_args", "trainer_config", "dataset_path")


class Program(StrictModel):
    """A torchrun program of the job's own, in its own image, run instead of the packaged trainer
    (docs/job-spec.md, "Your own torchrun program"): exactly one of ``module`` and ``script``, and its arguments."""

    module: str | None = None  # python -m <module>, e.g. torchtitan.train
    script: str | None = None  # an absolute path inside the image, e.g. /workspace/train.py
    args: list[str] = []

    def problems(self) -> list[FieldProblem]:
        if (self.module is None) == (self.script is None):
            value = {"module": self.module, "script": self.script}
            return [FieldProblem("program", value, "exactly one of program.module (python -m) and program.script")]
        if self.module is not None and not _MODULE.match(self.module):
            return [FieldProblem("program.module", self.module, "a dotted Python module name, e.g. torchtitan.train")]
        if self.script is not None and (not self.script.startswith("/") or ".." in self.script.split("/")
                                        or self.script.endswith("/")):
            return [FieldProblem("program.script", self.script, "an absolute path to a file inside the image, "
                                 "without '..', e.g. /workspace/train.py")]
        return []

    def arguments(self) -> list[str]:
        return program_arguments(module=self.module, script=self.script, args=self.args)


class NetworkTopology(StrictModel):
    """Where the job's nodes may sit in the network (docs/job-spec.md, "Placement by network topology").

    ``tier`` counts network nodes up from the instances, as Volcano's HyperNode tiers do: 1 = all
    under one layer-3 network node of EC2's topology (the one the instances hang from), 2 = one
    layer-2 node, 3 = one layer-1 node (the top). ``hard``: the job's pods wait until they fit
    within one network node of that tier; ``soft``: the scheduler prefers the lowest tier that
    fits, and places the job anyway. ``none``: no topology is asked for.
    """

    mode: Literal["none", "soft", "hard"] = "none"
    tier: int = Field(default=1, ge=1, le=NETWORK_LAYERS)

    def problems(self, instance: InstanceType) -> list[FieldProblem]:
        if self.mode == "none":
            return []
        if instance.network_layers == 0:
            return [FieldProblem("network_topology.mode", self.mode, "none",
                                 f"{instance.name} has no network topology in EC2's DescribeInstanceTopology")]
        if self.tier > instance.network_layers:
            return [FieldProblem("network_topology.tier", self.tier, f"1 to {instance.network_layers}",
                                 f"{instance.name} has {instance.network_layers} network layers")]
        return []


class JobSpec(StrictModel):
    """One elastic training job. Validate with :func:`load_job_spec` (it needs the platform config)."""

    name: JobName
    image: str
    node_group: str
    min_nodes: int = Field(default=1, ge=1)
    max_nodes: int = Field(default=1, ge=1)
    # None: every accelerator of the instance type (the catalog's count).
    accelerators_per_node: int | None = Field(default=None, ge=1)
    # None: EFA wherever the node group has it.
    efa: bool | None = None
    # Trainer config overrides, e.g. {"model.name": "resnet50", "train.epochs": 90}.
    trainer_args: dict[str, Any] = {}
    trainer_config: str | None = None  # a trainer YAML inside the image or on /fsx
    dataset_path: str | None = None
    checkpoint_path: str | None = None  # default /fsx/checkpoints/<name>
    max_restarts: int = Field(default=100, ge=0)
    # Nodes that arrive while the job trains are admitted together, once it has trained this long
    # since its last (re)start: arrivals batch into one restart, and every restart is followed by
    # progress (docs/elasticity-and-checkpoints.md, "Elasticity at scale"). 0 admits at once.
    scale_up_after_s: int = Field(default=int(PLATFORM_TUNING.scale_up_after_s), ge=0, le=3600)
    queue: K8sName | None = None  # default: the platform's queue (trainctl submit checks the cluster has it)
    priority_class: K8sName | None = None  # default: the platform's PriorityClass (likewise)
    env: dict[str, str] = {}
    # None: the packaged trainer (-m training train with trainer_args) in the platform's image.
    program: Program | None = None
    # What the trainer does with a straggler it names: report it, or also replace its node (the pods then
    # carry a token that may taint their own node, and nothing else: k8s_charts/own_node.py).
    straggler_policy: Literal["report", "replace"] = "report"
    # Placement by the network's topology (Volcano's networkTopology); EKS only.
    network_topology: NetworkTopology = NetworkTopology()

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo):
        """Every rule is checked before any is reported: one run lists all of a spec's mistakes."""
        problems: list[FieldProblem] = []
        if not pinned_image(self.image):
            problems.append(FieldProblem("image", self.image, IMAGE_HELP))
        if self.priority_class and self.priority_class.startswith("system-"):
            problems.append(FieldProblem("priority_class", self.priority_class, "the platform's PriorityClass or one "
                                         "of yours", "system- classes are reserved for the cluster's own critical pods"))
        if self.min_nodes > self.max_nodes:
            problems.append(FieldProblem("min_nodes", self.min_nodes, f"at most max_nodes ({self.max_nodes})"))
        for field in ("dataset_path", "checkpoint_path"):
            value = getattr(self, field)
            if value is not None and not (value == FSX_MOUNT or value.startswith(f"{FSX_MOUNT}/")) or (
                value and ".." in value.split("/")
            ):
                problems.append(FieldProblem(field, value, f"an absolute path on the shared file system, under "
                                             f"{FSX_MOUNT}/"))
        if self.program is not None:
            problems += self.program.problems()
            for field in _TRAINER_FIELDS:
                value = getattr(self, field)
                if value:
                    problems.append(FieldProblem(field, value, "nothing with program: the packaged trainer's "
                                                 "setting; give your program its own in program.args or env"))
            if self.straggler_policy == "replace":
                problems.append(FieldProblem("straggler_policy", self.straggler_policy, "report with program (the "
                                             "packaged trainer names and replaces stragglers)"))
            if CHECKPOINT_DIR_ENV in self.env:
                problems.append(FieldProblem(f"env.{CHECKPOINT_DIR_ENV}", self.env[CHECKPOINT_DIR_ENV],
                                             "nothing: the platform sets it from checkpoint_path"))
        config: PlatformConfig | None = (info.context or {}).get("platform")
        if config is not None:
            problems += self._problems_against(config)
        raise_problems(problems)
        return self

    def _problems_against(self, config: PlatformConfig) -> list[FieldProblem]:
        groups = {g.name: g for g in config.accelerated_node_groups}
        if self.node_group not in groups:
            return [FieldProblem("node_group", self.node_group, ", ".join(groups), "not a node group of this platform")]
        group = groups[self.node_group]
        instance = group.instance
        problems = []
        if self.program is not None and config.jobs.launcher_image is None:
            problems.append(FieldProblem("program", self.program.model_dump(exclude_defaults=True),
                                         "the packaged trainer only (no program), until the platform config sets "
                                         "jobs.launcher_image", "the pods need the platform's launcher image"))
        if self.max_nodes > group.max_size:
            problems.append(FieldProblem("max_nodes", self.max_nodes, f"at most {group.max_size}, the node group's "
                                         "max_size"))
        if self.accelerators_per_node is not None and self.accelerators_per_node > instance.accelerator_count:
            problems.append(FieldProblem("accelerators_per_node", self.accelerators_per_node,
                                         f"1 to {instance.accelerator_count}",
                                         f"{instance.name} has {instance.accelerator_count} {instance.accelerator_model}"))
        if self.efa and not instance.supports_efa:
            problems.append(FieldProblem("efa", True, "false or null", f"{instance.name} has no EFA interfaces"))
        elif self.efa and not group.efa_enabled:
            problems.append(FieldProblem("efa", True, "false or null",
                                         f"node group {group.name} is configured without EFA"))
        problems += self.network_topology.problems(instance)
        return problems

    # --- derived from the catalog ------------------------------------------------------------

    def group(self, config: PlatformConfig) -> AcceleratedNodeGroupConfig:
        return next(g for g in config.accelerated_node_groups if g.name == self.node_group)

    def accelerators(self, config: PlatformConfig) -> int:
        return self.accelerators_per_node or self.group(config).instance.accelerator_count

    def nproc_per_node(self, config: PlatformConfig) -> int:
        """One worker per GPU, or per NeuronCore (the catalog's cores per device)."""
        instance = self.group(config).instance
        return instance.nproc_per_node * self.accelerators(config) // instance.accelerator_count

    def efa_devices(self, config: PlatformConfig) -> int:
        group = self.group(config)
        enabled = group.efa_enabled if self.efa is None else self.efa
        if not enabled:
            return 0
        # A share of the node's interfaces in proportion to its accelerators; all of them for a whole node.
        return max(1, group.instance.efa_interfaces * self.accelerators(config) // group.instance.accelerator_count)

    def checkpoint_dir(self) -> str:
        return self.checkpoint_path or checkpoint_dir(self.name)

    def program_arguments(self, config: PlatformConfig) -> list[str]:
        """What the launcher runs after torchrun's flags: the job's own program, or the packaged trainer with its flags."""
        if self.program is not None:
            return self.program.arguments()
        return [*TRAINER_PROGRAM, *self.trainer_flags(config)]

    def program_environment(self) -> dict[str, str]:
        """What the platform tells a program of the job's own (nothing for the packaged trainer, which gets flags)."""
        return {CHECKPOINT_DIR_ENV: self.checkpoint_dir()} if self.program is not None else {}

    def trainer_flags(self, config: PlatformConfig) -> list[str]:
        """The trainer's command-line arguments in the job's pods: the user's trainer_args, plus
        where this job keeps its checkpoints and data and how long a GPU peer may stay silent."""
        flags = [f"--config={self.trainer_config}"] if self.trainer_config else []
        args = {**self.trainer_args, "checkpoint.dir": self.checkpoint_dir()}
        if self.straggler_policy != "report":
            args["metrics.straggler_policy"] = self.straggler_policy
        args.setdefault("checkpoint.staging_dir", self.staging_dir())
        if self.dataset_path:
            args.setdefault("data.path", self.dataset_path)
        if self.group(config).instance.accelerator is Accelerator.NVIDIA:
            args.setdefault("distributed.timeout_s", GPU_COLLECTIVE_TIMEOUT_S)
        return flags + [f"--{key}={_flag_value(value)}" for key, value in args.items()]

    def staging_dir(self) -> str:
        """Where checkpoint files are written before their rename: on FSx, outside the S3-linked
        directories, so nothing half-written is exported."""
        return staging_dir(self.name)


def _flag_value(value: Any) -> str:
    """A value as the trainer reads it back (one YAML scalar or flow collection)."""
    if value is None or isinstance(value, (bool, list, dict)):
        return json.dumps(value)
    return str(value)


def _check_trainer_args(spec: JobSpec, config: PlatformConfig, source: str) -> None:
    """The trainer's own config model judges the arguments the pods will run with, here, before
    anything is rendered: a typo inside a pod would be retried by torchrun and Volcano for hours.
    With a trainer_config file (inside the image, unreadable here) only the keys the job sets are
    judged, and the rules that relate them to keys the file may set are left to the trainer."""
    problems = []
    for key, value in spec.trainer_args.items():
        flat = {f"{key}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value}
        for owned, field in _OWNED_TRAINER_ARGS.items():
            if owned in flat:
                problems.append(f"trainer_args.{owned}: got {json.dumps(flat[owned])} (the job spec sets it); "
                                f"allowed: set {field} in the job spec instead")
    problems += [f"trainer_args.{line}" for line in check_overrides(
        spec.trainer_flags(config)[1 if spec.trainer_config else 0:], partial=spec.trainer_config is not None)]
    if problems:
        raise ConfigError(source, problems)


def parse_job_spec(data: dict[str, Any], config: PlatformConfig, source: str = "job") -> JobSpec:
    """Validate a job spec mapping against the platform config. Raises ConfigError listing every
    mistake: the spec's own, and its trainer_args' even when the rest of the spec is wrong."""
    try:
        spec = validate(JobSpec, data, source, _PATTERN_HELP, context={"platform": config})
    except ConfigError as exc:
        raise ConfigError(source, exc.problems + _trainer_args_alone(data, exc.problems)) from None
    if spec.program is None:
        _check_trainer_args(spec, config, source)
    return spec


def _trainer_args_alone(data: dict[str, Any], problems: list[str]) -> list[str]:
    """The problems of a spec's trainer_args judged by themselves (key by key, as with a
    trainer_config file), for a spec whose other mistakes keep it from being checked whole."""
    args = data.get("trainer_args")
    if data.get("program") is not None or not isinstance(args, dict) or not args or any(
            p.startswith("trainer_args") for p in problems):
        return []
    flags = [f"--{key}={_flag_value(value)}" for key, value in args.items() if key not in _OWNED_TRAINER_ARGS]
    return [f"trainer_args.{line}" for line in check_overrides(flags, partial=True)]


def load_job_spec(path: str | Path, config: PlatformConfig) -> JobSpec:
    """Read and validate a job spec file against the platform config. Raises ConfigError."""
    data = read_yaml_mapping(path, "pass an existing job spec YAML, e.g. k8s_charts/examples/resnet50-p4d.yaml")
    return parse_job_spec(data, config, str(path))
