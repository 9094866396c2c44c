"""trainctl's AWS paths against moto: preflight with moto's real offering data, stage-data, the EKS token."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import urllib.parse

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from config import parse_config
from config.catalog import CATALOG, InstanceType
from tests.trainctl_fixtures import one_error
from tests.conftest import REPO, config_variant, example_data
from trainctl import stage
from trainctl.kube import CLUSTER_HEADER, TOKEN_PREFIX, eks_token
from trainctl.preflight import (
    PLATFORM_ADDONS, access_check, addon_checks, az_check, bootstrap_check, efa_checks, format_table, offering_checks,
    quota_checks, role_arn,
)

REGION = "us-west-2"
CONFIG = parse_config(example_data())


@pytest.fixture
def aws(monkeypatch):
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        yield boto3.Session(region_name=REGION)


def test_an_az_without_trn1_fails_and_the_fix_names_azs_that_offer_every_type(aws):
    # moto's real us-west-2 data: trn1.32xlarge only in us-west-2b and us-west-2d.
    checks = {c.name: c for c in offering_checks(CONFIG, aws.client("ec2"))}
    assert checks["p4d.24xlarge offered in us-west-2a"].passed
    trn1 = checks["trn1.32xlarge offered in us-west-2a"]
    assert not trn1.passed and trn1.detail == "offered only in us-west-2b, us-west-2d"
    assert trn1.fix == "set compute_az to an AZ offering every type: us-west-2b, us-west-2d"


def test_the_same_config_in_an_az_that_offers_everything_passes(aws):
    config = parse_config(config_variant(compute_az="us-west-2d", control_plane_az="us-west-2a"))
    assert all(c.passed for c in offering_checks(config, aws.client("ec2")))


def test_efa_counts_agree_with_ec2_and_a_mismatch_is_reported_as_a_catalog_bug(aws, monkeypatch):
    assert all(c.passed for c in efa_checks(CONFIG, aws.client("ec2")))
    wrong = InstanceType(**{**CATALOG["p4d.24xlarge"].__dict__, "efa_interfaces": 2})
    monkeypatch.setitem(CATALOG, "p4d.24xlarge", wrong)
    check = next(c for c in efa_checks(CONFIG, aws.client("ec2")) if c.name.startswith("p4d"))
    assert not check.passed and check.detail == "EC2 says 4, catalog says 2" and check.fix.startswith("catalog bug")


def test_quotas_cover_max_nodes_times_vcpus(aws):
    # moto has no EC2 quotas in Service Quotas, so the answers are stubbed on a real client.
    client = boto3.client("service-quotas", region_name=REGION)
    values = {"L-417A185B": 384, "L-2C3B7624": 128, "L-1216C47A": 1000}
    with Stubber(client) as stub:
        for code in sorted(values):
            stub.add_response("get_service_quota", {"Quota": {"Value": values[code]}},
                              {"ServiceCode": "ec2", "QuotaCode": code})
        checks = {c.name: c for c in quota_checks(CONFIG, client)}
    p = checks["quota Running On-Demand P instances"]
    assert p.passed and p.detail == "384 vCPUs, need 384 (max nodes x vCPUs)"  # 4 x p4d (96)
    trn = checks["quota Running On-Demand Trn instances"]
    assert not trn.passed and trn.detail == "128 vCPUs, need 256 (max nodes x vCPUs)"  # 2 x trn1.32xlarge (128)
    assert "L-2C3B7624" in trn.fix


def test_bootstrap_stack_missing_then_present(aws):
    cloudformation = aws.client("cloudformation")
    missing = bootstrap_check(CONFIG, cloudformation)
    assert not missing.passed and missing.fix == "npx cdk bootstrap aws://<account>/us-west-2"
    cloudformation.create_stack(StackName="CDKToolkit", TemplateBody='{"Resources": {"T": {"Type": '
                                '"AWS::SNS::Topic"}}}')
    assert bootstrap_check(CONFIG, cloudformation).passed


def test_the_table_lists_passes_failures_and_fixes(aws):
    table = format_table(offering_checks(CONFIG, aws.client("ec2")))
    assert table.splitlines()[-1] == "2 passed, 1 failed"
    assert "FAIL  trn1.32xlarge offered in us-west-2a  offered only in us-west-2b, us-west-2d" in table
    assert "fix: set compute_az to an AZ offering every type: us-west-2b, us-west-2d" in table


def test_stage_data_uploads_multipart_and_resumes(aws, tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "CHUNK", 5 * 2**20)  # S3's smallest part, so a small file is multipart
    s3 = aws.client("s3")
    s3.create_bucket(Bucket="data", CreateBucketConfiguration={"LocationConstraint": REGION})
    source = tmp_path / "imagenet"
    (source / "train" / "n01").mkdir(parents=True)
    (source / "train" / "n01" / "a.JPEG").write_bytes(os.urandom(11 * 2**20))
    (source / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n")
    first = stage.stage_data(source, s3, "data", "datasets/imagenet/")
    assert (first.uploaded, first.skipped) == (2, 0)
    head = s3.head_object(Bucket="data", Key="datasets/imagenet/train/n01/a.JPEG")
    assert head["ETag"].strip('"').endswith("-3")  # multipart: 5 + 5 + 1 MiB
    again = stage.stage_data(source, s3, "data", "datasets/imagenet/")
    assert (again.uploaded, again.skipped) == (0, 2)  # resumed: same size and ETag
    (source / "LOC_val_solution.csv").write_text("ImageId,PredictionString\nx,n01 1 2 3 4\n")
    changed = stage.stage_data(source, s3, "data", "datasets/imagenet/")
    assert (changed.uploaded, changed.skipped) == (1, 1)


def test_the_eks_token_is_a_presigned_get_caller_identity_bound_to_the_cluster():
    session = boto3.Session(aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="secret", region_name=REGION)
    token = eks_token(session, "mltrain", REGION)
    assert token.startswith(TOKEN_PREFIX) and "=" not in token
    encoded = token.removeprefix(TOKEN_PREFIX)
    url = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    parsed = urllib.parse.urlparse(url)
    query = urllib.parse.parse_qs(parsed.query)
    assert parsed.netloc == "sts.us-west-2.amazonaws.com"
    assert query["Action"] == ["GetCallerIdentity"] and query["X-Amz-Expires"] == ["60"]
    assert CLUSTER_HEADER in query["X-Amz-SignedHeaders"][0].split(";")
    assert query["X-Amz-Credential"][0].startswith("AKIDEXAMPLE/") and "/us-west-2/sts/aws4_request" in (
        query["X-Amz-Credential"][0])


def trainctl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainctl", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)


def test_no_credentials_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true")
    result = trainctl("preflight", env=env)
    assert result.returncode == 2
    assert one_error(result.stderr) == ("error: no AWS credentials found; fix: set AWS_PROFILE, run `aws sso login`, "
                                     "or export AWS_ACCESS_KEY_ID")


def test_a_region_without_an_endpoint_is_one_line(tmp_path):
    bad = tmp_path / "cfg.yaml"
    bad.write_text((REPO / "config" / "example.yaml").read_text().replace("us-west-2", "us-nowhere-9"))
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_MAX_ATTEMPTS": "1",
           "AWS_EC2_METADATA_DISABLED": "true"}
    result = trainctl("--config", str(bad), "preflight", env=env)
    assert result.returncode == 2
    assert one_error(result.stderr) == ("error: cannot reach AWS in region 'us-nowhere-9'; fix: check `region` in the "
                                     "config and your network")


def test_an_invalid_job_spec_is_one_line(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: j\nimage: repo.example.com/t:1\nnode_group: p5\n")
    result = trainctl("render", str(job))
    assert result.returncode == 2
    assert one_error(result.stderr) == (f'config error: {job}: node_group: got "p5" (not a node group of this '
                                     "platform); allowed: p4d, trn1")


def test_a_cluster_that_is_not_deployed_is_one_line(aws):
    from trainctl.errors import UserError
    from trainctl.kube import api_client

    with pytest.raises(UserError) as caught:
        api_client(aws, "mltrain", REGION)
    assert str(caught.value) == ("no EKS cluster 'mltrain' in us-west-2; fix: deploy the platform (npx cdk deploy "
                                 "--all) or check `name_prefix` and `region`")


def test_stage_data_names_a_missing_storage_stack(aws):
    from trainctl.__main__ import stack_outputs
    from trainctl.errors import UserError

    with pytest.raises(UserError, match="stack mltrain-storage not found in us-west-2"):
        stack_outputs(aws, CONFIG, "storage", "DataBucketName")


def test_a_control_plane_az_that_does_not_exist_fails(aws):
    assert az_check(CONFIG, aws.client("ec2")).passed
    # The config refuses names the Region lacks; an account may still lack one it has.
    config = CONFIG.model_copy(update={"control_plane_az": "us-west-2z"})
    check = az_check(config, aws.client("ec2"))
    assert not check.passed and check.detail == "us-west-2z not in us-west-2"
    assert check.fix == "choose AZs among us-west-2a, us-west-2b, us-west-2c, us-west-2d"


@pytest.mark.parametrize(("caller", "listed", "passes"), [
    ("arn:aws:sts::123456789012:assumed-role/PlatformAdmin/alice", ["arn:aws:iam::123456789012:role/PlatformAdmin"],
     True),
    ("arn:aws:sts::123456789012:assumed-role/AWSReservedSSO_Admin_0123/alice",
     ["arn:aws:iam::123456789012:role/aws-reserved/sso.amazonaws.com/AWSReservedSSO_Admin_0123"], True),
    ("arn:aws:iam::123456789012:user/bob", ["arn:aws:iam::123456789012:user/bob"], True),
    ("arn:aws:sts::123456789012:assumed-role/Other/alice", ["arn:aws:iam::123456789012:role/PlatformAdmin"], False),
    ("arn:aws:sts::210987654321:assumed-role/PlatformAdmin/a", ["arn:aws:iam::123456789012:role/PlatformAdmin"], False),
    ("arn:aws:sts::123456789012:assumed-role/PlatformAdmin/alice", [], False),
])
def test_the_callers_role_must_have_an_access_entry(caller, listed, passes):
    config = parse_config(config_variant(**{"cluster.admin_principal_arns": listed}))
    sts = boto3.client("sts", region_name=REGION, aws_access_key_id="t", aws_secret_access_key="t")
    with Stubber(sts) as stub:
        stub.add_response("get_caller_identity", {"Arn": caller, "Account": caller.split(":")[4], "UserId": "U"})
        check = access_check(config, sts)
    assert check.passed is passes
    if not passes:
        assert check.fix.startswith(f"add {role_arn(caller)} to cluster.admin_principal_arns")


def test_add_on_versions_are_checked_against_what_eks_offers_and_defaults_are_named():
    eks = boto3.client("eks", region_name=REGION, aws_access_key_id="t", aws_secret_access_key="t")

    def offered(addon, *versions, default=None):
        return {"addons": [{"addonName": addon, "addonVersions": [
            {"addonVersion": v, "compatibilities": [{"clusterVersion": "1.34", "defaultVersion": v == default}]}
            for v in versions]}]}

    answers = {
        "eks-pod-identity-agent": offered("eks-pod-identity-agent", "v1.3.10-eksbuild.2", default="v1.3.10-eksbuild.2"),
        "vpc-cni": offered("vpc-cni", "v1.21.1-eksbuild.7", "v1.20.4-eksbuild.1"),
        "kube-proxy": offered("kube-proxy", "v1.34.1-eksbuild.2"),
        "coredns": offered("coredns", "v1.13.2-eksbuild.4"),
        "aws-fsx-csi-driver": offered("aws-fsx-csi-driver", "v1.7.0-eksbuild.1", default="v1.7.0-eksbuild.1"),
        "aws-ebs-csi-driver": offered("aws-ebs-csi-driver", "v1.50.0-eksbuild.1", default="v1.50.0-eksbuild.1"),
        "amazon-cloudwatch-observability": offered("amazon-cloudwatch-observability", "v4.5.0-eksbuild.1",
                                                   default="v4.5.0-eksbuild.1"),
        # Not offered (a Region or minor without it): the deploy's add-on would fail; preflight says so first.
        "eks-node-monitoring-agent": offered("eks-node-monitoring-agent"),
    }
    with Stubber(eks) as stub:
        for addon in PLATFORM_ADDONS:
            stub.add_response("describe_addon_versions", answers[addon],
                              {"addonName": addon, "kubernetesVersion": "1.34"})
        checks = {c.name: c for c in addon_checks(CONFIG, eks)}
    assert checks["add-on vpc-cni v1.21.1-eksbuild.7"].passed
    proxy = checks["add-on kube-proxy v1.34.6-eksbuild.2"]
    assert not proxy.passed and proxy.fix == "pin one of v1.34.1-eksbuild.2 in versions.addons.kube-proxy"
    assert checks["add-on aws-fsx-csi-driver"].detail == "not pinned: EKS would install v1.7.0-eksbuild.1"
    monitoring_agent = checks["add-on eks-node-monitoring-agent"]
    assert not monitoring_agent.passed
    assert monitoring_agent.fix == "no version of eks-node-monitoring-agent is offered for Kubernetes 1.34"
