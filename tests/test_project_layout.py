"""House rules that keep the two README commands working on a fresh clone."""

from __future__ import annotations

import json
from pathlib import Path
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

PIN = re.compile(r"^[A-Za-z0-9_.-]+(\[[A-Za-z0-9_,.-]+\])?==[A-Za-z0-9_.+-]+$")


def _requirement_lines(name: str) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in (REPO / name).read_text().splitlines())
    return [line for line in lines if line]


@pytest.mark.parametrize("name", ["requirements.txt", "requirements-dev.txt", "training/requirements.txt"])
def test_every_python_requirement_is_pinned(name):
    for line in _requirement_lines(name):
        if not line.startswith("-r "):
            assert PIN.match(line), f"{name}: {line!r} is not pinned with =="


def test_deploy_requirements_leave_out_the_trainer():
    lines = _requirement_lines("requirements.txt")
    assert lines and not any("torch" in line.lower() or "training/" in line for line in lines)


def test_cdk_cli_is_pinned_to_a_version_that_reads_aws_cdk_lib_2_27x():
    package = json.loads((REPO / "package.json").read_text())
    assert re.fullmatch(r"2\.1148\.\d+", package["devDependencies"]["aws-cdk"])
    lock = json.loads((REPO / "package-lock.json").read_text())
    assert lock["packages"]["node_modules/aws-cdk"]["version"] == package["devDependencies"]["aws-cdk"]


def test_cli_telemetry_and_notices_are_off():
    cdk = json.loads((REPO / "cdk.json").read_text())
    assert cdk["notices"] is False and cdk["context"]["cli-telemetry"] is False


def test_no_top_level_constructs_folder():
    assert not (REPO / "constructs").exists(), "a top-level constructs/ would shadow the constructs library"


def test_trainer_never_imports_cdk():
    code = "import sys, training; print(sorted(m for m in sys.modules if m.split('.')[0] in ('aws_cdk', 'cdk_nag', 'jsii')))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def _field_paths(model, prefix=""):
    from typed_config import unwrap_model

    for name, field in model.model_fields.items():
        nested = unwrap_model(field.annotation)
        yield prefix + name
        if nested is not None:
            yield from _field_paths(nested, f"{prefix}{name}.")


def test_readme_config_reference_covers_every_field():
    from config import PlatformConfig

    readme = (REPO / "README.md").read_text()
    reference = readme[readme.index("## Config reference") : readme.index("### Instance catalog")]
    missing = [path for path in _field_paths(PlatformConfig) if f"`{path.rsplit('.', 1)[-1]}`" not in reference]
    assert missing == []


def test_readme_trainer_config_reference_covers_every_field():
    from training.config import TrainConfig

    readme = (REPO / "README.md").read_text()
    reference = readme[readme.index("### Trainer config reference") : readme.index("### Trainer images")]
    nested = [path for path in _field_paths(TrainConfig) if "." in path]
    assert nested and [path for path in nested if f"`{path}`" not in reference] == []


def test_trainctl_is_a_declared_console_command():
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"trainctl": "trainctl.__main__:main"}
    command = Path(sys.executable).parent / "trainctl"
    result = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "preflight" in result.stdout and "stage-data" in result.stdout
