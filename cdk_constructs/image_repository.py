"""The ECR repository for trainer images."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import RemovalPolicy, aws_ecr as ecr
from constructs import Construct

# Trainer image tags are "<flavour>-<version>", e.g. gpu-0.3.1 and neuron-0.3.1.
IMAGE_FLAVOURS = ("gpu", "neuron")


@dataclass(frozen=True)
class ImageRepositoryProps:
    repository_name: str
    max_image_count: int = 30
    removal_policy: RemovalPolicy = RemovalPolicy.RETAIN


class TrainerImageRepository(Construct):
    """Scanned on push, KMS-encrypted, immutable tags, and the last N images of each flavour kept.

    One lifecycle rule per flavour, so a run of GPU pushes never expires the Neuron images;
    a last rule caps everything else (untagged layers, other tags) at the same count.
    """

    def __init__(self, scope: Construct, id: str, props: ImageRepositoryProps) -> None:
        super().__init__(scope, id)
        destroy = props.removal_policy == RemovalPolicy.DESTROY
        self.repository = ecr.Repository(
            self,
            "Repository",
            repository_name=props.repository_name,
            image_scan_on_push=True,
            encryption=ecr.RepositoryEncryption.KMS,
            # A job spec names an exact image; a tag must never move under a running job.
            image_tag_mutability=ecr.TagMutability.IMMUTABLE,
            removal_policy=props.removal_policy,
            # Images can be rebuilt, so opting out of retention may delete them with the stack.
            empty_on_delete=True if destroy else None,
        )
        for priority, flavour in enumerate(IMAGE_FLAVOURS, start=1):
            self.repository.add_lifecycle_rule(
                rule_priority=priority,
                description=f"keep the last {props.max_image_count} {flavour} images",
                tag_prefix_list=[f"{flavour}-"],
                max_image_count=props.max_image_count,
            )
        self.repository.add_lifecycle_rule(
            description=f"keep the last {props.max_image_count} other images",
            tag_status=ecr.TagStatus.ANY,
            max_image_count=props.max_image_count,
        )
