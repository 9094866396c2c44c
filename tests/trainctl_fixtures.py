"""The loopback API server of test_trainctl_kube and trainctl run against it as users run it.

Shared by test_operator_safety and test_trainctl_cli. pytest finds a fixture by its name in the
test module, so each of them binds these there (``server = trainctl_fixtures.server``): an
assignment, which needs no noqa, rather than an import that looks unused.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO
from tests.unit.test_trainctl_kube import FakeApiServer


def kubeconfig(path, server_url: str, context: str = "lab") -> str:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": context,
        "clusters": [{"name": "c", "cluster": {"server": server_url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": context, "context": {"cluster": "c", "user": "u"}}],
    }))
    return str(path)


HEADER = "trainctl: config "


def one_error(stderr: str) -> str:
    """trainctl's stderr for a mistake: at most its header, then one error line that names the
    config in use as the header does (trainctl/config_source.py). The error, without that name."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    header = [line for line in lines if line.startswith(HEADER)]
    errors = [line for line in lines if not line.startswith(HEADER)]
    assert len(header) <= 1 and len(errors) == 1, stderr
    if header:
        source = header[0].removeprefix(HEADER).split("; ")[0]
        naming = f" [config {source}]"
        assert errors[0].endswith(naming), stderr
        return errors[0].removesuffix(naming)
    return errors[0]


@pytest.fixture
def server():
    fake = FakeApiServer()
    yield fake
    fake.httpd.shutdown()


@pytest.fixture
def cli(server, tmp_path):
    """``trainctl --context lab ...`` against the fake API server: (exit code, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(KUBECONFIG=kubeconfig(tmp_path / "kubeconfig", server.url), AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))

    def run(*args: str, stdin: str = "", extra_env: dict | None = None) -> tuple[int, str, str]:
        result = subprocess.run([sys.executable, "-m", "trainctl", *args], cwd=REPO, capture_output=True, text=True,
                                input=stdin, timeout=120, env={**env, **(extra_env or {})})
        return result.returncode, result.stdout, result.stderr

    return run
