"""The optional slurm stack: AWS ParallelCluster declared through its custom resource, its
ClusterConfiguration built from the typed config and checked offline with ParallelCluster's schema."""

from __future__ import annotations

import copy
import json
import re

import pytest
from aws_cdk import Validations

from cdk_constructs.pcluster_schema import ClusterConfigurationRefused, check_cluster_configuration, run_check
from cdk_constructs.slurm_cluster import PLACEHOLDERS, SlurmClusterProps, SlurmQueueProps, cluster_configuration
from config.catalog import lookup
from config.versions import PARALLELCLUSTER_VERSION
from tests.conftest import REPO, VARIANTS, config_variant
from tests.unit.test_config import problems
from training.contract import FSX_MOUNT

SLURM = VARIANTS["slurm"]
# Every kind of queue: EFA from the catalog (p4d), a Capacity Block (p5en), an On-Demand Capacity
# Reservation (p3dn, EFA), Spot without EFA or placement group (g5), and an existing file system.
EVERY_QUEUE = {**copy.deepcopy(SLURM), "accelerated_node_groups": [
    {"name": "p4d", "instance_type": "p4d.24xlarge", "min_size": 0, "desired_size": 0, "max_size": 4},
    {"name": "p5en", "instance_type": "p5en.48xlarge", "min_size": 0, "desired_size": 0, "max_size": 2,
     "capacity_reservation": {"kind": "capacity_block", "id": "cr-0123456789abcdef0"}},
    {"name": "p3dn", "instance_type": "p3dn.24xlarge", "min_size": 0, "desired_size": 0, "max_size": 3,
     "capacity_reservation": {"kind": "on_demand", "id": "cr-0fedcba9876543210"}},
    {"name": "g5", "instance_type": "g5.12xlarge", "min_size": 0, "desired_size": 0, "max_size": 2,
     "capacity_type": "SPOT", "efa": False, "placement_group": False},
], "slurm": {"queues": [{"node_group": g} for g in ("p4d", "p5en", "p3dn", "g5")],
             "file_system": {"id": "fs-0123456789abcdef0", "availability_zone": "us-west-2a"},
             "retain_on_delete": True}}


def _slurm(synth, data=SLURM):
    result = synth(data)
    stack = result.platform.slurm
    template = result.template(stack).to_json()
    (cluster,) = [r for r in template["Resources"].values() if r["Type"] == "Custom::PclusterCluster"]
    return result, stack, template, cluster


def test_the_parallelcluster_pin_is_the_one_installed_for_the_check():
    pins = re.findall(r"^aws-parallelcluster==(\S+)$", (REPO / "requirements-pcluster.txt").read_text(), re.M)
    assert pins == [PARALLELCLUSTER_VERSION]


def test_cluster_resource_from_the_versioned_provider(synth):
    _, stack, template, cluster = _slurm(synth)
    (provider_id,) = [k for k, r in template["Resources"].items() if r["Type"] == "AWS::CloudFormation::Stack"]
    url, variables = template["Resources"][provider_id]["Properties"]["TemplateURL"]["Fn::Sub"]
    assert url.endswith("/parallelcluster/${Version}/templates/custom_resource/cluster.yaml")
    assert url.startswith("https://${AWS::Region}-aws-parallelcluster.s3.${AWS::Region}.${AWS::URLSuffix}/")
    assert variables == {"Version": PARALLELCLUSTER_VERSION}
    props = cluster["Properties"]
    assert props["ServiceToken"] == {"Fn::GetAtt": [provider_id, "Outputs.ServiceToken"]}
    assert props["ClusterName"] == "mltrain-slurm-cluster" != stack.stack_name
    # ParallelCluster's DeletionPolicy deletes the cluster; CloudFormation's lets its Lambda run on delete.
    assert props["DeletionPolicy"] == "Delete" and cluster["DeletionPolicy"] == "Delete"


def test_retain_on_delete_keeps_the_cluster(synth):
    _, _, _, cluster = _slurm(synth, EVERY_QUEUE)
    assert cluster["Properties"]["DeletionPolicy"] == "Retain"


