"""Assertions on the storage and registry stacks: FSx placement and ports, the S3 links,
encryption, retention, the image repository and the node role's pull grant."""

from __future__ import annotations

import json
import re

import pytest
from aws_cdk.assertions import Match

from tests.conftest import REPO, VARIANTS, config_variant

FSX = "AWS::FSx::FileSystem"
DRA = "AWS::FSx::DataRepositoryAssociation"
ALL_EVENTS = ["NEW", "CHANGED", "DELETED"]


@pytest.fixture(scope="module")
def example(synth):
    return synth(VARIANTS["example"])


def storage(result):
    return result.template(result.platform.storage)


def registry(result):
    return result.template(result.platform.registry)


def only(resources: dict) -> tuple[str, dict]:
    assert len(resources) == 1, sorted(resources)
    return next(iter(resources.items()))


def file_system(result) -> dict:
    return only(storage(result).find_resources(FSX))[1]


def network_output(result, reference: dict) -> dict:
    """Follow a storage-stack reference into the network stack's output it names."""
    ref = reference["Fn::GetStackOutput"]
    assert ref["StackName"] == result.platform.network.stack_name
    outputs = result.template(result.platform.network).find_outputs("*")
    return outputs[ref["OutputName"]]["Value"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_file_system_sits_in_the_compute_subnet(synth, variant):
    result = synth(VARIANTS[variant])
    (subnet_ref,) = file_system(result)["Properties"]["SubnetIds"]
    subnet_id = network_output(result, subnet_ref)
    net = result.template(result.platform.network)
    compute = net.find_outputs("ComputeSubnetId")["ComputeSubnetId"]["Value"]
    assert subnet_id == compute
    subnet = net.find_resources("AWS::EC2::Subnet")[subnet_id["Ref"]]["Properties"]
    assert subnet["AvailabilityZone"] == result.config.compute_az
    assert subnet["MapPublicIpOnLaunch"] is False


def _rules(t, kind: str, group: dict) -> set[tuple]:
    peer_key = "SourceSecurityGroupId" if kind == "Ingress" else "DestinationSecurityGroupId"
    found = set()
    for rule in t.find_resources(f"AWS::EC2::SecurityGroup{kind}").values():
        p = rule["Properties"]
        if p["GroupId"] == group:
            found.add((p["IpProtocol"], p["FromPort"], p["ToPort"], json.dumps(p.get(peer_key), sort_keys=True)))
    return found


def test_lustre_ports_are_exactly_988_and_1018_to_1023_with_nodes_and_itself(example):
    t = storage(example)
    fs = file_system(example)["Properties"]
    (fsx_sg,) = fs["SecurityGroupIds"]
    sg_logical_id = fsx_sg["Fn::GetAtt"][0]
    node_sg = next(
        r["Properties"]["SourceSecurityGroupId"]
        for r in t.find_resources("AWS::EC2::SecurityGroupIngress").values()
        if r["Properties"]["GroupId"] == fsx_sg and "Fn::GetStackOutput" in r["Properties"]["SourceSecurityGroupId"]
    )
    node_sg_ref = network_output(example, node_sg)
    assert node_sg_ref == example.template(example.platform.network).find_outputs("NodeSecurityGroupId")[
        "NodeSecurityGroupId"
    ]["Value"]

    peers = {json.dumps(fsx_sg, sort_keys=True), json.dumps(node_sg, sort_keys=True)}
    expected = {("tcp", lo, hi, peer) for lo, hi in ((988, 988), (1018, 1023)) for peer in peers}
    assert _rules(t, "Ingress", fsx_sg) == expected
    assert _rules(t, "Egress", fsx_sg) == expected
    # The node side mirrors it: clients reach the servers, and the servers reach back.
    lustre_to_fsx = {("tcp", lo, hi, json.dumps(fsx_sg, sort_keys=True)) for lo, hi in ((988, 988), (1018, 1023))}
    assert _rules(t, "Ingress", node_sg) == lustre_to_fsx
    assert _rules(t, "Egress", node_sg) == lustre_to_fsx
    group = t.find_resources("AWS::EC2::SecurityGroup")[sg_logical_id]["Properties"]
    # No inline rules at all: CloudFormation drops the default allow-all egress once the
    # explicit egress rules above exist, so these rules are the whole of it.
    assert "SecurityGroupIngress" not in group and "SecurityGroupEgress" not in group


@pytest.mark.parametrize("variant", ["example", "fsx-scratch"])
def test_data_and_checkpoints_sync_both_ways_with_s3(synth, variant):
    result = synth(VARIANTS[variant])
    t = storage(result)
    (bucket_id, _), = t.find_resources("AWS::S3::Bucket",
                                       {"Properties": {"VersioningConfiguration": Match.any_value()}}).items()
    links = {}
    for dra in t.find_resources(DRA).values():
        p = dra["Properties"]
        assert p["FileSystemId"] == {"Ref": only(t.find_resources(FSX))[0]}
        assert p["S3"] == {"AutoImportPolicy": {"Events": ALL_EVENTS}, "AutoExportPolicy": {"Events": ALL_EVENTS}}
        assert p["BatchImportMetaDataOnCreate"] is True
        links[p["FileSystemPath"]] = p["DataRepositoryPath"]
    assert links == {
        "/datasets": {"Fn::Join": ["", ["s3://", {"Ref": bucket_id}, "/datasets/"]]},
        "/checkpoints": {"Fn::Join": ["", ["s3://", {"Ref": bucket_id}, "/checkpoints/"]]},
    }
    lustre = file_system(result)["Properties"]["LustreConfiguration"]
    assert not {"ImportPath", "ExportPath", "AutoImportPolicy"} & set(lustre)


def test_prefixes_come_from_config(synth):
    result = synth(config_variant(**{"fsx.data_prefix": "data/imagenet/", "fsx.checkpoint_prefix": "runs/ckpt/"}))
    paths = sorted(d["Properties"]["FileSystemPath"] for d in storage(result).find_resources(DRA).values())
    assert paths == ["/data/imagenet", "/runs/ckpt"]
    assert result.config.fsx.data_path == "/data/imagenet"


@pytest.mark.parametrize(
    ("variant", "capacity", "deployment", "throughput"),
    [
        ("example", 1200, "PERSISTENT_2", 250),
        ("fsx-2400", 2400, "PERSISTENT_2", 250),
        ("fsx-4800", 4800, "PERSISTENT_2", 500),
        ("fsx-scratch", 1200, "SCRATCH_2", None),
    ],
)
def test_file_system_shape_follows_config(synth, variant, capacity, deployment, throughput):
    fs = file_system(synth(VARIANTS[variant]))["Properties"]
    lustre = fs["LustreConfiguration"]
    assert fs["StorageCapacity"] == capacity
    assert fs["FileSystemTypeVersion"] == "2.15"
    assert lustre["DeploymentType"] == deployment
    assert lustre.get("PerUnitStorageThroughput") == throughput
    assert lustre["DataCompressionType"] == "LZ4"
    assert lustre["LogConfiguration"]["Level"] == "WARN_ERROR"


def test_file_system_logs_to_its_own_log_group_under_aws_fsx(example):
    t = storage(example)
    fs_id, fs = only(t.find_resources(FSX))
    (group_id, group), = t.find_resources("AWS::Logs::LogGroup").items()
    name = group["Properties"]["LogGroupName"]
    assert name == "/aws/fsx/mltrain-storage-lustre"
    assert group["Properties"]["RetentionInDays"] == 90
    destination = json.dumps(fs["Properties"]["LustreConfiguration"]["LogConfiguration"]["Destination"])
    # The group's own ARN (arn:...:log-group:<name>), which FSx takes, not the ":*" form of Fn::GetAtt Arn.
    assert destination.endswith(f':log-group:{name}"]]}}') and ":*" not in destination
    assert group_id in fs["DependsOn"]


def test_persistent_file_system_is_encrypted_with_a_rotated_kms_key_and_backed_up(example):
    t = storage(example)
    fs = file_system(example)["Properties"]
    key_id = fs["KmsKeyId"]["Ref"]
    assert t.find_resources("AWS::KMS::Key")[key_id]["Properties"]["EnableKeyRotation"] is True
    assert fs["LustreConfiguration"]["AutomaticBackupRetentionDays"] == 7
    assert fs["LustreConfiguration"]["CopyTagsToBackups"] is True


def test_scratch_file_system_uses_fsx_owned_encryption_and_has_no_backups(synth):
    result = synth(VARIANTS["fsx-scratch"])
    fs = file_system(result)["Properties"]
    # FSx rejects a KmsKeyId on scratch types; they are always encrypted with FSx-owned keys.
    assert "KmsKeyId" not in fs
    storage(result).resource_count_is("AWS::KMS::Key", 0)
    assert "AutomaticBackupRetentionDays" not in fs["LustreConfiguration"]


def test_buckets_are_encrypted_private_tls_only_and_the_data_bucket_versioned(example):
    t = storage(example)
    buckets = t.find_resources("AWS::S3::Bucket")
    assert len(buckets) == 2
    for logical_id, bucket in buckets.items():
        p = bucket["Properties"]
        assert p["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"] == {
            "SSEAlgorithm": "AES256"
        }
        assert p["PublicAccessBlockConfiguration"] == {
            "BlockPublicAcls": True, "BlockPublicPolicy": True, "IgnorePublicAcls": True, "RestrictPublicBuckets": True
        }
        t.has_resource_properties(
            "AWS::S3::BucketPolicy",
            {
                "Bucket": {"Ref": logical_id},
                "PolicyDocument": {
                    "Statement": Match.array_with([
                        Match.object_like({"Effect": "Deny", "Condition": {"Bool": {"aws:SecureTransport": "false"}}})
                    ])
                },
            },
        )
    (_, data), = t.find_resources("AWS::S3::Bucket", {"Properties": {"VersioningConfiguration": {"Status": "Enabled"}}}).items()
    assert data["Properties"]["LoggingConfiguration"]["LogFilePrefix"] == "data-bucket/"
    (rule,) = data["Properties"]["LifecycleConfiguration"]["Rules"]
    assert rule["NoncurrentVersionExpiration"] == {"NoncurrentDays": 30}


def test_image_repository_is_scanned_encrypted_immutable_and_trimmed_per_flavour(example):
    t = registry(example)
    (_, repo), = t.find_resources("AWS::ECR::Repository").items()
    p = repo["Properties"]
    assert p["RepositoryName"] == "trainer"
    assert p["ImageScanningConfiguration"] == {"ScanOnPush": True}
    assert p["EncryptionConfiguration"] == {"EncryptionType": "KMS"}
    assert p["ImageTagMutability"] == "IMMUTABLE"
    rules = json.loads(p["LifecyclePolicy"]["LifecyclePolicyText"])["rules"]
    assert [(r["selection"].get("tagPrefixList"), r["selection"]["countNumber"]) for r in rules] == [
        (["gpu-"], 30), (["neuron-"], 30), (None, 30)
    ]
    assert rules[-1]["selection"]["tagStatus"] == "any"


def test_node_role_pulls_from_the_repository_through_grant_pull(example):
    t = registry(example)
    (role_id, role), = t.find_resources("AWS::IAM::Role").items()
    assert role["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}
    (repo_id, _), = t.find_resources("AWS::ECR::Repository").items()
    t.has_resource_properties(
        "AWS::IAM::Policy",
        {
            "Roles": [{"Ref": role_id}],
            "PolicyDocument": {
                "Statement": Match.array_with([
                    {
                        "Action": ["ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"],
                        "Effect": "Allow",
                        "Resource": {"Fn::GetAtt": [repo_id, "Arn"]},
                    }
                ])
            },
        },
    )


RETAINED_TYPES = {
    FSX, DRA, "AWS::KMS::Key", "AWS::S3::Bucket", "AWS::ECR::Repository", "AWS::EC2::SecurityGroup",
}


def test_data_is_retained_by_default(example):
    resources = {**storage(example).to_json()["Resources"], **registry(example).to_json()["Resources"]}
    assert {r["Type"] for r in resources.values()} >= RETAINED_TYPES
    for logical_id, r in resources.items():
        if r["Type"] in RETAINED_TYPES:
            assert r.get("DeletionPolicy") == "Retain", logical_id
            assert r.get("UpdateReplacePolicy") == "Retain", logical_id


def test_a_kept_file_system_keeps_its_own_rules_but_not_the_node_side_mirror(example):
    resources = storage(example).to_json()["Resources"]
    fsx_sg = file_system(example)["Properties"]["SecurityGroupIds"][0]
    for logical_id, r in resources.items():
        if r["Type"] in ("AWS::EC2::SecurityGroupIngress", "AWS::EC2::SecurityGroupEgress"):
            own = r["Properties"]["GroupId"] == fsx_sg
            assert (r.get("DeletionPolicy") == "Retain") is own, logical_id


def test_opting_out_of_retention_deletes_everything_with_the_stack(synth):
    result = synth(VARIANTS["nothing-retained"])
    resources = {**storage(result).to_json()["Resources"], **registry(result).to_json()["Resources"]}
    assert [k for k, r in resources.items() if r.get("DeletionPolicy") == "Retain"] == []
    (_, repo), = registry(result).find_resources("AWS::ECR::Repository").items()
    assert repo["Properties"]["EmptyOnDelete"] is True
    for bucket in storage(result).find_resources("AWS::S3::Bucket").values():
        # Datasets and checkpoints are never emptied automatically: a non-empty bucket stops the delete.
        assert bucket.get("DeletionPolicy") == "Delete"
    assert not storage(result).find_resources("Custom::S3AutoDeleteObjects")


def test_outputs_for_later_stacks_charts_and_the_cli(example):
    outputs = storage(example).find_outputs("*")
    # PublishOutput*: what CDK publishes for the cluster stack's weak references.
    assert {k for k in outputs if not k.startswith("PublishOutput")} == {
        "FileSystemId", "FileSystemDnsName", "FileSystemMountName", "FileSystemSecurityGroupId",
        "FileSystemSubnetId", "DataBucketName", "DataPrefix", "CheckpointPrefix",
    }
    assert {k for k in registry(example).find_outputs("*") if not k.startswith("PublishOutput")} == {
        "ImageRepositoryUri", "NodeRoleArn"}
    fs_id = only(storage(example).find_resources(FSX))[0]
    assert outputs["FileSystemMountName"]["Value"] == {"Fn::GetAtt": [fs_id, "LustreMountName"]}
    assert outputs["FileSystemDnsName"]["Value"] == {"Fn::GetAtt": [fs_id, "DNSName"]}
    volume = example.platform.storage.file_system.volume
    assert volume.file_system_id and volume.dns_name and volume.mount_name


def test_stacks_depend_one_way_and_deletion_is_never_blocked_by_exports(example):
    stacks = {s.stack_name: s for s in example.assembly.stacks}
    p = example.platform
    network, registry_stack, storage_stack = p.network.stack_name, p.registry.stack_name, p.storage.stack_name

    def depends_on(name):
        return sorted(d.id for d in stacks[name].dependencies if d.id in stacks)

    assert depends_on(network) == []
    assert depends_on(registry_stack) == []
    assert depends_on(storage_stack) == [network]
    assert depends_on(p.cluster.stack_name) == sorted([network, registry_stack, storage_stack])
    for stack in stacks.values():
        # Weak references (Fn::GetStackOutput) instead of exports: no stack is pinned by an
        # import; the README says when a deploy needs --force because of them.
        assert all("Export" not in o for o in stack.template.get("Outputs", {}).values())
        assert "Fn::ImportValue" not in json.dumps(stack.template)


def test_the_readmes_teardown_destroys_each_stack_before_the_stacks_it_reads_from(synth):
    # Every stack there is: the optional batch and slurm stacks included.
    example = synth({**VARIANTS["batch"], "slurm": VARIANTS["slurm"]["slurm"]})
    stacks = {s.stack_name: s for s in example.assembly.stacks}
    order = [s.stack_name for s in example.platform.teardown]
    for i, name in enumerate(order):
        readers = {s for s, artifact in stacks.items() if name in {d.id for d in artifact.dependencies}}
        assert readers <= set(order[:i]), f"{name} is destroyed before {readers - set(order[:i])}, which read it"
    readme = (REPO / "README.md").read_text()
    teardown = readme[readme.index("## Teardown"):readme.index("## Troubleshooting")]
    destroyed = re.findall(r"cdk destroy <name_prefix>-(\w+)", teardown)
    assert [f"mltrain-{d}" for d in destroyed] == order
