"""The AWS Batch backend (issue 18): the stack against the Batch API's shapes (botocore's model),
trainctl against moto's Batch, and the config's one-line refusals."""

from __future__ import annotations

import copy
import os
import re

import boto3
import botocore.session
import pytest
import yaml
from botocore.validate import ParamValidator
from moto import mock_aws

from config import parse_config
from config.job_spec import parse_job_spec
from tests.trainctl_fixtures import one_error
from tests.conftest import REPO, VARIANTS
from trainctl.backends.batch import BatchJobs
from trainctl.errors import UserError
from training.contract import LAUNCHER_ENTRY, launcher_copy_command
from typed_config import ConfigError

BATCH_CONFIG = VARIANTS["batch"]
CONFIG = parse_config(BATCH_CONFIG)
JOB = yaml.safe_load((REPO / "k8s_charts" / "examples" / "resnet50-p4d.yaml").read_text())
SPEC = parse_job_spec(JOB, CONFIG)
BATCH_MODEL = botocore.session.get_session().get_service_model("batch")
CFN_ONLY = {"ReplaceComputeEnvironment", "UpdatePolicy"}  # CloudFormation's own settings, not the API's


@pytest.fixture(scope="module")
def batch_template(synth):
    result = synth(BATCH_CONFIG)
    return result.template(result.platform.batch).to_json()


def resource(template, kind) -> dict:
    (found,) = [r for r in template["Resources"].values() if r["Type"] == kind]
    return found["Properties"]


def plain(value):
    """CloudFormation intrinsics as the strings they resolve to, for shape validation."""
    if isinstance(value, dict):
        if len(value) == 1 and next(iter(value)).startswith(("Fn::", "Ref")):
            return "resolved-at-deploy"
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def as_api(value, shape):
    """CloudFormation's PascalCase properties as the API's request, guided by the API's shape:
    structure members are matched case-insensitively; map keys (log options, tags) stay."""
    if shape.type_name == "structure":
        members = {name.lower(): name for name in shape.members}
        out = {}
        for key, item in value.items():
            if key in CFN_ONLY:
                continue
            member = members.get(key.lower(), key)  # an unknown key stays, and the validator reports it
            out[member] = as_api(item, shape.members[member]) if member in shape.members else item
        return out
    if shape.type_name == "list":
        return [as_api(item, shape.member) for item in value]
    if shape.type_name == "map":
        return {k: as_api(v, shape.value) for k, v in value.items()}
    if shape.type_name in ("integer", "long") and isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


def validate(operation: str, params: dict) -> None:
    report = ParamValidator().validate(params, BATCH_MODEL.operation_model(operation).input_shape)
    assert not report.has_errors(), report.generate_report()


def test_the_job_definition_is_a_valid_register_job_definition_request(batch_template):
    props = plain(resource(batch_template, "AWS::Batch::JobDefinition"))
    validate("RegisterJobDefinition", as_api(props, BATCH_MODEL.operation_model("RegisterJobDefinition").input_shape))


def test_the_compute_environment_and_queue_are_valid_create_requests(batch_template):
    for kind, operation, name_key in (("AWS::Batch::ComputeEnvironment", "CreateComputeEnvironment",
                                       "computeEnvironmentName"), ("AWS::Batch::JobQueue", "CreateJobQueue", None)):
        shape = BATCH_MODEL.operation_model(operation).input_shape
        request = as_api(plain(resource(batch_template, kind)), shape)
        if name_key:
            request.setdefault(name_key, "named-by-cloudformation")
        validate(operation, request)


