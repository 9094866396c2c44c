"""Compose the platform's stacks from a validated config."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import App, Aspects, Environment, Tags, Validations
from cdk_nag import AwsSolutionsChecks
from constructs import Construct

from cdk_constructs.checkov import CheckovAcknowledgements
from config import PlatformConfig
from stacks.batch_stack import BatchStack
from stacks.cluster_stack import ClusterStack
from stacks.network_stack import NetworkStack
from stacks.registry_stack import RegistryStack
from stacks.slurm_stack import SlurmStack
from stacks.storage_stack import StorageStack


@dataclass(frozen=True)
class Platform:
    network: NetworkStack
    registry: RegistryStack
    storage: StorageStack
    cluster: ClusterStack
    batch: BatchStack | None = None
    slurm: SlurmStack | None = None

    @property
    def stacks(self) -> list:
        """In deploy order: a stack comes after every stack it reads from."""
        optional = [stack for stack in (self.batch, self.slurm) if stack is not None]
        return [self.network, self.registry, self.storage, self.cluster] + optional

    @property
    def teardown(self) -> list:
        """In the order the README's Teardown destroys them: a stack goes before every stack it reads from.

        ``cdk destroy`` of a stack also destroys the stacks that depend on it, so any other order
        would take the cluster down with the storage stack, unannounced.
        """
        return list(reversed(self.stacks))


def build_platform(app: App, config: PlatformConfig) -> Platform:
    """Add every platform stack to ``app``, tagged, with cdk-nag AwsSolutions as a validation."""
    # No account in the config: the stacks stay account-agnostic, so synth never needs
    # credentials or a context lookup; deploy then targets the caller's account.
    platform = add_platform_stacks(app, config, Environment(account=config.account, region=config.region))
    add_policy_checks(app)
    return platform


def add_platform_stacks(scope: Construct, config: PlatformConfig, env: Environment | None) -> Platform:
    """The platform's stacks under ``scope``: the App, or one pipeline stage (which sets ``env`` itself)."""
    prefix = config.name_prefix
    # Explicit names: in a pipeline stage the stacks keep the names the README and the CLI use.
    network = NetworkStack(
        scope,
        config.stack_name("network"),
        stack_name=config.stack_name("network"),
        config=config,
        env=env,
        description=f"{prefix}: training VPC and compute subnet",
    )
    registry = RegistryStack(
        scope,
        config.stack_name("registry"),
        stack_name=config.stack_name("registry"),
        config=config,
        env=env,
        description=f"{prefix}: trainer image repository and the worker node role that pulls from it",
    )
    storage = StorageStack(
        scope,
        config.stack_name("storage"),
        stack_name=config.stack_name("storage"),
        config=config,
        network=network,
        env=env,
        description=f"{prefix}: FSx for Lustre in the compute subnet, linked to the S3 data bucket",
    )
    cluster = ClusterStack(
        scope,
        config.stack_name("cluster"),
        stack_name=config.stack_name("cluster"),
        config=config,
        network=network,
        registry=registry,
        storage=storage,
        env=env,
        description=f"{prefix}: EKS with system and EFA-ready accelerated node groups, add-ons and charts",
    )
    batch = None
    if config.batch is not None:
        batch = BatchStack(
            scope, config.stack_name("batch"), stack_name=config.stack_name("batch"), config=config, network=network,
            registry=registry, storage=storage, env=env,
            description=f"{prefix}: AWS Batch multi-node parallel training on the same network, storage and image",
        )
    slurm = None
    if config.slurm is not None:
        slurm = SlurmStack(
            scope, config.stack_name("slurm"), stack_name=config.stack_name("slurm"), config=config, network=network,
            storage=storage, env=env,
            description=f"{prefix}: AWS ParallelCluster (Slurm) on the same network, storage and image",
        )
        # Its compute nodes pull from the registry's repository, named rather than referenced.
        slurm.add_stack_dependency(registry)
    Aspects.of(scope).add(CheckovAcknowledgements())
    Tags.of(scope).add("platform", prefix)
    for key, value in sorted(config.tags.items()):
        Tags.of(scope).add(key, value)
    return Platform(network=network, registry=registry, storage=storage, cluster=cluster, batch=batch, slurm=slurm)


def add_policy_checks(app: App) -> None:
    """cdk-nag AwsSolutions as a validation plugin: any unacknowledged finding fails synth."""
    Validations.of(app).add_plugins(AwsSolutionsChecks(app))
