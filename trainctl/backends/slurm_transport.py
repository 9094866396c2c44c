"""How the Slurm backend reaches a Slurm controller: a shell transport that runs one argv.

``LocalShell`` runs it on this machine (trainctl on the head node, or the tests' loopback Slurm).
``SsmShell`` runs it on an AWS ParallelCluster head node through SSM Run Command
(``AWS-RunShellScript``), as the cluster's default user, and returns the real exit code. The
Slurm operations never import boto3: they get one of these.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import shlex
import subprocess
import time
import uuid
from dataclasses import dataclass
from typing import Protocol, Sequence

from trainctl.errors import UserError


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str


class SlurmShell(Protocol):
    where: str  # for messages, e.g. "head node i-0abc… of cluster mltrain-slurm (SSM)" or "this machine"

    def run(self, argv: Sequence[str], *, input: str | None = None, timeout: float = 60) -> Completed: ...


class OutputTruncated(UserError):
    """SSM kept only the first part of the command's output: ``stream`` is "stdout" or "stderr"."""

    def __init__(self, cause: str, fix: str, stream: str):
        super().__init__(cause, fix)
        self.stream = stream


class LocalShell:
    """Runs argv on this machine, ``input`` on its stdin."""

    where = "this machine"

    def run(self, argv: Sequence[str], *, input: str | None = None, timeout: float = 60) -> Completed:
        try:
            done = subprocess.run(list(argv), input=input if input is not None else "", capture_output=True,
                                  text=True, timeout=timeout)
        except FileNotFoundError:
            raise UserError(f"{argv[0]} not found on {self.where}",
                            "run trainctl on the cluster's head node, or put the Slurm commands on PATH") from None
        except subprocess.TimeoutExpired:
            raise UserError(f"`{shlex.join(argv)}` did not finish in {timeout:g} s on {self.where}",
                            "check that slurmctld answers (`scontrol ping`)") from None
        return Completed(done.returncode, done.stdout, done.stderr)


# Tags ParallelCluster puts on every instance it launches (aws-parallelcluster
# cli/src/pcluster/constants.py: PCLUSTER_CLUSTER_NAME_TAG, PCLUSTER_NODE_TYPE_TAG;
# templates/cdk_builder_utils.py get_default_instance_tags: node-type "HeadNode" for the head node).
CLUSTER_NAME_TAG = "parallelcluster:cluster-name"
NODE_TYPE_TAG = "parallelcluster:node-type"
HEAD_NODE = "HeadNode"
# Slurm's install prefix on ParallelCluster nodes (aws-parallelcluster-cookbook
# cookbooks/aws-parallelcluster-slurm/attributes/slurm_attributes.rb: ['slurm']['install_dir']).
SLURM_BIN = "/opt/slurm/bin"
# GetCommandInvocation keeps "the first 24,000 characters written by the plugin to stdout" and the
# first 8,000 of stderr (botocore 1.44.5 data/ssm/2014-11-06/service-2.json, GetCommandInvocationResult).
STDOUT_LIMIT, STDERR_LIMIT = 24_000, 8_000
# "The size limit of a document is 64 KB" (same model, MaxDocumentSizeExceeded): the command
# text, with the compressed input inside it, stays well below it.
COMMAND_LIMIT = 48_000
SSM_POLICY = "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"
# GetCommandInvocation's CommandInvocationStatus values after which nothing changes.
TERMINAL = {"Success", "Failed", "Cancelled", "TimedOut"}


def find_head_node(ec2, cluster_name: str, region: str) -> str:
    """The instance id of the running head node of ParallelCluster cluster ``cluster_name``."""
    def instances(filters):
        found = []
        for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
            for reservation in page["Reservations"]:
                found += reservation["Instances"]
        return found

    head = [{"Name": f"tag:{NODE_TYPE_TAG}", "Values": [HEAD_NODE]}]
    running = instances([*head, {"Name": f"tag:{CLUSTER_NAME_TAG}", "Values": [cluster_name]},
                         {"Name": "instance-state-name", "Values": ["running"]}])
    if running:
        return sorted(running, key=lambda i: i["LaunchTime"])[-1]["InstanceId"]
    others = instances([*head, {"Name": "instance-state-name", "Values": ["pending", "running", "stopping",
                                                                           "stopped"]}])
    mine = [i for i in others if _tag(i, CLUSTER_NAME_TAG) == cluster_name]
    if mine:
        state = mine[0]["State"]["Name"]
        raise UserError(f"the head node {mine[0]['InstanceId']} of cluster {cluster_name!r} is {state}, not running",
                        "start it (aws ec2 start-instances) or wait for it, then retry")
    names = sorted({_tag(i, CLUSTER_NAME_TAG) for i in others if i["State"]["Name"] == "running"} - {None})
    raise UserError(f"no running head node of ParallelCluster cluster {cluster_name!r} in {region}",
                    f"clusters with a running head node there: {', '.join(names)}; check the cluster name"
                    if names else "deploy the Slurm stack (npx cdk deploy) or check the cluster name and region")


