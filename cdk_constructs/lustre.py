"""FSx for Lustre in one subnet, encrypted, linked to S3 in both directions."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from aws_cdk import (
    ArnFormat, RemovalPolicy, Stack, aws_ec2 as ec2, aws_fsx as fsx, aws_kms as kms, aws_logs as logs, aws_s3 as s3,
)
from constructs import Construct

# Lustre's LNet port and the range its servers and clients also use (FSx for Lustre guide,
# "File system access control with Amazon VPC"). The L2 LustreFileSystem opens 988-1023 to
# itself; nothing listens on 989-1017, so this construct opens exactly these two.
LUSTRE_PORTS = (ec2.Port.tcp(988), ec2.Port.tcp_range(1018, 1023))
# Every kind of S3 change flows both ways: new, changed and deleted objects and files.
SYNC_EVENTS = ["NEW", "CHANGED", "DELETED"]
PERSISTENT_TYPES = ("PERSISTENT_1", "PERSISTENT_2")


@dataclass(frozen=True)
class S3Link:
    """One data repository association: a file-system directory <-> an S3 prefix of the bucket."""

    file_system_path: str  # e.g. "/datasets"
    s3_prefix: str  # e.g. "datasets/"


@dataclass(frozen=True)
class LustreVolume:
    """What a Kubernetes PersistentVolume needs to bind this file system (fsx.csi.aws.com)."""

    file_system_id: str
    dns_name: str
    mount_name: str


@dataclass(frozen=True)
class LinkedLustreProps:
    vpc: ec2.IVpc
    subnet: ec2.ISubnet
    clients: Sequence[ec2.ISecurityGroup]
    bucket: s3.IBucket
    links: Sequence[S3Link]
    deployment_type: str = "PERSISTENT_2"
    storage_capacity_gib: int = 1200
    throughput_per_tib: int | None = 250
    compression: str = "LZ4"
    automatic_backup_retention_days: int = 7
    log_retention: logs.RetentionDays = logs.RetentionDays.THREE_MONTHS
    removal_policy: RemovalPolicy = RemovalPolicy.RETAIN


class LinkedLustreFileSystem(Construct):
    """An FSx for Lustre file system whose directories mirror S3 prefixes automatically.

    Each :class:`S3Link` becomes a data repository association with automatic import and
    export of new, changed and deleted objects, so data staged in S3 appears on the file
    system and checkpoints written to the file system reach S3 with nobody copying them.
    Associations work on PERSISTENT_2 and on SCRATCH_2 (Lustre 2.15), so both types get
    the same layout. The security group admits Lustre traffic only from ``clients`` and
    from the file servers themselves.
    """

    def __init__(self, scope: Construct, id: str, props: LinkedLustreProps) -> None:
        super().__init__(scope, id)
        persistent = props.deployment_type in PERSISTENT_TYPES
        policy = props.removal_policy

        self.security_group = ec2.SecurityGroup(
            self,
            "SecurityGroup",
            vpc=props.vpc,
            description="FSx for Lustre: TCP 988 and 1018-1023 with its clients and itself only",
            allow_all_outbound=False,
        )
        self.connections = ec2.Connections(security_groups=[self.security_group], default_port=LUSTRE_PORTS[0])
        for port in LUSTRE_PORTS:
            self.connections.allow_internally(port, "Lustre between file servers")
            for client in props.clients:
                # LNet connects in both directions: clients reach the servers, servers call back.
                self.connections.allow_from(client, port, "Lustre from clients")
                self.connections.allow_to(client, port, "Lustre to clients")
        self._retain_own_rules(policy)

        # Scratch file systems are always encrypted with FSx-owned keys and reject a KmsKeyId.
        self.kms_key: kms.IKey | None = None
        if persistent:
            self.kms_key = kms.Key(
                self,
                "Key",
                description="FSx for Lustre encryption at rest (file system and its backups)",
                enable_key_rotation=True,
                removal_policy=policy,
            )

        # FSx only writes to log groups under /aws/fsx/, and takes the group's own ARN, the form
        # FSx documents, not the ":*" form the log group's Arn attribute returns.
        log_group_name = f"/aws/fsx/{Stack.of(self).stack_name}-lustre"
        log_group_arn = Stack.of(self).format_arn(
            service="logs", resource="log-group", resource_name=log_group_name, arn_format=ArnFormat.COLON_RESOURCE_NAME
        )
        self.log_group = logs.LogGroup(
            self,
            "Logs",
            log_group_name=log_group_name,
            retention=props.log_retention,
            # Named, so a retained copy would block the next deploy; the logs are operational.
            removal_policy=RemovalPolicy.DESTROY,
        )

        backups = props.automatic_backup_retention_days if persistent else None
        self.file_system = fsx.CfnFileSystem(
            self,
            "FileSystem",
            file_system_type="LUSTRE",
            file_system_type_version="2.15",
            storage_capacity=props.storage_capacity_gib,
            subnet_ids=[props.subnet.subnet_id],
            security_group_ids=[self.security_group.security_group_id],
            kms_key_id=self.kms_key.key_id if self.kms_key else None,
            lustre_configuration=fsx.CfnFileSystem.LustreConfigurationProperty(
                deployment_type=props.deployment_type,
                per_unit_storage_throughput=props.throughput_per_tib,
                data_compression_type=props.compression,
                automatic_backup_retention_days=backups,
                daily_automatic_backup_start_time="03:00" if backups else None,
                copy_tags_to_backups=True if persistent else None,
                log_configuration=fsx.CfnFileSystem.LogConfigurationProperty(
                    level="WARN_ERROR", destination=log_group_arn
                ),
            ),
        )
        self.file_system.node.add_dependency(self.log_group)
        self.file_system.apply_removal_policy(policy)

        self.associations: list[fsx.CfnDataRepositoryAssociation] = []
        for link in props.links:
            association = fsx.CfnDataRepositoryAssociation(
                self,
                "Link" + re.sub(r"[^A-Za-z0-9]", "", link.file_system_path.title()),
                file_system_id=self.file_system.ref,
                file_system_path=link.file_system_path,
                data_repository_path=props.bucket.s3_url_for_object(link.s3_prefix),
                batch_import_meta_data_on_create=True,
                s3=fsx.CfnDataRepositoryAssociation.S3Property(
                    auto_import_policy=fsx.CfnDataRepositoryAssociation.AutoImportPolicyProperty(events=SYNC_EVENTS),
                    auto_export_policy=fsx.CfnDataRepositoryAssociation.AutoExportPolicyProperty(events=SYNC_EVENTS),
                ),
            )
            # Removing the link with the stack would stop checkpoints reaching S3 from a kept file system.
            association.apply_removal_policy(policy)
            self.associations.append(association)

        self.volume = LustreVolume(
            file_system_id=self.file_system.ref,
            dns_name=self.file_system.attr_dns_name,
            mount_name=self.file_system.attr_lustre_mount_name,
        )

    def _retain_own_rules(self, policy: RemovalPolicy) -> None:
        """A kept file system must keep working, so its group and that group's own rules stay
        with it. The mirror rules on the clients' groups go with the stack, so deleting this
        group later is not blocked by rules that point at it."""
        own_id = self.security_group.security_group_id
        self.security_group.apply_removal_policy(policy)
        for child in self.security_group.node.find_all():
            if isinstance(child, (ec2.CfnSecurityGroupIngress, ec2.CfnSecurityGroupEgress)) and child.group_id == own_id:
                child.apply_removal_policy(policy)
