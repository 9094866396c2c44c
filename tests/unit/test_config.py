"""Every config rule: the bad input and the one line the user sees."""

from __future__ import annotations

import pytest

from config import ConfigError, load_config, parse_config
from config.catalog import CATALOG
from config.fields import LOG_RETENTION_DAYS
from config.storage import FsxDeploymentType
from tests.conftest import EXAMPLE, REPO, config_variant

ALL_ACCELERATED = (
    "g5.12xlarge, g5.48xlarge, g5.xlarge, g6e.48xlarge, p3.8xlarge, p3dn.24xlarge, p4d.24xlarge, "
    "p4de.24xlarge, p5.48xlarge, p5e.48xlarge, p5en.48xlarge, trn1.2xlarge, trn1.32xlarge, "
    "trn1n.32xlarge, trn2.48xlarge"
)


def problems(data) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "cfg.yaml")
    return caught.value.problems


def test_example_config_is_valid():
    config = load_config(EXAMPLE)
    assert [g.instance_type for g in config.accelerated_node_groups] == ["p4d.24xlarge", "trn1.32xlarge"]
    assert config.fsx.deployment_type is FsxDeploymentType.PERSISTENT_2


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        pytest.param(
            {"colour": "blue"},
            "colour: unknown key; allowed keys here: accelerated_node_groups, account, batch, bucket, cluster, compute_az, "
            "control_plane_az, ecr, fsx, jobs, monitoring, name_prefix, network, pipeline, region, slurm, system_node_group, "
            "tags, versions",
            id="unknown-top-level-key",
        ),
        pytest.param(
            {"fsx.capacity": 1200},
            "fsx.capacity: unknown key; allowed keys here: automatic_backup_retention_days, checkpoint_prefix, "
            "compression, data_prefix, deployment_type, log_retention_days, retain_on_delete, storage_capacity_gib, "
            "throughput_per_tib",
            id="unknown-nested-key",
        ),
        pytest.param(
            {"accelerated_node_groups.0.spot": True},
            "accelerated_node_groups[0].spot: unknown key; allowed keys here: capacity_reservation, capacity_type, "
            "desired_size, efa, instance_type, max_size, min_size, name, node_auto_repair, placement_group",
            id="unknown-node-group-key",
        ),
        pytest.param(
            {"accelerated_node_groups.0.instance_type": "p3.8xlarge"},
            "accelerated_node_groups[0].efa: got true (p3.8xlarge has no EFA interfaces); allowed: false for this type",
            id="efa-on-p3.8xlarge",
        ),
        pytest.param(
            {"accelerated_node_groups.1.instance_type": "trn1.2xlarge"},
            "accelerated_node_groups[1].efa: got true (trn1.2xlarge has no EFA interfaces); allowed: false for this type",
            id="efa-on-trn1.2xlarge",
        ),
        pytest.param(
            {"fsx.storage_capacity_gib": 3600},
            "fsx.storage_capacity_gib: got 3600; allowed: 1200, 2400 or a multiple of 2400 (4800, 7200, ...)",
            id="fsx-capacity-not-a-step",
        ),
        pytest.param(
            {"fsx.storage_capacity_gib": 1000},
            "fsx.storage_capacity_gib: got 1000; allowed: 1200, 2400 or a multiple of 2400 (4800, 7200, ...)",
            id="fsx-capacity-too-small",
        ),
        pytest.param(
            {"fsx.throughput_per_tib": 200},
            "fsx.throughput_per_tib: got 200; allowed: 125, 250, 500, 1000 for PERSISTENT_2",
            id="throughput-not-allowed-for-persistent-2",
        ),
        pytest.param(
            {"fsx.deployment_type": "SCRATCH_2"},
            "fsx.throughput_per_tib: got 250; allowed: null (omit it) for SCRATCH_2",
            id="throughput-on-scratch-2",
        ),
        pytest.param(
            {"fsx.deployment_type": "PERSISTENT_1"},
            "fsx.deployment_type: got \"PERSISTENT_1\"; allowed: 'PERSISTENT_2' or 'SCRATCH_2'",
            id="unknown-deployment-type",
        ),
        pytest.param(
            {"compute_az": "eu-west-1a"},
            "compute_az: got \"eu-west-1a\" (not in region us-west-2); allowed: an Availability Zone of us-west-2, "
            "e.g. us-west-2a",
            id="compute-az-outside-region",
        ),
        pytest.param(
            {"control_plane_az": "us-east-1b"},
            "control_plane_az: got \"us-east-1b\" (not in region us-west-2); allowed: an Availability Zone of "
            "us-west-2, e.g. us-west-2a",
            id="second-az-outside-region",
        ),
        pytest.param(
            {"control_plane_az": "us-west-2a"},
            "control_plane_az: got \"us-west-2a\"; allowed: a second AZ, different from compute_az (EKS needs two)",
            id="second-az-same-as-compute",
        ),
        pytest.param(
            {"accelerated_node_groups.0.min_size": 2, "accelerated_node_groups.0.desired_size": 1},
            "accelerated_node_groups[0].min_size: got 2 (min_size exceeds desired_size); allowed: at most "
            "desired_size (1)",
            id="min-greater-than-desired",
        ),
        pytest.param(
            {"accelerated_node_groups.0.desired_size": 5},
            "accelerated_node_groups[0].desired_size: got 5 (desired_size exceeds max_size); allowed: at most "
            "max_size (4)",
            id="desired-greater-than-max",
        ),
        pytest.param(
            {"system_node_group.min_size": 4},
            "system_node_group.min_size: got 4 (min_size exceeds desired_size); allowed: at most desired_size (3)",
            id="system-min-greater-than-desired",
        ),
        pytest.param(
            {"system_node_group.min_size": 2, "system_node_group.desired_size": 2},
            "system_node_group.min_size: got 2 (etcd's 3 members each need a system node of their own); allowed: at least 3",
            id="system-too-small-for-etcds-three-members",
        ),
        pytest.param(
            {"accelerated_node_groups.1.name": "p4d"},
            "accelerated_node_groups[1].name: got \"p4d\" (duplicate); allowed: a name not used by another node group",
            id="duplicate-node-group-name",
        ),
        pytest.param(
            {"accelerated_node_groups.0.instance_type": "p6.96xlarge"},
            "accelerated_node_groups[0].instance_type: got \"p6.96xlarge\" (not an accelerated instance type in the "
            f"catalog); allowed: {ALL_ACCELERATED}",
            id="instance-type-not-in-catalog",
        ),
        pytest.param(
            {"system_node_group.instance_type": "p4d.24xlarge"},
            "system_node_group.instance_type: got \"p4d.24xlarge\" (not a CPU instance type in the catalog); "
            "allowed: c5.2xlarge, c5.4xlarge, m5.2xlarge, m5.4xlarge, m6i.2xlarge, m7i.2xlarge",
            id="system-group-on-gpus",
        ),
        pytest.param(
            {"accelerated_node_groups.0.capacity_type": "RESERVED"},
            "accelerated_node_groups[0].capacity_type: got \"RESERVED\"; allowed: 'ON_DEMAND' or 'SPOT'",
            id="capacity-type",
        ),
        pytest.param(
            {"account": "12345"},
            "account: got \"12345\"; allowed: a 12-digit AWS account id, quoted, e.g. '123456789012'",
            id="account-format",
        ),
        pytest.param(
            {"cluster.kubernetes_version": "1.29"},
            "cluster.kubernetes_version: got \"1.29\" (unsupported Kubernetes version); allowed: 1.31, 1.32, 1.33, "
            "1.34, 1.35",
            id="kubernetes-version",
        ),
        pytest.param(
            {"cluster.ami_release_version": "1.35.0-20260101"},
            "cluster.ami_release_version: got \"1.35.0-20260101\" (Kubernetes 1.35 nodes ahead of the control plane); "
            "allowed: a 1.34 or 1.33 release for control plane 1.34, e.g. 1.34.x-YYYYMMDD",
            id="nodes-ahead-of-the-control-plane",
        ),
        pytest.param(
            {"cluster.kubernetes_version": "1.35", "cluster.ami_release_version": "1.33.5-20250920"},
            "cluster.ami_release_version: got \"1.33.5-20250920\" (Kubernetes 1.33 nodes too far behind the control "
            "plane); allowed: a 1.35 or 1.34 release for control plane 1.35, e.g. 1.35.x-YYYYMMDD",
            id="nodes-two-minors-behind",
        ),
        pytest.param(
            {"cluster.ami_release_version": "ami-0123456789abcdef0"},
            "cluster.ami_release_version: got \"ami-0123456789abcdef0\"; allowed: an EKS optimized AMI release "
            "<Kubernetes x.y.z>-<YYYYMMDD>, e.g. 1.34.2-20251120, or leave it out",
            id="ami-release-not-a-release",
        ),
        pytest.param(
            {"cluster.endpoint_access_cidrs": ["0.0.0.0/0", "10.0.0.1/8"]},
            "cluster.endpoint_access_cidrs[1]: got \"10.0.0.1/8\"; allowed: IPv4 networks in CIDR form, "
            "e.g. 203.0.113.0/24",
            id="endpoint-cidr",
        ),
        pytest.param(
            {"versions.etcd_image": "quay.io/coreos/etcd:v3.6.0"},
            "versions.etcd_image: got \"quay.io/coreos/etcd:v3.6.0\"; allowed: an etcd 3.5.x image pinned by tag, "
            "e.g. quay.io/coreos/etcd:v3.5.21",
            id="etcd-without-v2-api",
        ),
        pytest.param(
            {"versions.volcano_chart": "latest"},
            "versions.volcano_chart: got \"latest\"; allowed: an exact version, e.g. 1.2.3",
            id="unpinned-chart",
        ),
        pytest.param(
            {"network.vpc_cidr": "10.0.0.0/8"},
            "network.vpc_cidr: got \"10.0.0.0/8\" (prefix length out of range); allowed: a prefix length from "
            "/16 to /20",
            id="vpc-cidr-size",
        ),
        pytest.param(
            {"network.flow_logs_retention_days": 10},
            "network.flow_logs_retention_days: got 10 (not a CloudWatch Logs retention); allowed: "
            + ", ".join(map(str, LOG_RETENTION_DAYS)),
            id="log-retention",
        ),
        pytest.param(
            {"fsx.deployment_type": "SCRATCH_2", "fsx.throughput_per_tib": None, "fsx.automatic_backup_retention_days": 7},
            "fsx.automatic_backup_retention_days: got 7; allowed: 0 for SCRATCH_2, which has no backups",
            id="backups-on-scratch",
        ),
        pytest.param(
            {"fsx.checkpoint_prefix": "datasets/"},
            "fsx.checkpoint_prefix: got \"datasets/\"; allowed: a prefix that neither contains nor lies inside "
            "data_prefix (datasets/)",
            id="same-prefixes",
        ),
        pytest.param(
            {"fsx.checkpoint_prefix": "datasets/ckpt/"},
            "fsx.checkpoint_prefix: got \"datasets/ckpt/\"; allowed: a prefix that neither contains nor lies inside "
            "data_prefix (datasets/)",
            id="nested-prefixes",
        ),
        pytest.param(
            {"fsx.log_retention_days": 2},
            "fsx.log_retention_days: got 2 (not a CloudWatch Logs retention); allowed: "
            + ", ".join(map(str, LOG_RETENTION_DAYS)),
            id="fsx-log-retention",
        ),
        pytest.param(
            {"bucket.noncurrent_version_retention_days": 0},
            "bucket.noncurrent_version_retention_days: got 0; allowed: greater than or equal to 1",
            id="noncurrent-retention",
        ),
        pytest.param(
            {"name_prefix": "ML_Train"},
            "name_prefix: got \"ML_Train\"; allowed: lowercase letters, digits and '-', starting with a letter, "
            "at most 20 characters",
            id="name-prefix",
        ),
        pytest.param(
            {"accelerated_node_groups": []},
            "accelerated_node_groups: got []; allowed: at least 1 item(s)",
            id="no-accelerated-groups",
        ),
        pytest.param(
            {"system_node_group.max_size": "four"},
            "system_node_group.max_size: got \"four\"; allowed: a valid integer, unable to parse string as an integer",
            id="not-a-number",
        ),
    ],
)
def test_each_mistake_gets_one_clear_line(changes, expected):
    assert problems(config_variant(**changes)) == [expected]


