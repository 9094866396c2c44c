"""Load a ParallelCluster cluster configuration with ParallelCluster's own schema, offline.

Run by .venv-pcluster's interpreter (requirements-pcluster.txt), never imported by the CDK app:
it needs only the standard library and the ``pcluster`` package. Reads the configuration as JSON
on stdin, the cluster name as its argument; prints a JSON report on stdout and exits 0, or prints
the schema's errors on stderr and exits 1.

No AWS call can leave this process: every botocore API call is refused here before it is signed,
and recorded in the report (``aws_calls``), so the caller can tell a schema check from one that
reached AWS. ``ClusterSchema.load`` makes one such call on purpose: SlurmClusterConfig.__init__
caches DescribeCapacityReservations for its validators and swallows the failure
(aws-parallelcluster 3.16.1, pcluster/config/cluster_config.py, "Cache capacity reservations").
``--probe-aws`` makes a plain EC2 call and so must fail loudly: a test runs it.

The configuration is loaded twice: as written, and as ParallelCluster's Lambda receives it, for
CloudFormation hands a custom resource every number and boolean as a string
(aws-cloudformation/cloudformation-coverage-roadmap issue 1037).
"""

from __future__ import annotations

import json
import sys

import botocore.client
import botocore.exceptions

ATTEMPTED: list[str] = []


class RefusedOffline(botocore.exceptions.BotoCoreError):
    # A BotoCoreError, so ParallelCluster's own handler treats it as it treats missing credentials.
    fmt = "AWS call refused offline: {operation}"


def _refuse(client, operation_name, api_params):
    operation = f"{client.meta.service_model.service_name}.{operation_name}"
    ATTEMPTED.append(operation)
    raise RefusedOffline(operation=operation)


botocore.client.BaseClient._make_api_call = _refuse


def as_delivered(value):
    """``value`` with every scalar a string, as CloudFormation passes custom-resource properties."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, dict):
        return {k: as_delivered(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_delivered(v) for v in value]
    return value


def main() -> int:
    if sys.argv[1:] == ["--probe-aws"]:
        import boto3

        try:
            boto3.client("ec2").describe_instance_types(InstanceTypes=["p4d.24xlarge"])
        except RefusedOffline as error:
            print(error, file=sys.stderr)
            return 3
        return 0
    from marshmallow import ValidationError
    from pcluster.schemas.cluster_schema import ClusterSchema
    from pcluster.utils import get_installed_version

    (cluster_name,) = sys.argv[1:]
    configuration = json.load(sys.stdin)
    for form, data in (("as written", configuration), ("as CloudFormation delivers it", as_delivered(configuration))):
        try:
            ClusterSchema(cluster_name=cluster_name).load(data)
        except ValidationError as error:
            print(f"{form}: {json.dumps(error.messages, sort_keys=True)}", file=sys.stderr)
            return 1
    print(json.dumps({"version": get_installed_version(), "aws_calls": ATTEMPTED}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
