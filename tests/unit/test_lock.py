"""The lock installs on any machine: registry pins only, produced the same way by `make lock`."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

REQUIREMENT_FILES = ["requirements.txt", "requirements-dev.txt", "training/requirements.txt", "constraints.txt"]
PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?==[A-Za-z0-9.+!-]+$")
INCLUDE = re.compile(r"^-[rc] (?!/)[\w./-]+\.txt$")


def portable_problems(text: str) -> list[str]:
    """Lines that would not install from the package registry on another machine."""
    problems = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if "://" in line or "@" in line or line.startswith(("/", "file:", "./", "../")) or not (
                PIN.match(line) or INCLUDE.match(line)):
            problems.append(f"line {number}: {raw}")
    return problems


@pytest.mark.parametrize("path", REQUIREMENT_FILES)
def test_every_requirement_and_lock_line_is_a_registry_pin(path):
    assert portable_problems((REPO / path).read_text()) == []


@pytest.mark.parametrize("line", [
    "aws-cdk.lambda-layer-kubectl-v31 @ file:///tmp/pp3/aws_cdk_lambda_layer_kubectl_v31-2.1.0-py3-none-any.whl",
    "torch @ https://download.pytorch.org/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl",
    "/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
    "file:../wheels/x.whl",
    "-r /etc/requirements.txt",
    "boto3>=1.40",
    "git+https://github.com/org/repo",
])
def test_a_path_url_or_range_is_caught(line):
    assert portable_problems(f"# lock\nboto3==1.44.5\n{line}\n") == [f"line 3: {line}"]


def test_every_pinned_requirement_is_in_the_lock_at_the_same_version():
    lock = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
                if PIN.match(line))
    lock = {name.lower().replace("_", "-"): version for name, version in lock.items()}
    for path in REQUIREMENT_FILES[:3]:
        for line in (REPO / path).read_text().splitlines():
            if PIN.match(line.strip()):
                name, version = line.strip().split("==")
                name = re.sub(r"\[.*\]", "", name).lower().replace("_", "-")
                if name != "torch":  # left to training/requirements.txt: its build tag depends on the machine
                    assert lock.get(name) == version, f"{path}: {line}"


def test_make_lock_writes_name_equals_version_even_for_a_package_installed_from_a_local_wheel(tmp_path):
    # The recipe make lock runs, against a venv holding a wheel installed from a local path.
    recipe = next(line for line in (REPO / "Makefile").read_text().splitlines()
                  if line.startswith("\t") and "pip list --format=freeze" in line)
    assert "pip freeze" not in recipe
    venv = tmp_path / "venv"
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    dist = site / "localpkg-1.2.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: localpkg\nVersion: 1.2.3\n")
    (dist / "INSTALLER").write_text("pip\n")
    (dist / "direct_url.json").write_text('{"url": "file:///tmp/pp3/localpkg-1.2.3-py3-none-any.whl", "archive_info": {}}')
    (dist / "RECORD").write_text("")
    frozen = subprocess.run(["python3", "-m", "pip", "--python", str(venv / "bin" / "python"), "freeze"],
                            capture_output=True, text=True, check=True).stdout
    listed = subprocess.run(["python3", "-m", "pip", "--python", str(venv / "bin" / "python"), "list",
                             "--format=freeze"], capture_output=True, text=True, check=True).stdout
    assert "localpkg @ file:///tmp/pp3/" in frozen  # what the old recipe wrote
    assert listed.strip() == "localpkg==1.2.3" and portable_problems(listed) == []


def test_ci_installs_the_lock_from_the_registry_alone_with_the_cache_off():
    makefile = (REPO / "Makefile").read_text()
    registry_only = re.search(r"^REGISTRY_ONLY := (.+)$", makefile, re.M).group(1)
    for part in ("-u PIP_FIND_LINKS", "-u PIP_EXTRA_INDEX_URL", "PIP_CONFIG_FILE=/dev/null", "PIP_NO_CACHE_DIR=1"):
        assert part in registry_only
    assert "ifeq ($(CI),true)" in makefile
    installs = [line for line in makefile.splitlines() if "pip install" in line and "-c constraints.txt" in line]
    assert installs and all(line.strip().startswith("$(REGISTRY_ONLY)") for line in installs)
    assert Path(REPO / ".ci" / "run").read_text().strip().endswith("exec make test")