def test_missing_required_key():
    data = config_variant()
    del data["region"]
    assert problems(data) == ["region: required key is missing"]


def test_every_mistake_is_reported_once():
    data = config_variant(
        **{"fsx.storage_capacity_gib": 1000, "compute_az": "eu-west-1a", "accelerated_node_groups.0.max_size": 0}
    )
    lines = problems(data)
    assert len(lines) == 3
    assert [line.split(":")[0] for line in lines] == [
        "compute_az",
        "accelerated_node_groups[0].max_size",
        "fsx.storage_capacity_gib",
    ]


def test_efa_defaults_to_what_the_instance_type_has():
    data = config_variant(**{"accelerated_node_groups.0.instance_type": "p3.8xlarge"})
    del data["accelerated_node_groups"][0]["efa"]
    del data["accelerated_node_groups"][1]["efa"]
    groups = parse_config(data).accelerated_node_groups
    assert [g.efa_enabled for g in groups] == [False, True]


def test_fsx_defaults_follow_the_deployment_type():
    scratch = parse_config(config_variant(fsx={"deployment_type": "SCRATCH_2"})).fsx
    persistent = parse_config(config_variant(fsx={})).fsx
    assert (scratch.throughput_per_tib, scratch.automatic_backup_retention_days) == (None, 0)
    assert (persistent.throughput_per_tib, persistent.automatic_backup_retention_days) == (250, 7)


