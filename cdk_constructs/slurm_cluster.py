"""AWS ParallelCluster with Slurm, declared through ParallelCluster's CloudFormation custom resource.

A nested stack from ParallelCluster's versioned provider template (its ServiceToken output is the
custom-resource Lambda) and one ``Custom::PclusterCluster`` whose ClusterConfiguration this
construct builds from typed props, checked at synth with ParallelCluster's own schema
(cdk_constructs/pcluster_schema.py). Sources, aws-parallelcluster 3.16.1 unless said:
the User Guide's "Provider stack hosted by AWS ParallelCluster" and "Cluster resource" pages
(TemplateURL, ClusterName that is not the stack's name, DeletionPolicy, Fn::GetAtt of
``pcluster describe-cluster`` values with dotted keys); pcluster/schemas/cluster_schema.py (every
key below); pcluster/validators/cluster_validators.py (Capacity Blocks: MinCount == MaxCount > 0,
and no placement group needed); pcluster/templates/cdk_builder_utils.py (node roles get the
AdditionalIamPolicies and CloudWatchAgentServerPolicy, no SSM policy: the head node's is added here).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from aws_cdk import (
    Aws, CfnCustomResource, CfnResource, Fn, RemovalPolicy, Stack, Token, aws_ec2 as ec2, aws_iam as iam,
    aws_s3_assets as s3_assets,
)
from constructs import Construct

from cdk_constructs.nag import acknowledge
from cdk_constructs.pcluster_schema import check_cluster_configuration
from config.catalog import InstanceType

PYXIS_SCRIPT = Path(__file__).with_name("slurm_node") / "enable_pyxis.sh"
OS = "alinux2023"
# The User Guide's provider-stack page; the bucket is ParallelCluster's, one per region.
PROVIDER_TEMPLATE = ("https://${AWS::Region}-aws-parallelcluster.s3.${AWS::Region}.${AWS::URLSuffix}"
                     "/parallelcluster/${Version}/templates/custom_resource/cluster.yaml")
SSM_POLICY = "AmazonSSMManagedInstanceCore"
# CloudWatch logs of the cluster outlive it (ParallelCluster's own default, kept explicit); their
# retention bounds what they cost.
LOGS_DELETION_POLICY = "Retain"


@dataclass(frozen=True)
class SlurmQueueProps:
    name: str  # the queue and its one compute resource
    instance: InstanceType
    max_count: int
    efa: bool
    placement_group: bool
    spot: bool = False
    capacity_block_id: str | None = None  # an EC2 Capacity Block for ML
    capacity_reservation_id: str | None = None  # an On-Demand Capacity Reservation


@dataclass(frozen=True)
class ClusterReferences:
    """The values of the configuration that CloudFormation resolves at deploy time."""

    subnet_id: str
    security_group_id: str
    file_system_id: str
    ssm_policy_arn: str
    bootstrap_policy_arn: str
    image_pull_policy_arn: str
    pyxis_script_url: str


# Syntactically valid stand-ins for the tokens above: ParallelCluster's schema checks the form of ids
# and ARNs (subnet-, sg-, fs-, ^arn:.*:policy/), never that they exist.
PLACEHOLDERS = ClusterReferences(
    subnet_id="subnet-0123456789abcdef0",
    security_group_id="sg-0123456789abcdef0",
    file_system_id="fs-0123456789abcdef0",
    ssm_policy_arn=f"arn:aws:iam::aws:policy/{SSM_POLICY}",
    bootstrap_policy_arn="arn:aws:iam::123456789012:policy/placeholder-bootstrap",
    image_pull_policy_arn="arn:aws:iam::123456789012:policy/placeholder-image-pull",
    pyxis_script_url="s3://placeholder-bucket/enable_pyxis.sh",
)


@dataclass(frozen=True)
class SlurmClusterProps:
    cluster_name: str  # must differ from the stack's name: ParallelCluster names its own stack so
    parallelcluster_version: str
    region: str
    head_node_instance_type: str
    subnet: ec2.ISubnet  # the compute subnet: head node and every queue
    security_group: ec2.ISecurityGroup  # the worker nodes' group: node-to-node (EFA) and the Lustre clients FSx admits
    ssh_cidr: str  # the VPC's range: the head node is private
    file_system_id: str
    mount_dir: str  # training.contract.FSX_MOUNT, as on EKS and Batch
    queues: Sequence[SlurmQueueProps]
    repository_arn: str  # the trainer image repository compute nodes pull from
    scaledown_idle_minutes: int = 10
    kill_wait_s: int = 30  # Slurm's KillWait, SIGTERM to SIGKILL when a job ends (its stop budget); 30 is ParallelCluster's
    log_retention_days: int = 30
    retain_on_delete: bool = False
    # Folders on the shared file system in which every cluster user may make a job's folder (mode 1777).
    shared_folders: Sequence[str] = ()


class SlurmCluster(Construct):
    def __init__(self, scope: Construct, id: str, props: SlurmClusterProps) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)
        if props.cluster_name == stack.stack_name:
            raise ValueError(f"cluster_name {props.cluster_name!r}: ParallelCluster names its own stack so; "
                             "it must differ from this stack's name")

        self.provider = CfnResource(self, "PclusterClusterProvider", type="AWS::CloudFormation::Stack", properties={
            "TemplateURL": Fn.sub(PROVIDER_TEMPLATE, {"Version": props.parallelcluster_version}),
        })

        # Pyxis and Enroot are on ParallelCluster's AMIs but off: a custom action turns them on.
        script = s3_assets.Asset(self, "EnablePyxis", path=str(PYXIS_SCRIPT))
        self.bootstrap_policy = iam.ManagedPolicy(self, "BootstrapPolicy", description=(
            f"{props.cluster_name} nodes: read the custom action that enables Pyxis"), statements=[
                iam.PolicyStatement(actions=["s3:GetObject"],
                                    resources=[script.bucket.arn_for_objects(script.s3_object_key)])])
        self.image_pull_policy = iam.ManagedPolicy(self, "ImagePullPolicy", description=(
            f"{props.cluster_name} compute nodes: pull the trainer image"), statements=[
                iam.PolicyStatement(actions=["ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage",
                                             "ecr:GetDownloadUrlForLayer"], resources=[props.repository_arn]),
                # No resource-level permissions for the registry token (ECR API reference).
                iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"])])
        acknowledge(self.image_pull_policy, "IAM5", "ecr:GetAuthorizationToken has no resource-level permissions; "
                    "the pull actions are scoped to the trainer repository", finding="Resource::*")

        references = ClusterReferences(
            subnet_id=props.subnet.subnet_id,
            security_group_id=props.security_group.security_group_id,
            file_system_id=props.file_system_id,
            ssm_policy_arn=f"arn:{Aws.PARTITION}:iam::aws:policy/{SSM_POLICY}",
            bootstrap_policy_arn=self.bootstrap_policy.managed_policy_arn,
            image_pull_policy_arn=self.image_pull_policy.managed_policy_arn,
            pyxis_script_url=script.s3_object_url,
        )
        self.configuration = cluster_configuration(props, references)
        offline = cluster_configuration(props, PLACEHOLDERS)
        unresolved = [s for s in _strings(offline) if Token.is_unresolved(s)]
        if unresolved:
            raise ValueError(f"a CDK token left in the configuration checked offline: {unresolved[0]}")
        check_cluster_configuration(offline, props.cluster_name, props.region)

        self.cluster = CfnCustomResource(self, "Cluster", service_token=self.provider.get_att(
            "Outputs.ServiceToken").to_string())
        self.cluster.add_override("Type", "Custom::PclusterCluster")
        self.cluster.add_property_override("ClusterName", props.cluster_name)
        self.cluster.add_property_override("ClusterConfiguration", self.configuration)
        # ParallelCluster's own DeletionPolicy: its Lambda deletes the cluster, or leaves it running.
        # CloudFormation's stays Delete, so the Lambda is called either way and cleans its event store.
        self.cluster.add_property_override("DeletionPolicy", "Retain" if props.retain_on_delete else "Delete")
        self.cluster.apply_removal_policy(RemovalPolicy.DESTROY)
        self.head_node_instance_id = self.cluster.get_att("headNode.instanceId").to_string()


def cluster_configuration(props: SlurmClusterProps, refs: ClusterReferences) -> dict:
    """The ClusterConfiguration: ParallelCluster's cluster config file, as a mapping."""
    root_volume = {"RootVolume": {"Encrypted": True}}

    def custom_action(role: str) -> dict:
        args = [role, *props.shared_folders] if role == "head" else [role]
        return {"OnNodeConfigured": {"Sequence": [{"Script": refs.pyxis_script_url, "Args": args}]}}

    return {
        "Region": props.region,
        "Image": {"Os": OS},
        "Imds": {"ImdsSupport": "v2.0"},
        "HeadNode": {
            "InstanceType": props.head_node_instance_type,
            "Networking": {"SubnetId": refs.subnet_id, "AdditionalSecurityGroups": [refs.security_group_id]},
            "Ssh": {"AllowedIps": props.ssh_cidr},
            "LocalStorage": root_volume,
            "Iam": {"AdditionalIamPolicies": [{"Policy": refs.ssm_policy_arn}, {"Policy": refs.bootstrap_policy_arn}]},
            "Imds": {"Secured": True},
            "CustomActions": custom_action("head"),
        },
        "Scheduling": {
            "Scheduler": "slurm",
            # KillWait replaces ParallelCluster's 30 s (its slurm.conf.erb; CustomSlurmSettings are included
            # last and KillWait is not on its deny list, validators/slurm_settings_validator.py): the time a
            # cancelled or requeued job's workers get to checkpoint.
            "SlurmSettings": {"ScaledownIdletime": props.scaledown_idle_minutes,
                              "CustomSlurmSettings": [{"KillWait": props.kill_wait_s}]},
            "SlurmQueues": [queue_configuration(queue, refs, root_volume, custom_action("compute"))
                            for queue in props.queues],
        },
        "SharedStorage": [{
            "Name": "fsx", "StorageType": "FsxLustre", "MountDir": props.mount_dir,
            "FsxLustreSettings": {"FileSystemId": refs.file_system_id},
        }],
        "Monitoring": {
            "Logs": {"CloudWatch": {"Enabled": True, "RetentionInDays": props.log_retention_days,
                                    "DeletionPolicy": LOGS_DELETION_POLICY}},
            "Dashboards": {"CloudWatch": {"Enabled": True}},
        },
    }


