"""The instance catalog against the facts table in docs/DESIGN.md, "Instance facts" (EC2 and Neuron data), and against
EC2's own DescribeInstanceTypes records as moto ships them."""

from __future__ import annotations

import boto3
import pytest
from moto import mock_aws

from cdk_constructs.network import RETENTION_BY_DAYS
from config.catalog import (
    AMI_NEURON,
    AMI_NVIDIA,
    AMI_STANDARD,
    CATALOG,
    EFA_RESOURCE,
    NEURON_DEVICE_RESOURCE,
    NETWORK_LAYERS,
    NVIDIA_GPU_RESOURCE,
    Accelerator,
    lookup,
)
from config.fields import LOG_RETENTION_DAYS

# name: (accelerator count, EFA interfaces, nproc per node)
DESIGN_TABLE = {
    "p3.8xlarge": (4, 0, 4),
    "p3dn.24xlarge": (8, 1, 8),
    "p4d.24xlarge": (8, 4, 8),
    "p4de.24xlarge": (8, 4, 8),
    "p5.48xlarge": (8, 32, 8),
    "p5e.48xlarge": (8, 32, 8),
    "p5en.48xlarge": (8, 16, 8),
    "trn1.2xlarge": (1, 0, 2),
    "trn1.32xlarge": (16, 8, 32),
    "trn1n.32xlarge": (16, 16, 32),
    "trn2.48xlarge": (16, 16, 64),  # 64 logical NeuronCores at the default LNC=2
    "c5.2xlarge": (0, 0, 1),
}


@pytest.mark.parametrize("name", sorted(DESIGN_TABLE))
def test_design_table_facts(name):
    accelerators, efa, nproc = DESIGN_TABLE[name]
    t = lookup(name)
    assert (t.accelerator_count, t.efa_interfaces, t.nproc_per_node) == (accelerators, efa, nproc)


@pytest.mark.parametrize(
    ("name", "ami", "resource", "taint"),
    [
        ("p4d.24xlarge", AMI_NVIDIA, NVIDIA_GPU_RESOURCE, NVIDIA_GPU_RESOURCE),
        ("p3.8xlarge", AMI_NVIDIA, NVIDIA_GPU_RESOURCE, NVIDIA_GPU_RESOURCE),
        ("trn1.32xlarge", AMI_NEURON, NEURON_DEVICE_RESOURCE, NEURON_DEVICE_RESOURCE),
        ("trn2.48xlarge", AMI_NEURON, NEURON_DEVICE_RESOURCE, NEURON_DEVICE_RESOURCE),
        ("c5.2xlarge", AMI_STANDARD, None, None),
    ],
)
def test_ami_type_and_kubernetes_resource(name, ami, resource, taint):
    t = lookup(name)
    assert (t.ami_type, t.accelerator_resource, t.taint_key) == (ami, resource, taint)


def test_efa_resource_only_where_efa_exists():
    assert lookup("p5.48xlarge").efa_resource == EFA_RESOURCE
    assert lookup("p3.8xlarge").efa_resource is None
    assert lookup("trn1.2xlarge").efa_resource is None


# Types whose EFA reads and writes accelerator memory directly (FI_EFA_USE_DEVICE_RDMA on their pods).
EFA_RDMA = {"p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge",
            "trn1.2xlarge", "trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge"}


# Types EC2's DescribeInstanceTopology lists three network nodes above (EC2 User Guide, "Amazon EC2
# instance topology", prerequisites); p3.8xlarge, g5 and the CPU types are not listed.
NETWORK_TOPOLOGY = {"p3dn.24xlarge", "p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge",
                    "g6e.48xlarge", "trn1.2xlarge", "trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge"}


def test_network_layers_are_ec2s_and_every_type_has_all_of_them_or_none():
    assert {name for name, t in CATALOG.items() if t.network_layers} == NETWORK_TOPOLOGY
    # Volcano's label discovery leaves a node out of every tier from its first missing label up
    # (pkg/controllers/hypernode/discovery/label/label.go generateHyperNodeInfo, v1.15.1): a type with
    # fewer layers than the discovery lists would be in no HyperNode at all.
    assert {t.network_layers for t in CATALOG.values()} == {0, NETWORK_LAYERS} and NETWORK_LAYERS == 3