@pytest.mark.parametrize("capacity", [1200, 2400, 4800, 7200, 24000])
def test_valid_fsx_capacities(capacity):
    assert parse_config(config_variant(**{"fsx.storage_capacity_gib": capacity})).fsx.storage_capacity_gib == capacity


@pytest.mark.parametrize("name", sorted(n for n, t in CATALOG.items() if t.is_accelerated))
def test_every_accelerated_catalog_type_is_accepted(name):
    group = {"name": "g", "instance_type": name, "min_size": 0, "desired_size": 0, "max_size": 1}
    parsed = parse_config(config_variant(accelerated_node_groups=[group])).accelerated_node_groups[0]
    assert parsed.efa_enabled == CATALOG[name].supports_efa


class TestYamlFile:
    def test_duplicate_key_is_an_error_not_a_silent_override(self, tmp_path):
        path = tmp_path / "c.yaml"
        path.write_text(EXAMPLE.read_text() + "\nregion: eu-west-1\n")
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        [line] = caught.value.problems
        assert line.startswith("line ") and "invalid YAML: duplicate key 'region'" in line

    def test_invalid_yaml_names_the_line(self, tmp_path):
        path = tmp_path / "c.yaml"
        path.write_text("name_prefix: x\nregion: [us-west-2\n")
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        [line] = caught.value.problems
        assert line.startswith("line 3, column 1: invalid YAML")

    def test_top_level_must_be_a_mapping(self, tmp_path):
        path = tmp_path / "c.yaml"
        path.write_text("- a\n- b\n")
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        assert caught.value.problems == ['top level: got ["a", "b"]; allowed: a mapping of config keys']

    def test_missing_file(self, tmp_path):
        with pytest.raises(ConfigError) as caught:
            load_config(tmp_path / "nope.yaml")
        assert caught.value.problems == [
            "cannot read the file (No such file or directory); pass an existing YAML file, "
            "e.g. -c config=config/example.yaml"
        ]
        assert str(caught.value).startswith(str(tmp_path / "nope.yaml") + ": ")


@pytest.mark.parametrize("path", sorted((REPO / "config").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_is_valid(path):
    assert load_config(path).name_prefix


def test_nodes_follow_the_control_plane_unless_a_release_holds_them_back():
    assert parse_config(config_variant(**{"cluster.kubernetes_version": "1.35"})).cluster.node_kubernetes_version == "1.35"
    held = parse_config(config_variant(**{"cluster.kubernetes_version": "1.35",
                                          "cluster.ami_release_version": "1.34.4-20260101"})).cluster
    assert (held.kubernetes_version, held.node_kubernetes_version) == ("1.35", "1.34")
