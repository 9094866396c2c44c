"""The instance catalog: the one source of truth for hardware facts.

Launch templates (EFA interfaces), pod requests (accelerators, EFA devices), node
labels/taints and torchrun's ``--nproc-per-node`` all read from here. Figures follow
EC2's DescribeInstanceTypes data and the AWS Neuron documentation.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# The node labels and taints are the contract's (the deploy side reads them from here too):
# re-exported, so imported as themselves (``X as X``).
from training.contract import (
    ACCELERATED_ROLE as ACCELERATED_ROLE, ACCELERATOR_LABEL as ACCELERATOR_LABEL, ACCELERATOR_TAINTS,
    NODE_GROUP_LABEL as NODE_GROUP_LABEL, NODE_ROLE_LABEL as NODE_ROLE_LABEL, SYSTEM_ROLE as SYSTEM_ROLE,
)


class Accelerator(str, Enum):
    NONE = "none"
    NVIDIA = "nvidia"
    NEURON = "neuron"


# EKS managed node group AMI types (CloudFormation `AmiType` values).
AMI_STANDARD = "AL2023_x86_64_STANDARD"
AMI_NVIDIA = "AL2023_x86_64_NVIDIA"
AMI_NEURON = "AL2023_x86_64_NEURON"

NVIDIA_GPU_RESOURCE = "nvidia.com/gpu"
NEURON_DEVICE_RESOURCE = "aws.amazon.com/neuron"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
EFA_PRESENT_LABEL = "vpc.amazonaws.com/efa.present"  # the EFA device plugin selects on it
# cluster-autoscaler treats a node with this label as a GPU node whose nvidia.com/gpu is not
# advertised yet (device plugin starting), instead of as a node without GPUs that does not fit
# the pending pod and needs another node (cluster-autoscaler cloudprovider/aws/README.md, GPU
# node groups; aws_cloud_provider.go GPULabel, tag cluster-autoscaler-1.34.2).
GPU_TYPE_LABEL = "k8s.amazonaws.com/accelerator"

_AMI_BY_ACCELERATOR = {
    Accelerator.NONE: AMI_STANDARD,
    Accelerator.NVIDIA: AMI_NVIDIA,
    Accelerator.NEURON: AMI_NEURON,
}
_RESOURCE_BY_ACCELERATOR = {
    Accelerator.NONE: None,
    Accelerator.NVIDIA: NVIDIA_GPU_RESOURCE,
    Accelerator.NEURON: NEURON_DEVICE_RESOURCE,
}
# The taint each accelerated node group carries (the contract's); device plugins and jobs tolerate it.
_TAINT_KEY_BY_ACCELERATOR = {
    Accelerator.NONE: None,
    Accelerator.NVIDIA: ACCELERATOR_TAINTS[Accelerator.NVIDIA.value],
    Accelerator.NEURON: ACCELERATOR_TAINTS[Accelerator.NEURON.value],
}


@dataclass(frozen=True)
class InstanceType:
    """Hardware facts for one EC2 instance type."""

    name: str
    accelerator: Accelerator
    accelerator_model: str | None
    accelerator_count: int
    accelerator_memory_gib: int
    vcpus: int
    memory_gib: int
    efa_interfaces: int
    nproc_per_node: int
    # Network cards after the first take EFA-only interfaces (no ENA, no IP address): EC2's
    # layout for these types (EC2 User Guide, "Maximize network bandwidth ... multiple network
    # cards"). Each saves one subnet address per card and node.
    efa_only_secondary: bool = False
    # Sold as EC2 Capacity Blocks for ML (nodegroup capacity type CAPACITY_BLOCK).
    capacity_blocks: bool = False
    # EFA reads and writes the accelerators' memory directly (RDMA read/write: libfabric's
    # FI_EFA_USE_DEVICE_RDMA): A100, H100 and H200 GPUs, Trainium and Trainium2. A fact of the
    # accelerator, so a type without EFA interfaces may carry it; it matters only where EFA is on.
    efa_rdma: bool = False
    # Each vCPU is one hardware thread of a core (EC2 User Guide, "CPU options"); every type here
    # runs two per core by default (DescribeInstanceTypes VCpuInfo.DefaultThreadsPerCore). So a
    # p4d's 12 vCPUs per A100 are 6 cores, which matters for CPU-bound work such as JPEG decoding.
    threads_per_core: int = 2
    # How many network nodes EC2's DescribeInstanceTopology lists above an instance of this type, top
    # down (0: the API reports none for it). EKS labels each node with one
    # topology.k8s.aws/network-node-layer-<N> per layer (training.contract.network_node_label), and
    # the platform's HyperNode discovery reads them (k8s_charts/volcano.py). From the EC2 User Guide,
    # "Amazon EC2 instance topology", prerequisites: 3 network nodes for p3dn.24xlarge, p4d, p4de, p5,
    # p5e, p5en, g6e, trn1.2xlarge, trn1.32xlarge, trn1n.32xlarge and trn2.48xlarge (4 for p6-b200 and
    # p6-b300, not in this catalog); p3.8xlarge, g5 and the CPU types are not listed.
    network_layers: int = 0

    @property
    def cores(self) -> int:
        return self.vcpus // self.threads_per_core

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def is_accelerated(self) -> bool:
        return self.accelerator is not Accelerator.NONE

    @property
    def supports_efa(self) -> bool:
        return self.efa_interfaces > 0

    @property
    def ami_type(self) -> str:
        return _AMI_BY_ACCELERATOR[self.accelerator]

    @property
    def accelerator_resource(self) -> str | None:
        """The Kubernetes extended resource a pod requests for this type's accelerators."""
        return _RESOURCE_BY_ACCELERATOR[self.accelerator]

    @property
    def taint_key(self) -> str | None:
        return _TAINT_KEY_BY_ACCELERATOR[self.accelerator]

    @property
    def efa_resource(self) -> str | None:
        return EFA_RESOURCE if self.supports_efa else None

    @property
    def gpu_type(self) -> str | None:
        """The value of ``k8s.amazonaws.com/accelerator`` on NVIDIA nodes, e.g. ``nvidia-a100``."""
        if self.accelerator is not Accelerator.NVIDIA:
            return None
        return f"nvidia-{self.accelerator_model.lower()}"


