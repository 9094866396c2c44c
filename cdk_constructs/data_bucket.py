"""The S3 bucket for datasets and checkpoints, with its access-log bucket."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration, RemovalPolicy, aws_s3 as s3
from constructs import Construct

from cdk_constructs.checkov import skip_check
from cdk_constructs.nag import acknowledge


@dataclass(frozen=True)
class DataBucketProps:
    noncurrent_version_retention_days: int = 30
    access_log_retention_days: int = 365
    removal_policy: RemovalPolicy = RemovalPolicy.RETAIN


class DataBucket(Construct):
    """Versioned, private, TLS-only bucket; server access logs go to a second bucket.

    Encryption is SSE-S3 on purpose: FSx's data repository associations read and write
    SSE-S3 objects as they are, while an SSE-KMS key would need a key-policy statement
    for a service-linked role that only exists once the association does, so the first
    deploy would fail. Deleted and overwritten objects (old checkpoints) stay recoverable
    as noncurrent versions for ``noncurrent_version_retention_days``.
    """

    def __init__(self, scope: Construct, id: str, props: DataBucketProps) -> None:
        super().__init__(scope, id)
        private = dict(
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            enforce_ssl=True,
            minimum_tls_version=1.2,
            removal_policy=props.removal_policy,
        )
        self.access_logs = s3.Bucket(
            self,
            "AccessLogs",
            lifecycle_rules=[s3.LifecycleRule(expiration=Duration.days(props.access_log_retention_days))],
            **private,
        )
        acknowledge(
            self.access_logs,
            "S1",
            "This is the access-log bucket; logging its own access would log every log delivery.",
        )
        logs_resource = self.access_logs.node.default_child
        skip_check(logs_resource, "CKV_AWS_18", "the access-log bucket itself: logging its access would log every "
                   "log delivery")
        skip_check(logs_resource, "CKV_AWS_21", "access logs expire by a lifecycle rule; versions would keep "
                   "expired logs")
        self.bucket = s3.Bucket(
            self,
            "Bucket",
            versioned=True,
            server_access_logs_bucket=self.access_logs,
            server_access_logs_prefix="data-bucket/",
            lifecycle_rules=[
                s3.LifecycleRule(
                    noncurrent_version_expiration=Duration.days(props.noncurrent_version_retention_days),
                    abort_incomplete_multipart_upload_after=Duration.days(7),
                )
            ],
            **private,
        )
