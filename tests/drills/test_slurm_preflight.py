"""Preflight for the Slurm backend: the ParallelCluster stack and cluster, the head node in SSM, the queues' quotas.

EC2 is moto's and SSM is the loopback stand-in (tests/local_ssm.py: moto's SSM has no
DescribeInstanceInformation). CloudFormation answers are stubbed on a real client: moto creates no
nested stack and runs a custom resource's Lambda only in Docker, so it cannot hold a
Custom::PclusterCluster, and it cannot put a stack in a failed state.
"""

from __future__ import annotations

import datetime

import boto3
import pytest
from botocore.stub import Stubber

from config import parse_config
from tests.drills import test_slurm_transport
from tests.conftest import example_data
from tests.drills.test_slurm_transport import REGION, launch
from trainctl.preflight import (
    cluster_stack_check, head_node_ssm_check, quota_checks, slurm_checks, slurm_quota_groups, slurm_stack_checks,
)

# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = pytest.mark.untimed

aws = test_slurm_transport.aws
head = test_slurm_transport.head
NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
STACK, CLUSTER = "mltrain-slurm", "mltrain-slurm"


def stack(name: str, status: str, tags: dict | None = None) -> dict:
    return {"Stacks": [{"StackName": name, "CreationTime": NOW, "StackStatus": status,
                        "Tags": [{"Key": k, "Value": v} for k, v in (tags or {}).items()]}]}


def resource(logical: str, kind: str, physical: str, status: str = "CREATE_COMPLETE") -> dict:
    return {"LogicalResourceId": logical, "PhysicalResourceId": physical, "ResourceType": kind,
            "LastUpdatedTimestamp": NOW, "ResourceStatus": status}


PROVIDER = resource("PclusterClusterProvider", "AWS::CloudFormation::Stack",
                    f"arn:aws:cloudformation:{REGION}:123456789012:stack/x-PclusterClusterProvider/1")


def stubbed(answers: list[tuple[str, dict | str, dict]]):
    """A real CloudFormation client answering ``answers`` in order; a str answer is a missing stack."""
    client = boto3.client("cloudformation", region_name=REGION, aws_access_key_id="t", aws_secret_access_key="t")
    stub = Stubber(client)
    for operation, answer, params in answers:
        if isinstance(answer, str):
            stub.add_client_error(operation, "ValidationError", f"Stack with id {answer} does not exist",
                                  expected_params=params)
        else:
            stub.add_response(operation, answer, params)
    stub.activate()
    return client


def deployed(stack_status="CREATE_COMPLETE", provider=PROVIDER, cluster=CLUSTER, cluster_answer=None):
    answers = [("describe_stacks", stack(STACK, stack_status), {"StackName": STACK}),
               ("list_stack_resources", {"StackResourceSummaries": [
                   provider, resource("PclusterCluster", "Custom::PclusterCluster", cluster)]}, {"StackName": STACK})]
    if cluster_answer is not None:
        answers.append(("describe_stacks", cluster_answer, {"StackName": CLUSTER}))
    return stubbed(answers)


def by_name(checks):
    return {c.name: c for c in checks}


def test_a_deployed_healthy_cluster_passes():
    client = deployed(cluster_answer=stack(CLUSTER, "UPDATE_COMPLETE", {"parallelcluster:version": "3.16.1"}))
    checks = slurm_stack_checks(client, stack_name=STACK, cluster_name=CLUSTER, pcluster_version="3.16.1")
    assert [(c.name, c.passed, c.detail) for c in checks] == [
        ("Slurm stack mltrain-slurm", True, "CREATE_COMPLETE"),
        ("ParallelCluster provider PclusterClusterProvider", True, "CREATE_COMPLETE"),
        ("ParallelCluster cluster mltrain-slurm", True, "UPDATE_COMPLETE, ParallelCluster 3.16.1")]


def test_before_the_first_deploy_a_missing_slurm_stack_passes_with_the_deploy_command(aws):
    # moto's CloudFormation, through the session: no such stack.
    checks = slurm_checks(aws, region=REGION, stack_name=STACK, cluster_name=CLUSTER)
    assert [(c.passed, c.detail, c.fix) for c in checks] == [
        (True, "not deployed yet: `npx cdk deploy mltrain-slurm` creates it; run preflight again afterwards to check "
               "the cluster and its head node", "")]


def test_a_failed_creation_says_to_delete_and_redeploy():
    client = deployed("ROLLBACK_COMPLETE", cluster_answer="mltrain-slurm")
    checks = by_name(slurm_stack_checks(client, stack_name=STACK, cluster_name=CLUSTER))
    first = checks["Slurm stack mltrain-slurm"]
    assert not first.passed and first.fix.startswith("its creation failed: delete it and deploy again")
    cluster = checks["ParallelCluster cluster mltrain-slurm"]
    assert not cluster.passed and cluster.detail.startswith("no stack mltrain-slurm")


def test_a_provider_still_updating_and_a_cluster_whose_update_rolled_back_fail():
    provider = {**PROVIDER, "ResourceStatus": "UPDATE_IN_PROGRESS"}
    client = deployed("UPDATE_IN_PROGRESS", provider=provider, cluster_answer=stack(
        CLUSTER, "UPDATE_ROLLBACK_COMPLETE", {"parallelcluster:version": "3.16.1"}))
    checks = by_name(slurm_stack_checks(client, stack_name=STACK, cluster_name=CLUSTER))
    assert checks["Slurm stack mltrain-slurm"].fix == "wait for it to finish, then run preflight again"
    assert checks["ParallelCluster provider PclusterClusterProvider"].passed is False
    cluster = checks["ParallelCluster cluster mltrain-slurm"]
    # pcluster's own name for it (api/converters.py): an update that rolled back failed.
    assert not cluster.passed and cluster.detail == ("UPDATE_FAILED (stack UPDATE_ROLLBACK_COMPLETE), "
                                                     "ParallelCluster 3.16.1")
    assert cluster.fix == "see why: aws cloudformation describe-stack-events --stack-name mltrain-slurm"