def test_head_node_private_with_ssm_imdsv2_and_encrypted_root(synth):
    result, stack, _, cluster = _slurm(synth)
    config = cluster["Properties"]["ClusterConfiguration"]
    net = result.platform.network.network
    head = config["HeadNode"]
    assert head["Networking"] == {"SubnetId": stack.resolve(net.compute_subnet.subnet_id),
                                  "AdditionalSecurityGroups": [stack.resolve(net.node_security_group.security_group_id)]}
    assert "ElasticIp" not in head["Networking"]
    assert head["Ssh"] == {"AllowedIps": "10.0.0.0/16"}
    assert head["LocalStorage"]["RootVolume"]["Encrypted"] is True
    assert head["Imds"] == {"Secured": True} and config["Imds"] == {"ImdsSupport": "v2.0"}
    policies = json.dumps(head["Iam"]["AdditionalIamPolicies"])
    assert ":iam::aws:policy/AmazonSSMManagedInstanceCore" in policies
    assert config["Monitoring"]["Logs"]["CloudWatch"] == {"Enabled": True, "RetentionInDays": 30, "DeletionPolicy": "Retain"}
    assert config["Monitoring"]["Dashboards"]["CloudWatch"]["Enabled"] is True


def test_the_storage_stacks_file_system_at_the_contracts_mount(synth):
    result, stack, _, cluster = _slurm(synth)
    (storage,) = cluster["Properties"]["ClusterConfiguration"]["SharedStorage"]
    assert storage["MountDir"] == FSX_MOUNT
    assert storage["FsxLustreSettings"] == {
        "FileSystemId": stack.resolve(result.platform.storage.file_system.volume.file_system_id)}


def test_each_queue_from_its_node_group(synth):
    result, stack, _, cluster = _slurm(synth, EVERY_QUEUE)
    config = cluster["Properties"]["ClusterConfiguration"]
    subnet = stack.resolve(result.platform.network.network.compute_subnet.subnet_id)
    queues = {q["Name"]: q for q in config["Scheduling"]["SlurmQueues"]}
    assert list(queues) == ["p4d", "p5en", "p3dn", "g5"]
    for queue in queues.values():
        assert queue["Networking"]["SubnetIds"] == [subnet]
        assert queue["ComputeSettings"]["LocalStorage"]["RootVolume"]["Encrypted"] is True
        (resource,) = queue["ComputeResources"]
        assert resource["Name"] == queue["Name"]
    compute = {name: q["ComputeResources"][0] for name, q in queues.items()}
    assert {n: c["Efa"]["Enabled"] for n, c in compute.items()} == {"p4d": True, "p5en": True, "p3dn": True, "g5": False}
    assert {n: (c["MinCount"], c["MaxCount"]) for n, c in compute.items()} == {
        "p4d": (0, 4), "p5en": (2, 2), "p3dn": (0, 3), "g5": (0, 2)}  # a Capacity Block's nodes are static
    assert {n: q["CapacityType"] for n, q in queues.items()} == {
        "p4d": "ONDEMAND", "p5en": "CAPACITY_BLOCK", "p3dn": "ONDEMAND", "g5": "SPOT"}
    assert compute["p5en"]["CapacityReservationTarget"] == {"CapacityReservationId": "cr-0123456789abcdef0"}
    assert compute["p3dn"]["CapacityReservationTarget"] == {"CapacityReservationId": "cr-0fedcba9876543210"}
    assert "CapacityReservationTarget" not in compute["p4d"]
    assert {n: q["Networking"].get("PlacementGroup") for n, q in queues.items()} == {
        "p4d": {"Enabled": True}, "p5en": None, "p3dn": {"Enabled": True}, "g5": {"Enabled": False}}
    (storage,) = config["SharedStorage"]
    assert storage["FsxLustreSettings"] == {"FileSystemId": "fs-0123456789abcdef0"}


def test_compute_nodes_pull_only_the_trainer_repository(synth):
    _, _, template, cluster = _slurm(synth)
    (queue,) = cluster["Properties"]["ClusterConfiguration"]["Scheduling"]["SlurmQueues"]
    policy_ids = [p["Policy"]["Ref"] for p in queue["Iam"]["AdditionalIamPolicies"]]
    statements = [s for i in policy_ids for s in template["Resources"][i]["Properties"]["PolicyDocument"]["Statement"]]
    by_resource = {json.dumps(s["Resource"]): s["Action"] for s in statements}
    assert by_resource.pop('"*"') == "ecr:GetAuthorizationToken"
    repository = [r for r in by_resource if ":repository/trainer" in r]
    assert by_resource.pop(repository[0]) == ["ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage",
                                              "ecr:GetDownloadUrlForLayer"]
    assert list(by_resource.values()) == ["s3:GetObject"]  # the custom action that enables Pyxis, one object