def _gpu(name, model, count, mem_gib, vcpus, memory_gib, efa, efa_only=False, blocks=False, rdma=False, layers=0):
    return InstanceType(name, Accelerator.NVIDIA, model, count, mem_gib, vcpus, memory_gib, efa, count,
                        efa_only_secondary=efa_only, capacity_blocks=blocks, efa_rdma=rdma, network_layers=layers)


def _neuron(name, model, devices, mem_gib, vcpus, memory_gib, efa, cores_per_device, efa_only=False, blocks=False,
            layers=0):
    # torchrun starts one process per (logical) NeuronCore. Every Trainium generation takes EFA RDMA.
    return InstanceType(
        name, Accelerator.NEURON, model, devices, mem_gib, vcpus, memory_gib, efa, devices * cores_per_device,
        efa_only_secondary=efa_only, capacity_blocks=blocks, efa_rdma=True, network_layers=layers,
    )


def _cpu(name, vcpus, memory_gib):
    return InstanceType(name, Accelerator.NONE, None, 0, 0, vcpus, memory_gib, 0, 1)


CATALOG: dict[str, InstanceType] = {
    t.name: t
    for t in (
        _gpu("p3.8xlarge", "V100", 4, 16, 32, 244, efa=0),
        _gpu("p3dn.24xlarge", "V100", 8, 32, 96, 768, efa=1, layers=3),
        _gpu("p4d.24xlarge", "A100", 8, 40, 96, 1152, efa=4, blocks=True, rdma=True, layers=3),
        _gpu("p4de.24xlarge", "A100", 8, 80, 96, 1152, efa=4, rdma=True, layers=3),
        _gpu("p5.48xlarge", "H100", 8, 80, 192, 2048, efa=32, efa_only=True, blocks=True, rdma=True, layers=3),
        _gpu("p5e.48xlarge", "H200", 8, 141, 192, 2048, efa=32, efa_only=True, blocks=True, rdma=True, layers=3),
        _gpu("p5en.48xlarge", "H200", 8, 141, 192, 2048, efa=16, efa_only=True, blocks=True, rdma=True, layers=3),
        _gpu("g5.xlarge", "A10G", 1, 24, 4, 16, efa=0),
        _gpu("g5.12xlarge", "A10G", 4, 24, 48, 192, efa=1),
        _gpu("g5.48xlarge", "A10G", 8, 24, 192, 768, efa=1),
        _gpu("g6e.48xlarge", "L40S", 8, 48, 192, 1536, efa=4, layers=3),
        # Trainium: 2 NeuronCore-v2 per device.
        _neuron("trn1.2xlarge", "Trainium", 1, 32, 8, 32, efa=0, cores_per_device=2, layers=3),
        _neuron("trn1.32xlarge", "Trainium", 16, 32, 128, 512, efa=8, cores_per_device=2, blocks=True, layers=3),
        _neuron("trn1n.32xlarge", "Trainium", 16, 32, 128, 512, efa=16, cores_per_device=2, layers=3),
        # Trainium2: 8 physical cores per device, 4 logical cores at the default LNC=2.
        _neuron("trn2.48xlarge", "Trainium2", 16, 96, 192, 2048, efa=16, cores_per_device=4, efa_only=True,
                blocks=True, layers=3),
        _cpu("c5.2xlarge", 8, 16),
        _cpu("c5.4xlarge", 16, 32),
        _cpu("m5.2xlarge", 8, 32),
        _cpu("m5.4xlarge", 16, 64),
        _cpu("m6i.2xlarge", 8, 32),
        _cpu("m7i.2xlarge", 8, 32),
    )
}


# The deepest topology of the catalog: the network-node layers the platform's HyperNode discovery
# reads (k8s_charts/volcano.py), and so the highest tier a job may ask for.
NETWORK_LAYERS = max(t.network_layers for t in CATALOG.values())


def accelerated_types() -> list[str]:
    return sorted(n for n, t in CATALOG.items() if t.is_accelerated)


def cpu_types() -> list[str]:
    return sorted(n for n, t in CATALOG.items() if not t.is_accelerated)


def lookup(name: str) -> InstanceType:
    """Return the catalog entry for ``name``; KeyError names the supported types."""
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"{name!r} is not in the instance catalog; supported: {', '.join(sorted(CATALOG))}") from None