def test_a_cluster_name_other_than_the_stacks_is_named():
    client = deployed(cluster="mltrain-hpc")
    check = by_name(slurm_stack_checks(client, stack_name=STACK, cluster_name=CLUSTER))[
        "ParallelCluster cluster mltrain-slurm"]
    assert not check.passed and check.detail == "mltrain-slurm holds cluster 'mltrain-hpc'"


def test_a_stack_of_that_name_that_is_not_parallelclusters_fails():
    client = stubbed([("describe_stacks", stack(CLUSTER, "CREATE_COMPLETE"), {"StackName": CLUSTER})])
    check = cluster_stack_check(client, CLUSTER)
    assert not check.passed and "no parallelcluster:version tag" in check.detail


def test_the_head_node_must_be_online_in_ssm(head):
    session, instance, ssm, _ = head
    ec2, client = session.client("ec2"), session.client("ssm")
    online = head_node_ssm_check(ec2, client, cluster_name=CLUSTER, region=REGION)
    assert online.passed and online.detail == f"{instance} is Online"
    ssm.instances[instance] = "ConnectionLost"
    lost = head_node_ssm_check(ec2, client, cluster_name=CLUSTER, region=REGION)
    assert not lost.passed and lost.detail.endswith("has SSM status ConnectionLost")
    del ssm.instances[instance]
    unknown = head_node_ssm_check(ec2, client, cluster_name=CLUSTER, region=REGION)
    assert not unknown.passed and unknown.detail.endswith("is not registered with SSM")
    assert "AmazonSSMManagedInstanceCore" in unknown.fix
    missing = head_node_ssm_check(ec2, client, cluster_name="other", region=REGION)
    assert not missing.passed and missing.detail == "no running head node of ParallelCluster cluster 'other' in us-west-2"
    launch(session, "other", "Compute")  # a compute node is not a head node
    assert not head_node_ssm_check(ec2, client, cluster_name="other", region=REGION).passed


def test_slurm_queues_add_to_the_on_demand_quotas_of_their_families():
    config = parse_config(example_data())
    client = boto3.client("service-quotas", region_name=REGION, aws_access_key_id="t", aws_secret_access_key="t")
    values = {"L-417A185B": 576, "L-2C3B7624": 256, "L-1216C47A": 1000, "L-DB2E81BA": 100}
    queues = [("gpu", "p4d.24xlarge", 2), ("small", "g5.12xlarge", 3)]
    assert slurm_quota_groups(queues) == [("p4d.24xlarge", 2, "ON_DEMAND"), ("g5.12xlarge", 3, "ON_DEMAND")]
    with Stubber(client) as stub:
        for code in sorted(values):
            stub.add_response("get_service_quota", {"Quota": {"Value": values[code]}},
                              {"ServiceCode": "ec2", "QuotaCode": code})
        checks = by_name(quota_checks(config, client, extra_groups=slurm_quota_groups(queues)))
    p = checks["quota Running On-Demand P instances"]
    assert p.passed and p.detail == "576 vCPUs, need 576 (max nodes x vCPUs)"  # 4 x p4d in EKS + 2 in Slurm
    g = checks["quota Running On-Demand G and VT instances"]
    assert not g.passed and g.detail == "100 vCPUs, need 144 (max nodes x vCPUs)"  # 3 x g5.12xlarge (48)


@pytest.mark.parametrize("status", ["CREATE_COMPLETE", "UPDATE_COMPLETE"])
def test_both_complete_states_of_the_cluster_stack_are_healthy(status):
    client = stubbed([("describe_stacks", stack(CLUSTER, status, {"parallelcluster:version": "3.16.1"}),
                       {"StackName": CLUSTER})])
    assert cluster_stack_check(client, CLUSTER).passed


def test_the_versioned_provider_template_must_be_published_in_the_region(aws):
    from trainctl.preflight import provider_template_check

    s3 = aws.client("s3", region_name=REGION)
    missing = provider_template_check(s3, REGION, "3.16.1")
    assert not missing.passed and missing.fix.startswith("pick a region ParallelCluster supports")
    bucket = f"{REGION}-aws-parallelcluster"
    s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": REGION})
    s3.put_object(Bucket=bucket, Key="parallelcluster/3.16.1/templates/custom_resource/cluster.yaml", Body=b"x")
    found = provider_template_check(s3, REGION, "3.16.1")
    assert found.passed and found.detail.endswith("/parallelcluster/3.16.1/templates/custom_resource/cluster.yaml")


def test_the_slurm_queues_and_head_node_count_into_the_quotas():
    from tests.conftest import REPO
    from config import load_config
    from trainctl.preflight import slurm_groups

    config = load_config(REPO / "config" / "slurm-example.yaml")
    p4d = next(g for g in config.accelerated_node_groups if g.name == "p4d")
    assert slurm_groups(config) == [("p4d.24xlarge", p4d.max_size, "ON_DEMAND"), ("m5.2xlarge", 1, "ON_DEMAND")]
    assert slurm_groups(parse_config(example_data())) == []
