"""checkov findings accepted in place, each with the reason a reviewer reads (tests/drills/test_checkov.py).

checkov reads a ``checkov`` entry of a resource's CloudFormation Metadata: ``{"skip": [{"id": ...,
"comment": ...}]}``. Like cdk-nag's acknowledgements (cdk_constructs/nag.py), a skip names one
check on one resource; the aspect below covers what aws-cdk-lib itself adds (its custom-resource
Lambdas and their log groups) and the platform's own deploy-time Lambdas, which share one nature.
"""

from __future__ import annotations

import jsii
from aws_cdk import CfnResource, IAspect, aws_lambda as lambda_, aws_logs as logs
from constructs import IConstruct


def skip_check(resource: CfnResource, check: str, reason: str) -> None:
    """Accept checkov's ``check`` (e.g. ``"CKV_AWS_18"``) on ``resource`` for ``reason``."""
    entry = resource.get_metadata("checkov") or {"skip": []}
    if not any(s["id"] == check for s in entry["skip"]):
        entry["skip"].append({"id": check, "comment": reason})
    resource.add_metadata("checkov", entry)


DEPLOY_TIME_FUNCTION = {
    "CKV_AWS_115": "a deploy-time handler (custom resource or provider): CloudFormation calls it a few times a "
                   "deploy; a concurrency limit could only fail a deploy",
    "CKV_AWS_116": "CloudFormation calls it synchronously and shows its failure in the stack events; a dead-letter "
                   "queue would never be read",
    "CKV_AWS_173": "its environment holds names and ARNs, no secret; the default AWS-owned key encrypts it",
}
OUTSIDE_VPC = "it calls AWS APIs only and reaches nothing in the VPC"
LOG_GROUP_KEY = ("encrypted at rest by CloudWatch Logs' own key; a customer key per log group adds a key "
                 "policy to maintain and cost, and these hold operational logs, no training data")


@jsii.implements(IAspect)
class CheckovAcknowledgements:
    """Every Lambda function of the platform runs at deploy time only; every log group keeps the service key."""

    def visit(self, node: IConstruct) -> None:
        if isinstance(node, lambda_.CfnFunction) or (
                isinstance(node, CfnResource) and node.cfn_resource_type == "AWS::Lambda::Function"):
            for check, reason in DEPLOY_TIME_FUNCTION.items():
                skip_check(node, check, reason)
            if not _in_vpc(node):
                skip_check(node, "CKV_AWS_117", OUTSIDE_VPC)
        elif isinstance(node, logs.CfnLogGroup):
            skip_check(node, "CKV_AWS_158", LOG_GROUP_KEY)


def _in_vpc(function: CfnResource) -> bool:
    if isinstance(function, lambda_.CfnFunction):
        return function.vpc_config is not None
    return False  # aws-cdk-lib's CustomResourceProvider functions never run in a VPC