def _tag(instance: dict, key: str) -> str | None:
    return next((t["Value"] for t in instance.get("Tags", []) if t["Key"] == key), None)


def ssm_ping_status(ssm, instance_id: str) -> str | None:
    """The SSM agent's PingStatus for the instance (Online, ConnectionLost, Inactive), None if unregistered."""
    found = ssm.describe_instance_information(Filters=[{"Key": "InstanceIds", "Values": [instance_id]}])
    listed = found.get("InstanceInformationList", [])
    return listed[0].get("PingStatus") if listed else None


def not_registered(instance_id: str, cluster_name: str, status: str | None) -> UserError:
    what = "is not registered with SSM" if status is None else f"has SSM status {status}"
    # ParallelCluster gives the head node role only the policies the config names, plus
    # CloudWatchAgentServerPolicy (aws-parallelcluster cli/src/pcluster/templates/cdk_builder_utils.py
    # _add_node_role); its own examples add this one (cloudformation/custom_resource/cluster-1-click.yaml).
    return UserError(f"the head node {instance_id} of cluster {cluster_name!r} {what}",
                     f"give the head node {SSM_POLICY} (HeadNode.Iam.AdditionalIamPolicies) and a route to the SSM "
                     "endpoints (NAT, or VPC endpoints ssm, ssmmessages, ec2messages); or run trainctl on the head "
                     "node with the local transport")