def test_the_compute_environment_is_the_node_groups_hardware_from_zero(batch_template):
    ce = resource(batch_template, "AWS::Batch::ComputeEnvironment")["ComputeResources"]
    assert ce["MinvCpus"] == 0 and ce["DesiredvCpus"] == 0 and ce["MaxvCpus"] == 4 * 96
    assert ce["InstanceTypes"] == ["p4d.24xlarge"] and ce["Ec2Configuration"] == [{"ImageType": "ECS_AL2023_NVIDIA"}]
    assert len(ce["Subnets"]) == 1 and "PlacementGroup" in ce
    assert resource(batch_template, "AWS::EC2::PlacementGroup")["Strategy"] == "cluster"
    data = resource(batch_template, "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]
    assert [i["InterfaceType"] for i in data["NetworkInterfaces"]] == ["efa"] * 4
    assert data["MetadataOptions"]["HttpTokens"] == "required"
    user_data = str(data["UserData"])
    assert "dnf install -y lustre-client" in user_data and "mount -t lustre -o relatime,flock " in user_data


def test_each_node_runs_the_trainer_with_fsx_gpus_efa_shared_memory_and_memlock(batch_template):
    definition = resource(batch_template, "AWS::Batch::JobDefinition")
    assert definition["Type"] == "multinode" and definition["PlatformCapabilities"] == ["EC2"]
    (node_range,) = definition["NodeProperties"]["NodeRangeProperties"]
    container = node_range["Container"]
    assert container["Command"][:4] == ["python", "-m", "training.launcher", "--aws-batch-mnp"]
    assert {"Type": "GPU", "Value": "8"} in container["ResourceRequirements"]
    devices = container["LinuxParameters"]["Devices"]
    assert [d["HostPath"] for d in devices] == [f"/dev/infiniband/uverbs{i}" for i in range(4)]
    assert container["LinuxParameters"]["SharedMemorySize"] > 0
    assert {"Name": "memlock", "SoftLimit": -1, "HardLimit": -1} in container["Ulimits"]
    assert container["MountPoints"] == [{"ContainerPath": "/fsx", "ReadOnly": False, "SourceVolume": "fsx"}]
    assert container["Volumes"] == [{"Host": {"SourcePath": "/fsx"}, "Name": "fsx"}]
    assert {"Name": "FI_PROVIDER", "Value": "efa"} in container["Environment"]
    assert container["LogConfiguration"]["LogDriver"] == "awslogs"


def test_retries_a_lost_host_but_not_a_config_or_code_error(batch_template):
    strategy = resource(batch_template, "AWS::Batch::JobDefinition")["RetryStrategy"]
    assert strategy["Attempts"] == 3
    rules = strategy["EvaluateOnExit"]
    assert rules[:3] == [{"Action": "EXIT", "OnExitCode": "78"}, {"Action": "EXIT", "OnExitCode": "76"},
                         {"Action": "RETRY", "OnStatusReason": "Host EC2*"}]
    assert rules[-1] == {"Action": "EXIT", "OnReason": "*"}  # anything else (an exit 1, a bad image) ends it

    def first_match(exit_code: str, status_reason: str) -> str:
        for rule in rules:
            if "OnExitCode" in rule and re.fullmatch(rule["OnExitCode"].replace("*", ".*"), exit_code):
                return rule["Action"]
            if "OnStatusReason" in rule and re.fullmatch(rule["OnStatusReason"].replace("*", ".*"), status_reason):
                return rule["Action"]
            if "OnReason" in rule:
                return rule["Action"]
        return "EXIT"

    assert first_match("", "Host EC2 (instance i-0abc) terminated.") == "RETRY"  # Spot reclaim, host failure
    assert first_match("78", "Essential container in task exited") == "EXIT"
    assert first_match("1", "Essential container in task exited") == "EXIT"


@pytest.mark.parametrize(("group", "line"), [
    ("trn1", 'batch.node_groups[0]: got "trn1" (trn1.32xlarge: Batch offers no AMI with the Neuron driver); '
             "allowed: a node group of a family Batch runs here: p4d, p4de, p5, p5e, p5en, g5, g6e"),
    ("p5", 'batch.node_groups[0]: got "p5" (not an accelerated node group of this platform); allowed: p4d, trn1'),
])
def test_the_config_refuses_what_batch_cannot_run_in_one_line(group, line):
    data = copy.deepcopy(BATCH_CONFIG)
    data["batch"]["node_groups"] = [group]
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    assert caught.value.problems == [line]


@pytest.fixture
def aws_batch(monkeypatch, batch_template):
    """moto's Batch with the stack's queue and job definition (the template's, as API requests)."""
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-west-2"}.items():
        monkeypatch.setenv(key, value)
    # moto 5.2.5 keeps a multinode definition's nodeProperties but leaves them out of
    # DescribeJobDefinitions (moto/batch/models.py JobDefinition.describe); the real API returns them.
    from moto.batch.models import JobDefinition

    describe = JobDefinition.describe

    def describe_with_nodes(self):
        result = describe(self)
        if self.node_properties is not None:
            result["nodeProperties"] = self.node_properties
        return result

    monkeypatch.setattr(JobDefinition, "describe", describe_with_nodes)
    with mock_aws(config={"batch": {"use_docker": False}}):
        session = boto3.Session(region_name="us-west-2")
        client = session.client("batch")
        role = session.client("iam").create_role(RoleName="batch", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
        client.create_compute_environment(computeEnvironmentName="mltrain-ce", type="UNMANAGED", serviceRole=role)
        client.create_job_queue(jobQueueName="mltrain-p4d", priority=1, state="ENABLED",
                                computeEnvironmentOrder=[{"order": 1, "computeEnvironment": "mltrain-ce"}])
        shape = BATCH_MODEL.operation_model("RegisterJobDefinition").input_shape
        props = as_api(plain(resource(batch_template, "AWS::Batch::JobDefinition")), shape)
        container = props["nodeProperties"]["nodeRangeProperties"][0]["container"]
        container["image"] = "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainer:set-by-trainctl-submit"
        container["logConfiguration"]["options"] = {"awslogs-group": "/aws/batch/mltrain-training"}
        client.register_job_definition(**props)
        yield session


def test_submit_registers_a_revision_with_the_jobs_image_size_and_command_then_submits(aws_batch):
    jobs = BatchJobs(aws_batch, CONFIG)
    request = jobs.job_definition(SPEC)
    validate("RegisterJobDefinition", request)  # botocore's model, as the real API would check it
    container = request["nodeProperties"]["nodeRangeProperties"][0]["container"]
    assert container["image"] == SPEC.image and request["nodeProperties"]["numNodes"] == SPEC.max_nodes
    command = container["command"]
    assert command[:4] == ["python", "-m", "training.launcher", "--aws-batch-mnp"]
    assert "--checkpoint.dir=/fsx/checkpoints/resnet50-imagenet" in command and "--optim.lr=0.8" in command
    job_id = jobs.submit(SPEC)
    described = aws_batch.client("batch").describe_jobs(jobs=[job_id])["jobs"][0]
    assert described["jobName"] == "resnet50-imagenet" and described["jobQueue"].endswith("mltrain-p4d")
    revision = aws_batch.client("batch").describe_job_definitions(jobDefinitionName="mltrain-p4d")["jobDefinitions"]
    assert max(d["revision"] for d in revision) == 2
    assert jobs.find("resnet50-imagenet")["jobId"] == job_id
    assert "resnet50-imagenet" in jobs.status("resnet50-imagenet").format()
    state = jobs.status("resnet50-imagenet").state
    if state in ("SUBMITTED", "PENDING", "RUNNABLE", "STARTING", "RUNNING"):  # moto moves jobs on by itself
        with pytest.raises(UserError, match=rf"is {state} on AWS Batch; fix: choose another name, or pass --replace"):
            jobs.submit(SPEC)
        jobs.cancel("resnet50-imagenet")
    else:
        with pytest.raises(UserError, match=r"already ended"):
            jobs.cancel("resnet50-imagenet")


PROGRAM_SPEC = parse_job_spec({
    "name": "own-program", "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/llm:2025.1", "node_group": "p4d",
    "max_nodes": 2, "program": {"module": "torchtitan.train", "args": ["--job.config_file=/fsx/configs/llama.toml"]},
    "env": {"HF_HOME": "/fsx/cache/hf"}}, CONFIG)


def test_a_program_job_gets_the_launcher_from_an_init_container_and_runs_like_the_trainer(aws_batch):
    jobs = BatchJobs(aws_batch, CONFIG)
    request = jobs.job_definition(PROGRAM_SPEC)
    validate("RegisterJobDefinition", request)
    (node_range,) = request["nodeProperties"]["nodeRangeProperties"]
    assert "container" not in node_range
    (task,) = node_range["ecsProperties"]["taskProperties"]
    launcher, job = task["containers"]
    assert launcher["image"] == CONFIG.jobs.launcher_image and launcher["essential"] is False
    assert launcher["command"] == launcher_copy_command("/platform-launcher")
    assert job["image"] == PROGRAM_SPEC.image and job["essential"] is True
    assert job["dependsOn"] == [{"containerName": launcher["name"], "condition": "SUCCESS"}]
    assert job["command"][:3] == ["python", LAUNCHER_ENTRY, "--aws-batch-mnp"]
    assert job["command"][-3:] == ["-m", "torchtitan.train", "--job.config_file=/fsx/configs/llama.toml"]
    # torchrun's subprocess workers for a foreign program
    assert not any(arg.startswith("--start-method") for arg in job["command"])
    env = {e["name"]: e["value"] for e in job["environment"]}
    assert env["PLATFORM_CHECKPOINT_DIR"] == "/fsx/checkpoints/own-program" and env["HF_HOME"] == "/fsx/cache/hf"
    assert {"sourceVolume": "platform-launcher", "containerPath": "/platform-launcher", "readOnly": True} in \
        job["mountPoints"]
    assert {"sourceVolume": "fsx", "containerPath": "/fsx", "readOnly": False} in job["mountPoints"]
    assert {"name": "fsx", "host": {"sourcePath": "/fsx"}} in task["volumes"]
    assert job["linuxParameters"]["sharedMemorySize"] > 0 and job["ulimits"]  # the stack's settings, kept
    assert {r["type"] for r in job["resourceRequirements"]} == {"GPU", "VCPU", "MEMORY"}

    job_id = jobs.submit(PROGRAM_SPEC)  # then status, list and cancel as for the packaged trainer
    assert jobs.find("own-program")["jobId"] == job_id
    assert jobs.status("own-program").name == "own-program"
    assert "own-program" in dict(jobs.list()) or jobs.status("own-program").finished
    if not jobs.status("own-program").finished:
        jobs.cancel("own-program")


def test_a_node_group_without_batch_is_refused_before_anything_is_registered(aws_batch):
    trn1 = parse_job_spec({**JOB, "node_group": "trn1", "name": "bert", "min_nodes": 1, "max_nodes": 2}, CONFIG)
    with pytest.raises(UserError, match=r"node_group: got 'trn1', which has no Batch compute environment; fix: "
                                        r"allowed with --backend batch: p4d"):
        BatchJobs(aws_batch, CONFIG).submit(trn1)
    revisions = aws_batch.client("batch").describe_job_definitions(jobDefinitionName="mltrain-p4d")["jobDefinitions"]
    assert len(revisions) == 1


def test_the_cli_without_a_batch_section_says_so_in_one_line(tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_EC2_METADATA_DISABLED": "true"}
    result = subprocess.run([sys.executable, "-m", "trainctl", "status", "j", "--backend", "batch"], cwd=REPO,
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert one_error(result.stderr) == ("error: --backend batch: this platform has no batch section; fix: add "
                                     "`batch: {node_groups: [...]}` to the config and deploy (see "
                                     "config/batch-example.yaml)")


def test_preflight_counts_the_compute_environments_into_the_ec2_quotas():
    from trainctl.preflight import quota_checks

    class Quotas:
        def get_service_quota(self, ServiceCode, QuotaCode):  # boto3's names
            return {"Quota": {"Value": 400.0}}

    checks = {c.name: c for c in quota_checks(CONFIG, Quotas())}
    p_quota = checks["quota Running On-Demand P instances"]
    # p4d on EKS (max 4) and on Batch (max 4): 8 x 96 vCPUs.
    assert p_quota.detail == "400 vCPUs, need 768 (max nodes x vCPUs)" and not p_quota.passed


def test_logs_rank_on_batch_is_the_node_holding_that_rank_and_pod_is_the_node_index(monkeypatch, capsys):
    """As on EKS (trainctl logs --rank): the node whose agent claims the rank in its newest node_ranks
    line; --pod INDEX the node by index; the options Batch cannot serve are one line, not ignored."""
    import json

    from trainctl import __main__ as trainctl
    from trainctl.backends.batch import BatchStatus

    def ranks(node: int, held: list[int]) -> str:
        return json.dumps({"event": "node_ranks", "time": 1.0, "group_rank": node, "group_world_size": 2,
                           "global_ranks": held}) + "\n"

    logs = {0: "node 0\n" + ranks(0, [0, 1]), 1: "node 1\n" + ranks(1, [2, 3])}
    monkeypatch.setattr(BatchJobs, "__init__", lambda self, session, config: None)
    monkeypatch.setattr(BatchJobs, "status", lambda self, name: BatchStatus(name, "id", "RUNNING", "", [], 2))
    monkeypatch.setattr(BatchJobs, "log", lambda self, name, node: logs[node])
    monkeypatch.setattr(trainctl, "_session", lambda args: None)
    base = ["logs", "j", "--backend", "batch", "--config", "config/batch-example.yaml"]
    for extra, expected in ((["--rank", "3"], "node 1"), ([], "node 0"), (["--pod", "1"], "node 1")):
        assert trainctl.main(base + extra) == 0
        assert capsys.readouterr().out.startswith(expected), extra
    assert trainctl.main(base + ["--rank", "4"]) == 2
    assert "--rank: got 4, which no node of j holds now" in capsys.readouterr().err
    assert trainctl.main(base + ["--follow"]) == 2
    assert "logs --backend batch: got --follow" in capsys.readouterr().err
