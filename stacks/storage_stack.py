"""Storage stack: FSx for Lustre in the compute subnet, linked to the data bucket."""

from __future__ import annotations

from aws_cdk import CfnOutput, Stack
from constructs import Construct

from cdk_constructs.data_bucket import DataBucket, DataBucketProps
from cdk_constructs.lustre import LinkedLustreFileSystem, LinkedLustreProps, S3Link
from cdk_constructs.nag import acknowledge
from cdk_constructs.network import RETENTION_BY_DAYS
from cdk_constructs.pod_identity import pod_identity_role
from config import PlatformConfig
from stacks.network_stack import NetworkStack
from stacks.removal import removal


class StorageStack(Stack):
    """Datasets and checkpoints: FSx for Lustre in the network's compute subnet, nowhere else,
    mirrored both ways to prefixes of one S3 bucket.

    Typed attributes for later stacks and charts: ``file_system.volume`` (id, DNS name,
    mount name), ``file_system.connections``, ``data_bucket``.
    """

    def __init__(self, scope: Construct, id: str, *, config: PlatformConfig, network: NetworkStack, **kwargs) -> None:
        super().__init__(scope, id, **kwargs)
        fsx_cfg, bucket_cfg = config.fsx, config.bucket

        self.data_bucket = DataBucket(
            self,
            "Data",
            DataBucketProps(
                noncurrent_version_retention_days=bucket_cfg.noncurrent_version_retention_days,
                access_log_retention_days=bucket_cfg.access_log_retention_days,
                removal_policy=removal(bucket_cfg.retain_on_delete),
            ),
        ).bucket

        # Training pods' identity (associated by the cluster stack): the two linked prefixes, nothing else.
        self.trainer_role = pod_identity_role(self, "TrainerRole", "Training pods: the data bucket's dataset "
                                              "and checkpoint prefixes")
        for prefix in (fsx_cfg.data_prefix, fsx_cfg.checkpoint_prefix):
            self.data_bucket.grant_read_write(self.trainer_role, f"{prefix}*")
            acknowledge(self.trainer_role, "IAM5", "Objects under one of the two prefixes the file system links "
                        "(datasets, checkpoints), nothing else of the bucket",
                        finding=f"Resource::<{self.get_logical_id(self.data_bucket.node.default_child)}.Arn>/{prefix}*")
        for action in ("s3:GetObject*", "s3:GetBucket*", "s3:List*", "s3:DeleteObject*", "s3:Abort*"):
            acknowledge(self.trainer_role, "IAM5", "CDK's read/write grant, limited to the two prefixes above",
                        finding=f"Action::{action}")

        vpc = network.network
        self.file_system = LinkedLustreFileSystem(
            self,
            "Lustre",
            LinkedLustreProps(
                vpc=vpc.vpc,
                subnet=vpc.compute_subnet,
                clients=[vpc.node_security_group],
                bucket=self.data_bucket,
                links=[
                    S3Link(fsx_cfg.data_path, fsx_cfg.data_prefix),
                    S3Link(fsx_cfg.checkpoint_path, fsx_cfg.checkpoint_prefix),
                ],
                deployment_type=fsx_cfg.deployment_type.value,
                storage_capacity_gib=fsx_cfg.storage_capacity_gib,
                throughput_per_tib=fsx_cfg.throughput_per_tib,
                compression=fsx_cfg.compression.value,
                automatic_backup_retention_days=fsx_cfg.automatic_backup_retention_days,
                log_retention=RETENTION_BY_DAYS[fsx_cfg.log_retention_days],
                removal_policy=removal(fsx_cfg.retain_on_delete),
            ),
        )

        volume = self.file_system.volume
        outputs = {
            "FileSystemId": (volume.file_system_id, "FSx for Lustre file system id (PersistentVolume volumeHandle)"),
            "FileSystemDnsName": (volume.dns_name, "FSx for Lustre DNS name (PersistentVolume dnsname)"),
            "FileSystemMountName": (volume.mount_name, "FSx for Lustre mount name (PersistentVolume mountname)"),
            "FileSystemSecurityGroupId": (self.file_system.security_group.security_group_id, "FSx security group"),
            "FileSystemSubnetId": (vpc.compute_subnet.subnet_id, f"The compute subnet ({config.compute_az})"),
            "DataBucketName": (self.data_bucket.bucket_name, "S3 bucket linked to the file system"),
            "DataPrefix": (fsx_cfg.data_prefix, f"Datasets: s3://<bucket>/{fsx_cfg.data_prefix} <-> {fsx_cfg.data_path}"),
            "CheckpointPrefix": (
                fsx_cfg.checkpoint_prefix,
                f"Checkpoints: s3://<bucket>/{fsx_cfg.checkpoint_prefix} <-> {fsx_cfg.checkpoint_path}",
            ),
        }
        for key, (value, description) in outputs.items():
            CfnOutput(self, key, value=value, description=description)