class SsmShell:
    """Runs argv on the head node of a ParallelCluster cluster through SSM Run Command.

    The command runs as ``user`` (the cluster's default user: ec2-user on Amazon Linux 2023,
    aws-parallelcluster cli/src/pcluster/constants.py OS_MAPPING), in a login shell in its home
    directory, so jobs are the user's and not root's, and sbatch's working directory is a
    directory the compute nodes share.
    """

    def __init__(self, session, *, region: str, cluster_name: str, user: str = "ec2-user",
                 poll_s: float = 1.0, delivery_s: float = 60.0):
        self.cluster_name, self.user, self.poll_s, self.delivery_s = cluster_name, user, poll_s, delivery_s
        self.ssm = session.client("ssm", region_name=region)
        self.instance_id = find_head_node(session.client("ec2", region_name=region), cluster_name, region)
        self.where = f"head node {self.instance_id} of cluster {cluster_name} (SSM)"

    def script(self, argv: Sequence[str], input: str | None, marker: str) -> str:
        """The shell script SSM runs as root: the command as the user, then a marker on both streams.

        AWS-RunShellScript runs its ``commands`` as root. ``sudo -H -u USER -- bash -lc CMD`` hands
        CMD over as one argument; ``sudo -i`` would instead join the arguments and backslash-escape
        them for the shell (sudo(8), -i), which turns an argument's newline into a line
        continuation. The input travels gzip'd and base64'd in a quoted here-document, so no byte
        of it is interpreted. The markers tell a complete stream from one SSM cut short.
        """
        inner = f"export PATH={SLURM_BIN}:\"$PATH\"; cd ~ && exec {shlex.join(argv)}"
        command = shlex.join(["sudo", "-H", "-u", self.user, "--", "bash", "-lc", inner])
        if input is None:
            lines = [f"{command} </dev/null"]
        else:
            packed = base64.b64encode(gzip.compress(input.encode())).decode()
            lines = [f"base64 -d <<'{marker}' | gunzip -c | {command}",
                     *(packed[i:i + 76] for i in range(0, len(packed), 76)), marker]
        return "\n".join([*lines, "rc=$?", f"printf '\\n%s\\n' '{marker}'", f"printf '\\n%s\\n' '{marker}' >&2",
                          "exit $rc"])

    def run(self, argv: Sequence[str], *, input: str | None = None, timeout: float = 60) -> Completed:
        from botocore.exceptions import ClientError

        marker = f"TRAINCTL-END-{uuid.uuid4().hex}"
        text = self.script(argv, input, marker)
        if len(text) > COMMAND_LIMIT:
            raise UserError(f"the input for `{argv[0]}` is too large to send through SSM ({len(text)} characters "
                            f"of command text, at most {COMMAND_LIMIT})",
                            "shorten it, or run trainctl on the head node with the local transport")
        try:
            sent = self.ssm.send_command(
                InstanceIds=[self.instance_id], DocumentName="AWS-RunShellScript",
                Comment=f"trainctl: {argv[0]}"[:100], TimeoutSeconds=max(30, int(self.delivery_s)),
                Parameters={"commands": [text], "executionTimeout": [str(max(1, int(timeout)))]})
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "InvalidInstanceId":
                raise not_registered(self.instance_id, self.cluster_name,
                                     ssm_ping_status(self.ssm, self.instance_id)) from None
            raise
        command_id = sent["Command"]["CommandId"]
        invocation = self._wait(command_id, deadline=time.monotonic() + timeout + self.delivery_s)
        return self._completed(argv, invocation, marker)

    def _wait(self, command_id: str, deadline: float) -> dict:
        from botocore.exceptions import ClientError

        pause = min(0.2, self.poll_s)
        while True:
            try:
                invocation = self.ssm.get_command_invocation(CommandId=command_id, InstanceId=self.instance_id)
            except ClientError as exc:
                # The invocation is not readable for a moment after SendCommand returns.
                if exc.response.get("Error", {}).get("Code") != "InvocationDoesNotExist":
                    raise
                invocation = {"Status": "Pending"}
            if invocation["Status"] in TERMINAL:
                return invocation
            if time.monotonic() > deadline:
                with contextlib.suppress(ClientError):  # it may have finished meanwhile; the message stands
                    self.ssm.cancel_command(CommandId=command_id, InstanceIds=[self.instance_id])
                ping = ssm_ping_status(self.ssm, self.instance_id)
                if invocation["Status"] in ("Pending", "Delayed") and ping != "Online":
                    raise not_registered(self.instance_id, self.cluster_name, ping)
                raise UserError(f"no answer from {self.where} in time (SSM command {command_id} is "
                                f"{invocation['Status']})", "retry; if it persists, check the head node's load")
            time.sleep(pause)
            pause = min(pause * 2, self.poll_s)

    def _completed(self, argv: Sequence[str], invocation: dict, marker: str) -> Completed:
        status, code = invocation["Status"], invocation.get("ResponseCode", -1)
        details = invocation.get("StatusDetails", status)
        if details in ("DeliveryTimedOut", "Undeliverable"):
            raise not_registered(self.instance_id, self.cluster_name, ssm_ping_status(self.ssm, self.instance_id))
        if status == "TimedOut":
            raise UserError(f"`{argv[0]}` timed out on {self.where} (SSM: {details})",
                            "retry; if it persists, check that slurmctld answers (`scontrol ping`)")
        if status == "Cancelled" or code < 0:
            raise UserError(f"SSM did not run `{argv[0]}` on {self.where} ({details})",
                            "retry; if it persists, check the head node's SSM agent")
        streams = {}
        for stream, key, limit in (("stdout", "StandardOutputContent", STDOUT_LIMIT),
                                   ("stderr", "StandardErrorContent", STDERR_LIMIT)):
            content = invocation.get(key, "")
            end = content.rfind(f"\n{marker}\n")
            if end < 0:
                raise OutputTruncated(
                    f"the {stream} of `{shlex.join(argv)[:120]}` on {self.where} passed SSM's limit of {limit:,} "
                    "characters and was cut", "ask for less output (fewer lines), or run trainctl on the head node "
                    "with the local transport", stream)
            # Whatever follows the marker is the agent's own, e.g. "failed to run commands: exit status 1"
            # appended to stderr on a non-zero exit.
            streams[stream] = content[:end]
        return Completed(code, streams["stdout"], streams["stderr"])