def queue_configuration(queue: SlurmQueueProps, refs: ClusterReferences, root_volume: dict, custom_actions: dict) -> dict:
    block = queue.capacity_block_id is not None
    networking: dict = {"SubnetIds": [refs.subnet_id], "AdditionalSecurityGroups": [refs.security_group_id]}
    # A Capacity Block is placed by EC2 already; ParallelCluster asks for no placement group there.
    if not block:
        networking["PlacementGroup"] = {"Enabled": queue.placement_group}
    resource: dict = {
        "Name": queue.name,
        "Instances": [{"InstanceType": queue.instance.name}],
        # Idle nodes are terminated, except a Capacity Block's: ParallelCluster requires it static
        # (MinCount == MaxCount > 0); its nodes start when the block does.
        "MinCount": queue.max_count if block else 0,
        "MaxCount": queue.max_count,
        "Efa": {"Enabled": queue.efa},
    }
    reservation = queue.capacity_block_id or queue.capacity_reservation_id
    if reservation is not None:
        resource["CapacityReservationTarget"] = {"CapacityReservationId": reservation}
    return {
        "Name": queue.name,
        "CapacityType": "CAPACITY_BLOCK" if block else "SPOT" if queue.spot else "ONDEMAND",
        "Networking": networking,
        "ComputeSettings": {"LocalStorage": root_volume},
        "Iam": {"AdditionalIamPolicies": [{"Policy": refs.bootstrap_policy_arn}, {"Policy": refs.image_pull_policy_arn}]},
        "CustomActions": custom_actions,
        "ComputeResources": [resource],
    }


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []

