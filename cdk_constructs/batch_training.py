"""AWS Batch multi-node parallel training for one accelerated node group: a managed EC2 compute
environment (0 vCPUs when idle) in the compute subnet, built from the same EFA launch template
and a cluster placement group, a job queue, and a multi-node job definition that runs the
trainer image with FSx for Lustre, the GPUs, the EFA devices, shared memory and memlock.

Sources: AWS Batch User Guide ("Multi-node parallel jobs", "Use EFA with multi-node parallel
jobs", "Launch template support"), the Batch API model in botocore (RegisterJobDefinition,
CreateComputeEnvironment; tests/unit/cdk/test_batch.py validates the job definition against it), FSx for
Lustre User Guide ("Installing the Lustre client": ``dnf install lustre-client`` on AL2023).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import Mapping, Sequence

from aws_cdk import Fn, RemovalPolicy, Stack, aws_batch as batch, aws_ec2 as ec2, aws_iam as iam, aws_logs as logs
from constructs import Construct

from cdk_constructs.efa_launch_template import EfaLaunchTemplate, EfaLaunchTemplateProps
from cdk_constructs.lustre import LustreVolume
from cdk_constructs.nag import acknowledge
from config.catalog import InstanceType
from training.contract import FSX_MOUNT, batch_launch_command

# Batch selects the AMI; ECS_AL2023_NVIDIA is its GPU AMI for ECS (NVIDIA driver, container toolkit).
IMAGE_TYPE = "ECS_AL2023_NVIDIA"
RESERVED_VCPUS = 4  # for the ECS agent, the OS and the Lustre client
RESERVED_MEMORY_FRACTION = 0.10
SHM_FRACTION = 0.25
# The base job definition's image: trainctl registers a revision with the job's own image.
UNSET_IMAGE_TAG = "set-by-trainctl-submit"
# Retry what a job cannot cause (its host went away, a Spot reclaim), never its own errors.
# Batch takes the first rule that matches; status reasons are glob patterns.
RETRY_ON = [
    {"OnExitCode": "78", "Action": "EXIT"},   # the trainer's config, data or checkpoint dir is wrong
    {"OnExitCode": "76", "Action": "EXIT"},   # the loss diverged
    {"OnStatusReason": "Host EC2*", "Action": "RETRY"},  # instance terminated: host failure, Spot reclaim
    {"OnExitCode": "79", "Action": "RETRY"},  # workers failed past --max-restarts (a lost peer): a new attempt
    {"OnReason": "*", "Action": "EXIT"},
]


@dataclass(frozen=True)
class BatchTrainingProps:
    name: str  # the queue, compute environment and job definition name
    instance: InstanceType  # the catalog's entry: instance type, vCPUs, memory, GPUs, EFA interfaces
    max_nodes: int  # the job definition's nodes, and the compute environment's vCPUs in instances
    efa: bool  # one EFA interface per network card, and their devices in the container
    subnet: ec2.ISubnet
    security_groups: Sequence[ec2.ISecurityGroup]  # the node group's (EFA, FSx clients) and one with egress
    file_system: LustreVolume
    repository_uri: str
    log_group: logs.ILogGroup
    attempts: int
    spot: bool = False  # a Spot compute environment instead of On-Demand
    instance_tags: Mapping[str, str] = field(default_factory=dict)  # on every instance the environment launches


class BatchTraining(Construct):
    def __init__(self, scope: Construct, id: str, props: BatchTrainingProps) -> None:
        super().__init__(scope, id)
        instance = props.instance
        self.placement_group = ec2.CfnPlacementGroup(self, "PlacementGroup", strategy="cluster")
        template = EfaLaunchTemplate(self, "LaunchTemplate", EfaLaunchTemplateProps(
            instance=instance, efa=props.efa,
            security_group_ids=[sg.security_group_id for sg in props.security_groups],
            placement_group_name=None,  # the compute environment places its instances
            efa_only_secondary=props.efa and instance.efa_only_secondary,
            user_data=lustre_user_data(props.file_system)))

        self.instance_role = instance_role = iam.Role(
            self, "InstanceRole", assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description=f"Batch {props.name} instances: the ECS agent, image pulls, awslogs")
        instance_role.add_managed_policy(iam.ManagedPolicy.from_aws_managed_policy_name(
            "service-role/AmazonEC2ContainerServiceforEC2Role"))
        acknowledge(instance_role, "IAM4", "AmazonEC2ContainerServiceforEC2Role is the policy Batch documents for "
                    "ECS container instances (agent registration, ECR pulls, awslogs)", finding=(
                        "Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AmazonEC2ContainerServiceforEC2Role"))
        profile = iam.CfnInstanceProfile(self, "InstanceProfile", roles=[instance_role.role_name])

        vcpus = instance.vcpus
        self.compute_environment = batch.CfnComputeEnvironment(
            self, "ComputeEnvironment", type="MANAGED", state="ENABLED",
            compute_resources=batch.CfnComputeEnvironment.ComputeResourcesProperty(
                type="SPOT" if props.spot else "EC2",
                allocation_strategy="SPOT_PRICE_CAPACITY_OPTIMIZED" if props.spot else "BEST_FIT_PROGRESSIVE",
                minv_cpus=0, desiredv_cpus=0, maxv_cpus=props.max_nodes * vcpus,
                instance_types=[instance.name], subnets=[props.subnet.subnet_id],
                instance_role=profile.attr_arn, placement_group=self.placement_group.ref,
                launch_template=batch.CfnComputeEnvironment.LaunchTemplateSpecificationProperty(
                    launch_template_id=template.launch_template_id, version=template.version),
                ec2_configuration=[batch.CfnComputeEnvironment.Ec2ConfigurationObjectProperty(image_type=IMAGE_TYPE)],
                tags=dict(props.instance_tags) or None,
            ),
            replace_compute_environment=False,
        )
        self.queue = batch.CfnJobQueue(
            self, "Queue", job_queue_name=props.name, priority=1, state="ENABLED",
            compute_environment_order=[batch.CfnJobQueue.ComputeEnvironmentOrderProperty(
                compute_environment=self.compute_environment.ref, order=1)])
        self.job_definition = batch.CfnJobDefinition(
            self, "JobDefinition", job_definition_name=props.name, type="multinode",
            platform_capabilities=["EC2"], propagate_tags=True,
            node_properties=batch.CfnJobDefinition.NodePropertiesProperty(
                main_node=0, num_nodes=props.max_nodes,
                node_range_properties=[batch.CfnJobDefinition.NodeRangePropertyProperty(
                    target_nodes="0:", container=container_properties(props))]),
            retry_strategy=batch.CfnJobDefinition.RetryStrategyProperty(
                attempts=props.attempts,
                evaluate_on_exit=[batch.CfnJobDefinition.EvaluateOnExitProperty(
                    action=rule["Action"], on_exit_code=rule.get("OnExitCode"),
                    on_status_reason=rule.get("OnStatusReason"), on_reason=rule.get("OnReason"))
                    for rule in RETRY_ON]))


def container_properties(props: BatchTrainingProps) -> batch.CfnJobDefinition.ContainerPropertiesProperty:
    """The trainer's container on every node: its command, devices, mounts and limits."""
    instance = props.instance
    P = batch.CfnJobDefinition
    memory_mib = int(instance.memory_gib * 1024 * (1 - RESERVED_MEMORY_FRACTION))
    efa = instance.efa_interfaces if props.efa else 0
    environment = {"NCCL_SOCKET_IFNAME": "^lo,docker", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                   "OMP_NUM_THREADS": "1"}
    if efa:
        environment.update(FI_PROVIDER="efa", FI_EFA_FORK_SAFE="1", FI_EFA_USE_HUGE_PAGE="0")
    return P.ContainerPropertiesProperty(
        image=f"{props.repository_uri}:{UNSET_IMAGE_TAG}",
        command=batch_launch_command(nproc_per_node=instance.nproc_per_node, max_restarts=3),
        resource_requirements=[
            P.ResourceRequirementProperty(type="GPU", value=str(instance.accelerator_count)),
            P.ResourceRequirementProperty(type="VCPU", value=str(instance.vcpus - RESERVED_VCPUS)),
            P.ResourceRequirementProperty(type="MEMORY", value=str(memory_mib)),
        ],
        linux_parameters=P.LinuxParametersProperty(
            shared_memory_size=int(memory_mib * SHM_FRACTION),
            devices=[P.DeviceProperty(host_path=f"/dev/infiniband/uverbs{i}",
                                      container_path=f"/dev/infiniband/uverbs{i}", permissions=["READ", "WRITE", "MKNOD"])
                     for i in range(efa)] or None),
        ulimits=[P.UlimitProperty(name="memlock", soft_limit=-1, hard_limit=-1),
                 P.UlimitProperty(name="nofile", soft_limit=65536, hard_limit=65536)],
        volumes=[P.VolumesProperty(name="fsx", host=P.VolumesHostProperty(source_path=FSX_MOUNT))],
        mount_points=[P.MountPointsProperty(source_volume="fsx", container_path=FSX_MOUNT, read_only=False)],
        environment=[P.EnvironmentProperty(name=k, value=v) for k, v in sorted(environment.items())],
        log_configuration=P.LogConfigurationProperty(log_driver="awslogs", options={
            "awslogs-group": props.log_group.log_group_name, "awslogs-region": Stack.of(props.log_group).region,
            "awslogs-stream-prefix": props.name}),
        privileged=False, readonly_root_filesystem=False,
    )


def lustre_user_data(volume: LustreVolume) -> str:
    """Cloud-init for the instances: the Lustre client, and the file system on /fsx before the ECS
    agent starts containers (runcmd runs in cloud-final, which ecs.service waits for)."""
    return Fn.join("", [
        'MIME-Version: 1.0\nContent-Type: multipart/mixed; boundary="==PLATFORM=="\n\n--==PLATFORM==\n'
        'Content-Type: text/cloud-config; charset="us-ascii"\n\nruncmd:\n'
        "- dnf install -y lustre-client\n"
        f"- mkdir -p {FSX_MOUNT}\n"
        "- mount -t lustre -o relatime,flock ", volume.dns_name, "@tcp:/", volume.mount_name, f" {FSX_MOUNT}\n"
        "\n--==PLATFORM==--\n"])


def batch_log_group(scope: Construct, name: str, retention: logs.RetentionDays) -> logs.LogGroup:
    return logs.LogGroup(scope, "JobLogs", log_group_name=name, retention=retention,
                         removal_policy=RemovalPolicy.RETAIN)
