"""The one mapping from a config's ``retain_on_delete`` to a CloudFormation removal policy."""

from aws_cdk import RemovalPolicy


def removal(retain: bool) -> RemovalPolicy:
    return RemovalPolicy.RETAIN if retain else RemovalPolicy.DESTROY
