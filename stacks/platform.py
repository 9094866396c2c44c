"""Compose the platform's stacks from a validated config."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import App, Environment, Tags, Validations
from cdk_nag import AwsSolutionsChecks

from config import PlatformConfig
from stacks.network_stack import NetworkStack
from stacks.registry_stack import RegistryStack
from stacks.storage_stack import StorageStack


@dataclass(frozen=True)
class Platform:
    network: NetworkStack
    registry: RegistryStack
    storage: StorageStack

    @property
    def stacks(self) -> list:
        """In deploy order. Teardown (README): storage, then the cluster, then registry, then network."""
        return [self.network, self.registry, self.storage]


def build_platform(app: App, config: PlatformConfig) -> Platform:
    """Add every platform stack to ``app``, tagged, with cdk-nag AwsSolutions as a validation."""
    # No account in the config: the stacks stay account-agnostic, so synth never needs
    # credentials or a context lookup; deploy then targets the caller's account.
    env = Environment(account=config.account, region=config.region)
    prefix = config.name_prefix
    network = NetworkStack(
        app, f"{prefix}-network", config=config, env=env, description=f"{prefix}: training VPC and compute subnet"
    )
    registry = RegistryStack(
        app,
        f"{prefix}-registry",
        config=config,
        env=env,
        description=f"{prefix}: trainer image repository and the worker node role that pulls from it",
    )
    storage = StorageStack(
        app,
        f"{prefix}-storage",
        config=config,
        network=network,
        env=env,
        description=f"{prefix}: FSx for Lustre in the compute subnet, linked to the S3 data bucket",
    )
    Tags.of(app).add("platform", prefix)
    for key, value in sorted(config.tags.items()):
        Tags.of(app).add(key, value)
    add_policy_checks(app)
    return Platform(network=network, registry=registry, storage=storage)


def add_policy_checks(app: App) -> None:
    """cdk-nag AwsSolutions as a validation plugin: any unacknowledged finding fails synth."""
    Validations.of(app).add_plugins(AwsSolutionsChecks(app))