def test_pyxis_enabled_by_a_custom_action_on_every_node(synth):
    _, _, _, cluster = _slurm(synth)
    config = cluster["Properties"]["ClusterConfiguration"]
    (queue,) = config["Scheduling"]["SlurmQueues"]
    # The head node also makes the jobs' shared folders writable by every cluster user (Pyxis runs a
    # job's container as its submitter), the contract's folders' parents.
    shared = ["/fsx/checkpoints", "/fsx/staging", "/fsx/cache"]
    for node, args in ((config["HeadNode"], ["head", *shared]), (queue, ["compute"])):
        (action,) = node["CustomActions"]["OnNodeConfigured"]["Sequence"]
        assert action["Args"] == args and action["Script"]["Fn::Sub"].startswith("s3://cdk-")
    script = (REPO / "cdk_constructs" / "slurm_node" / "enable_pyxis.sh").read_text()
    assert "/opt/parallelcluster/examples/" in script or "examples=/opt/parallelcluster/examples" in script


def test_outputs_the_cli_reads(synth):
    _, _, template, cluster = _slurm(synth)
    outputs = template["Outputs"]
    (cluster_id,) = [k for k, r in template["Resources"].items() if r is cluster]
    assert outputs["ClusterName"]["Value"] == "mltrain-slurm-cluster"
    assert outputs["HeadNodeInstanceId"]["Value"] == {"Fn::GetAtt": [cluster_id, "headNode.instanceId"]}
    assert outputs["Region"]["Value"] == "us-west-2"


def test_deployed_after_and_destroyed_before_what_it_reads(synth):
    result = synth(SLURM)
    names = [s.stack_name for s in result.platform.stacks]
    assert names[-1] == "mltrain-slurm" and [s.stack_name for s in result.platform.teardown][0] == "mltrain-slurm"
    artifact = {s.stack_name: s for s in result.assembly.stacks}["mltrain-slurm"]
    stacks = {d.id for d in artifact.dependencies} - {"mltrain-slurm.assets"}  # the Pyxis script, uploaded first
    assert stacks == {"mltrain-network", "mltrain-registry", "mltrain-storage"}


def test_no_slurm_section_no_slurm_stack(synth):
    assert synth(VARIANTS["example"]).platform.slurm is None


# --- ParallelCluster's own schema, offline -------------------------------------------------------------

def _placeholder_configuration() -> dict:
    props = SlurmClusterProps(
        cluster_name="mltrain-slurm-cluster", parallelcluster_version=PARALLELCLUSTER_VERSION, region="us-west-2",
        head_node_instance_type="m5.2xlarge", subnet=None, security_group=None, ssh_cidr="10.0.0.0/16",
        file_system_id="fs-0123456789abcdef0", mount_dir=FSX_MOUNT,
        repository_arn="arn:aws:ecr:us-west-2:123456789012:repository/trainer",
        queues=[SlurmQueueProps(name="p4d", instance=lookup("p4d.24xlarge"), max_count=4, efa=True, placement_group=True)])
    return cluster_configuration(props, PLACEHOLDERS)


def test_the_schema_accepts_the_generated_configuration():
    check_cluster_configuration(_placeholder_configuration(), "mltrain-slurm-cluster", "us-west-2")


@pytest.mark.parametrize(("break_it", "expected"), [
    pytest.param(lambda c: c["HeadNode"].update(Bogus=1), '"Bogus": ["Unknown field."]', id="unknown-key"),
    pytest.param(lambda c: c["Scheduling"]["SlurmQueues"][0]["ComputeResources"][0].update(MinCount=-1),
                 "MinCount", id="negative-min-count"),
    pytest.param(lambda c: c["Monitoring"]["Logs"]["CloudWatch"].update(RetentionInDays=1096),
                 "RetentionInDays", id="retention-parallelcluster-refuses"),
    pytest.param(lambda c: c["SharedStorage"][0]["FsxLustreSettings"].update(FileSystemId="not-an-id"),
                 "FileSystemId", id="bad-file-system-id"),
])
def test_the_schema_refuses_a_broken_configuration(break_it, expected):
    configuration = _placeholder_configuration()
    break_it(configuration)
    with pytest.raises(ClusterConfigurationRefused, match=re.escape(expected)):
        check_cluster_configuration(configuration, "mltrain-slurm-cluster", "us-west-2")


