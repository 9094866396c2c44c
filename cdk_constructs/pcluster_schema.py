"""The slurm stack's ClusterConfiguration against ParallelCluster's own schema, at synth, offline.

ParallelCluster's wheel pins aws-cdk v1 and jsii, which the CDK app cannot share a venv with, so
its schema runs in .venv-pcluster (requirements-pcluster.txt, made by ``make synth`` and ``make
test``) as a subprocess: cdk_constructs/pcluster_check.py. That process gets no credentials, no
config or credentials file, no instance metadata, and refuses every botocore call itself.

What it checks: ``ClusterSchema.load``, the structure (unknown or missing keys, types) and the
values the schema itself constrains (names, enums, ranges, regexes). What it leaves to deploy:
the validators ParallelCluster runs after loading (``Cluster.validate``), most of which ask AWS
(docs/slurm.md lists them).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from config.versions import PARALLELCLUSTER_VERSION

REPO = Path(__file__).resolve().parent.parent
PCLUSTER_PYTHON = REPO / ".venv-pcluster" / "bin" / "python"
CHECK_SCRIPT = Path(__file__).with_name("pcluster_check.py")
# The one botocore call ClusterSchema.load makes and catches itself: a cache for validators
# (pcluster/config/cluster_config.py, SlurmClusterConfig.__init__, aws-parallelcluster 3.16.1).
# The check refused it; any other call is a ParallelCluster change this module must look at.
EXPECTED_REFUSED_CALLS = {"ec2.DescribeCapacityReservations"}

_checked: set[str] = set()  # configurations already found valid in this process (tests synthesize many)


class ClusterConfigurationRefused(ValueError):
    """ParallelCluster's schema refused the generated configuration."""


def offline_environment(region: str) -> dict[str, str]:
    """The check's whole environment: a region (ParallelCluster reads it while loading), nothing to sign with."""
    return {
        "PATH": os.defpath,
        "AWS_DEFAULT_REGION": region,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "HOME": os.devnull,
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def run_check(args: list[str], region: str, stdin: str = "") -> subprocess.CompletedProcess:
    if not PCLUSTER_PYTHON.exists():
        raise RuntimeError(f"{PCLUSTER_PYTHON.relative_to(REPO)} is missing: the slurm stack's configuration is "
                           "checked with ParallelCluster's schema there; run make setup-deploy")
    return subprocess.run([str(PCLUSTER_PYTHON), str(CHECK_SCRIPT), *args], input=stdin, capture_output=True,
                          text=True, env=offline_environment(region), cwd=REPO, check=False)


def check_cluster_configuration(configuration: dict, cluster_name: str, region: str) -> None:
    """Raise ClusterConfigurationRefused unless ParallelCluster's schema loads ``configuration``.

    ``configuration`` must hold no CDK token: the caller substitutes placeholders first.
    """
    key = json.dumps([configuration, cluster_name, region], sort_keys=True)
    if key in _checked:
        return
    done = run_check([cluster_name], region, stdin=json.dumps(configuration))
    if done.returncode != 0:
        detail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ClusterConfigurationRefused(
            f"ParallelCluster {PARALLELCLUSTER_VERSION}'s schema refuses the slurm stack's ClusterConfiguration: {detail}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if report["version"] != PARALLELCLUSTER_VERSION:
        raise RuntimeError(f".venv-pcluster has aws-parallelcluster {report['version']}, config/versions.py pins "
                           f"{PARALLELCLUSTER_VERSION}: run make setup-deploy")
    unexpected = set(report["aws_calls"]) - EXPECTED_REFUSED_CALLS
    if unexpected:
        raise RuntimeError(f"ParallelCluster's schema tried AWS calls the offline check does not expect: "
                           f"{', '.join(sorted(unexpected))}")
    _checked.add(key)