def test_efa_rdma_is_a_fact_of_the_known_instances():
    assert {name for name, t in CATALOG.items() if t.efa_rdma} == EFA_RDMA
    assert lookup("p4d.24xlarge").efa_rdma and lookup("p5.48xlarge").efa_rdma
    assert not lookup("p3dn.24xlarge").efa_rdma and not lookup("g6e.48xlarge").efa_rdma  # EFA, but not to the GPU
    # The accelerators the job charts once listed by name (A100, H100, H200, Trainium, Trainium2).
    assert all(t.efa_rdma == (t.accelerator_model in ("A100", "H100", "H200", "Trainium", "Trainium2"))
               for t in CATALOG.values())


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_entries_are_self_consistent(name):
    t = CATALOG[name]
    assert t.vcpus > 0 and t.memory_gib > 0
    if t.accelerator is Accelerator.NONE:
        assert (t.accelerator_count, t.accelerator_memory_gib, t.efa_interfaces) == (0, 0, 0)
    else:
        assert t.accelerator_count > 0 and t.accelerator_memory_gib > 0 and t.accelerator_model
        # NVIDIA: one process per GPU; Neuron: one per NeuronCore, a whole number per device.
        assert t.nproc_per_node % t.accelerator_count == 0


def test_unknown_type_lists_the_supported_ones():
    with pytest.raises(KeyError) as caught:
        lookup("p9.huge")
    assert "'p9.huge' is not in the instance catalog; supported: c5.2xlarge," in str(caught.value)


def test_log_retention_choices_match_cdk():
    assert tuple(RETENTION_BY_DAYS) == LOG_RETENTION_DAYS


@pytest.fixture(scope="module")
def described_by_ec2() -> dict[str, dict]:
    """EC2's DescribeInstanceTypes answer for every catalog type that moto's copy of it holds."""
    with mock_aws():
        # Filtered by name, as EC2 itself takes it: moto then answers in a tenth of a second, not six.
        pages = boto3.client("ec2", region_name="us-west-2").get_paginator("describe_instance_types").paginate(
            Filters=[{"Name": "instance-type", "Values": list(CATALOG)}])
        return {t["InstanceType"]: t for page in pages for t in page["InstanceTypes"]}


def test_the_catalog_agrees_with_ec2(described_by_ec2):
    # moto's copy of the records lacks p3.8xlarge (still sold); every other type is compared.
    assert set(CATALOG) - set(described_by_ec2) <= {"p3.8xlarge"}
    disagreements = []
    for name, record in sorted(described_by_ec2.items()):
        t = CATALOG[name]
        devices = record.get("GpuInfo", {}).get("Gpus") or record.get("NeuronInfo", {}).get("NeuronDevices") or []
        network = record["NetworkInfo"]
        ours = (t.vcpus, t.threads_per_core, t.memory_gib * 1024, t.accelerator_count, t.accelerator_model,
                t.efa_interfaces)
        theirs = (record["VCpuInfo"]["DefaultVCpus"], record["VCpuInfo"]["DefaultThreadsPerCore"],
                  record["MemoryInfo"]["SizeInMiB"], sum(d["Count"] for d in devices),
                  devices[0]["Name"] if devices else None,
                  network["EfaInfo"]["MaximumEfaInterfaces"] if network.get("EfaSupported") else 0)
        if ours != theirs:
            disagreements.append(f"{name}: catalog {ours}, EC2 {theirs}")
    assert not disagreements, "(vCPUs, threads per core, MiB, accelerators, model, EFA)\n" + "\n".join(disagreements)


def test_a_p4d_share_of_cpus_is_six_cores():
    # The throughput benchmark confines its input pipeline to this share.
    p4d = lookup("p4d.24xlarge")
    assert (p4d.vcpus // p4d.accelerator_count, p4d.cores // p4d.accelerator_count) == (12, 6)