def test_the_check_cannot_reach_aws():
    done = run_check(["--probe-aws"], "us-west-2")
    assert done.returncode == 3, done.stderr
    assert "AWS call refused offline: ec2.DescribeInstanceTypes" in done.stderr


# --- the config's refusals, one line each -------------------------------------------------------------

@pytest.mark.parametrize(("changes", "expected"), [
    pytest.param({"accelerated_node_groups.0.instance_type": "p3.8xlarge", "accelerated_node_groups.0.efa": False,
                  "slurm": {"queues": [{"node_group": "p4d", "efa": True}]}},
                 "slurm.queues[0].efa: got true (p3.8xlarge has no EFA interfaces); allowed: false for p3.8xlarge "
                 "(EFA: p3dn.24xlarge)", id="efa-on-a-p3-queue"),
    pytest.param({"slurm": {"queues": [{"node_group": "p4d", "availability_zone": "us-west-2b"}]}},
                 "slurm.queues[0].availability_zone: got \"us-west-2b\" (every queue runs in the one compute subnet, "
                 "beside the file system); allowed: us-west-2a (compute_az), or leave it out",
                 id="queue-outside-the-compute-az"),
    pytest.param({"slurm": {"queues": [{"node_group": "p4d"}],
                            "file_system": {"id": "fs-0123456789abcdef0", "availability_zone": "us-west-2b"}}},
                 "slurm.file_system.availability_zone: got \"us-west-2b\" (the compute nodes live in the compute subnet "
                 "only); allowed: us-west-2a (compute_az)", id="file-system-in-another-az"),
    pytest.param({"slurm": {"queues": [{"node_group": "trn1"}]}},
                 "slurm.queues[0].node_group: got \"trn1\" (trn1.32xlarge: ParallelCluster's official AMIs carry no "
                 "Neuron driver); allowed: a node group of NVIDIA GPUs", id="trainium-queue"),
    pytest.param({"slurm": {"queues": [{"node_group": "p5"}]}},
                 "slurm.queues[0].node_group: got \"p5\" (not an accelerated node group of this platform); allowed: p4d, trn1",
                 id="unknown-node-group"),
    pytest.param({"slurm": {"queues": [{"node_group": "p4d"}, {"node_group": "p4d"}]}},
                 "slurm.queues[1].node_group: got \"p4d\" (listed twice); allowed: each node group once", id="queue-twice"),
    pytest.param({"slurm": {"queues": [{"node_group": "p4d"}], "log_retention_days": 1096}},
                 "slurm.log_retention_days: got 1096 (not a retention ParallelCluster accepts); allowed: 1, 3, 5, 7, 14, "
                 "30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1827, 3653", id="retention-parallelcluster-refuses"),
    pytest.param({"slurm": {"queues": [{"node_group": "p4d"}], "head_node_instance_type": "p4d.24xlarge"}},
                 "slurm.head_node_instance_type: got \"p4d.24xlarge\" (not a CPU instance type in the catalog); allowed: "
                 "c5.2xlarge, c5.4xlarge, m5.2xlarge, m5.4xlarge, m6i.2xlarge, m7i.2xlarge", id="gpu-head-node"),
])
def test_slurm_mistakes_are_refused_in_one_line(changes, expected):
    assert problems(config_variant(**changes)) == [expected]


def test_the_slurm_stack_acknowledges_only_the_reviewed_finding(synth):
    stack = synth(SLURM).platform.slurm
    found = {}
    for construct in stack.node.find_all():
        for entry in construct.node.metadata:
            if entry.type == Validations.ACKNOWLEDGED_RULES_METADATA_KEY:
                found.update({(construct.node.path, rule): reason for rule, reason in entry.data.items()})
    assert set(found) == {("mltrain-slurm/Slurm/ImagePullPolicy", "AwsSolutions::AwsSolutions-IAM5[Resource::*]")}
    assert all(len(reason) > 30 for reason in found.values())


def test_kill_wait_is_the_stop_budget_the_scripts_are_rendered_with(synth):
    from training.contract import SLURM_KILL_WAIT_S

    _, _, _, cluster = _slurm(synth)
    settings = cluster["Properties"]["ClusterConfiguration"]["Scheduling"]["SlurmSettings"]
    assert settings["CustomSlurmSettings"] == [{"KillWait": SLURM_KILL_WAIT_S}]
