"""CDK stacks. Each stack composes constructs from ``cdk_constructs``."""

from stacks.app_factory import app_options, create_app
from stacks.pipeline_stack import build_app
from stacks.platform import Platform, build_platform

__all__ = ["Platform", "app_options", "build_app", "build_platform", "create_app"]
