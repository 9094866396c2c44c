"""checkov 3.3 on the synthesized templates and the rendered manifests: nothing fails.

Every finding is fixed or skipped in place with its one-line reason: Kubernetes objects carry
``checkov.io/skipN: <check>=<reason>`` annotations (k8s_charts/objects.py), CloudFormation
resources a ``checkov`` Metadata entry (cdk_constructs/checkov.py). checkov pins libraries the
project's lock cannot hold (boto3 1.35, packaging<24), so ``make test`` installs it into a venv
of its own from requirements-checkov.txt, and it runs here as a subprocess, offline.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from k8s_charts.job_charts import VOLCANO_LAYOUT_SKIPS
from tests.conftest import REPO, VARIANTS
from tests.unit.test_charts import RENDERED

CHECKOV = Path(os.environ.get("CHECKOV", REPO / ".venv-checkov" / "bin" / "checkov"))
# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = [pytest.mark.untimed, pytest.mark.timeout(300)]


def checkov(directory: Path, framework: str) -> dict:
    assert CHECKOV.exists(), f"no checkov at {CHECKOV}: make test installs it (requirements-checkov.txt)"
    # --skip-download: no call to Prisma Cloud's API. No --quiet: the report keeps the skipped checks.
    done = subprocess.run([str(CHECKOV), "-d", str(directory), "--framework", framework, "-o", "json", "--compact",
                           "--skip-download"], capture_output=True, text=True, timeout=280, cwd=directory,
                          env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    assert done.returncode in (0, 1), done.stderr[-2000:]  # 1: a check failed; 2: checkov itself did
    report = json.loads(done.stdout)
    assert report["summary"]["parsing_errors"] == 0
    assert report["summary"]["resource_count"] > 0  # checkov drops a file it cannot read, silently
    return report


def failures(report: dict) -> list[str]:
    return sorted(f"{c['check_id']} {c['resource']} ({c['check_name']})" for c in report["results"]["failed_checks"])


def skips_without_reason(report: dict) -> list[str]:
    return [f"{c['check_id']} {c['resource']}" for c in report["results"]["skipped_checks"]
            if not (c.get("check_result", {}).get("suppress_comment") or "").strip()]


def volcano_jobs_as_pods(objects: list[dict]) -> list[dict]:
    """checkov reads a Job's pods at spec.template; a Volcano Job keeps them at spec.tasks[].template.
    Each task's pod is scanned as a Pod with the Job's metadata and its skip annotations, less the
    skips that exist only because of that layout: here the pod must pass those checks itself."""
    out = []
    for o in objects:
        if o["apiVersion"].startswith("batch.volcano.sh/") and o["kind"] == "Job":
            skips = {k: v for k, v in o["metadata"].get("annotations", {}).items()
                     if v.split("=", 1)[0] not in VOLCANO_LAYOUT_SKIPS}
            for task in o["spec"]["tasks"]:
                template = task["template"].get("metadata", {})
                metadata = {**o["metadata"], "name": f"{o['metadata']['name']}-{task['name']}",
                            "annotations": {**template.get("annotations", {}), **skips}}
                out.append({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": task["template"]["spec"]})
        else:
            out.append(o)
    return out


def test_the_rendered_manifests_pass_every_check(tmp_path):
    for name, objects in RENDERED.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(volcano_jobs_as_pods(objects), sort_keys=False))
    report = checkov(tmp_path, "kubernetes")
    assert failures(report) == []
    assert report["summary"]["skipped"] > 0 and skips_without_reason(report) == []
    assert report["summary"]["passed"] > 300


def test_the_manifests_as_users_scan_them_pass_every_check(tmp_path):
    """``checkov -d dist``, as a security review runs it: clean too."""
    for name, objects in RENDERED.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
    assert failures(checkov(tmp_path, "kubernetes")) == []


@pytest.mark.parametrize("variant", ["example", "every-family", "slurm"])
def test_the_templates_pass_every_check(synth, tmp_path, variant):
    for stack, path in synth(VARIANTS[variant]).template_files().items():
        (tmp_path / f"{stack}.template.json").write_text(path.read_text())
    report = checkov(tmp_path, "cloudformation")
    assert failures(report) == []
    assert report["summary"]["skipped"] > 0 and skips_without_reason(report) == []
    assert report["summary"]["passed"] > 200
