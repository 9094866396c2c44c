"""What the platform installs into the cluster, pinned per Kubernetes minor where it must match.

Every pin here was read at its source (the tag or the published index), so a deploy installs
the same bits in dev and prod, on the first deploy and the tenth:

- cluster-autoscaler must run the minor of the cluster it scales. Each chart ships one
  autoscaler minor (chart ``appVersion``): the newest chart of each minor in the published
  index (kubernetes/autoscaler, gh-pages ``index.yaml``; tags ``cluster-autoscaler-chart-*``).
- EKS add-ons: the versions AWS lists per Kubernetes minor ("Amazon VPC CNI versions",
  "kube-proxy versions", "CoreDNS versions" in the Amazon EKS User Guide). vpc-cni must be
  v1.18.5 or later for EFA-only interfaces (EKS User Guide, node-efa; amazon-vpc-cni-k8s
  CHANGELOG v1.18.5, PR 3047) and v1.19.0 fixes reading their metadata (commit eb7a9bd).
- The add-ons whose versions do not follow the Kubernetes minor (the Pod Identity agent,
  the FSx and EBS CSI drivers, CloudWatch observability) are left to EKS's default for the
  minor unless ``versions.addons`` pins them; ``trainctl preflight`` names the default it
  would get, so a team can pin it.
"""

from __future__ import annotations

# Kubernetes minor -> the range of cluster-autoscaler charts that ship that autoscaler minor,
# from the published chart index (first and last chart of each appVersion minor).
CLUSTER_AUTOSCALER_CHART_RANGES = {
    "1.31": ("9.38.0", "9.44.0"),
    "1.32": ("9.45.0", "9.46.6"),
    "1.33": ("9.47.0", "9.51.0"),
    "1.34": ("9.52.0", "9.53.0"),
    "1.35": ("9.54.0", "9.59.0"),
}
# Kubernetes minor -> the chart installed by default (its appVersion in the comment).
CLUSTER_AUTOSCALER_CHARTS = {
    "1.31": "9.44.0",  # cluster-autoscaler 1.31.0
    "1.32": "9.46.6",  # 1.32.0
    "1.33": "9.51.0",  # 1.33.0
    "1.34": "9.53.0",  # 1.34.2
    "1.35": "9.59.0",  # 1.35.0
}

# Kubernetes minor -> {add-on: version}, the versions the EKS User Guide lists for that minor.
ADDON_VERSIONS: dict[str, dict[str, str]] = {
    "1.31": {"vpc-cni": "v1.21.1-eksbuild.7", "kube-proxy": "v1.31.14-eksbuild.9", "coredns": "v1.11.4-eksbuild.33"},
    "1.32": {"vpc-cni": "v1.21.1-eksbuild.7", "kube-proxy": "v1.32.13-eksbuild.5", "coredns": "v1.11.4-eksbuild.33"},
    "1.33": {"vpc-cni": "v1.21.1-eksbuild.7", "kube-proxy": "v1.33.10-eksbuild.2", "coredns": "v1.13.2-eksbuild.4"},
    "1.34": {"vpc-cni": "v1.21.1-eksbuild.7", "kube-proxy": "v1.34.6-eksbuild.2", "coredns": "v1.13.2-eksbuild.4"},
    "1.35": {"vpc-cni": "v1.21.1-eksbuild.7", "kube-proxy": "v1.35.3-eksbuild.2", "coredns": "v1.13.2-eksbuild.4"},
}
# EFA-only interfaces need at least this vpc-cni (see above).
MIN_VPC_CNI_FOR_EFA_ONLY = (1, 19, 0)

# aws-efa-k8s-device-plugin: the chart's own version and the plugin image it deploys differ.
# Chart v0.5.30 (aws/eks-charts, 2026-07-21) deploys image v0.5.20; chart v0.5.20 deployed v0.5.13.
EFA_DEVICE_PLUGIN_CHART = "v0.5.30"
EFA_DEVICE_PLUGIN_IMAGE = "v0.5.20"


def autoscaler_minor(chart: str) -> str | None:
    """The Kubernetes minor whose autoscaler ``chart`` runs, if the chart is in the published ranges."""
    version = semver(chart)
    for minor, (first, last) in CLUSTER_AUTOSCALER_CHART_RANGES.items():
        if semver(first) <= version <= semver(last):
            return minor
    return None


def addon_version(kubernetes_version: str, addon: str, pinned: dict[str, str]) -> str | None:
    """The version an add-on is created with: the config's pin, else the per-minor table, else EKS's default."""
    return pinned.get(addon) or ADDON_VERSIONS[kubernetes_version].get(addon)


def semver(version: str) -> tuple[int, int, int]:
    """``v1.21.1-eksbuild.7`` -> (1, 21, 1)."""
    core = version.lstrip("v").split("-", 1)[0]
    major, minor, patch = (int(part) for part in core.split("."))
    return major, minor, patch


# AWS ParallelCluster, for the optional slurm stack (stacks/slurm_stack.py): the one pin. It names the
# provider template the stack nests (https://<region>-aws-parallelcluster.s3.<region>.<suffix>/parallelcluster/
# <version>/templates/custom_resource/cluster.yaml, "Provider stack hosted by AWS ParallelCluster" in the
# ParallelCluster User Guide) and the schema requirements-pcluster.txt installs to check the generated
# configuration offline; tests/unit/cdk/test_slurm_stack.py holds the two together. 3.16.1: the newest release on
# PyPI, and the version the provider-stack page of the User Guide shows.
PARALLELCLUSTER_VERSION = "3.16.1"
