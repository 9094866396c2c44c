"""cdk8s runs on the pinned Node, found without the user's PATH, or the user is told in one line
how to get one (issue 17, item 4)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from k8s_charts import node_runtime as node
from tests.conftest import REPO


def fake_node(folder, version: str):
    folder.mkdir(exist_ok=True)
    script = folder / "node"
    script.write_text(f"#!/bin/sh\necho {version}\n")
    script.chmod(0o755)
    return script


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("JSII_NODE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    return tmp_path


def test_the_pinned_node_is_chosen_when_it_is_there(clean_env, monkeypatch):
    pinned = fake_node(clean_env / "pinned", "v22.23.3")
    assert node.select_node(pinned) == str(pinned)
    assert os.environ["JSII_NODE"] == str(pinned)


def test_no_node_anywhere_is_one_line_saying_how_to_get_it(clean_env):
    with pytest.raises(node.NodeRuntimeMissing) as caught:
        node.select_node(clean_env / "missing" / "node")
    assert str(caught.value) == ("Node.js is needed to render manifests (cdk8s runs on it) and none was found; "
                                 f"{node.HOW_TO_GET_IT}")
    assert "\n" not in str(caught.value)


def test_an_end_of_life_node_on_path_is_refused_and_a_supported_one_used(clean_env):
    old = fake_node(clean_env / "bin", "v20.20.2")
    with pytest.raises(node.NodeRuntimeMissing, match=f"{old} is Node.js 20, which cdk8s no longer supports; run "):
        node.select_node(clean_env / "missing" / "node")
    fake_node(clean_env / "bin", "v24.1.0")
    assert node.select_node(clean_env / "missing" / "node") == str(clean_env / "bin" / "node")


def test_render_from_a_plain_shell_uses_the_pinned_node_without_a_banner(tmp_path):
    # A user's shell: no node_modules/.bin on PATH, maybe the system's Node 20 (which prints an
    # 11-line end-of-life banner on every call when jsii runs on it).
    env = {k: v for k, v in os.environ.items() if k != "JSII_NODE"}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    result = subprocess.run([sys.executable, "-m", "trainctl", "render", "k8s_charts/examples/resnet50-p4d.yaml"],
                            cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [  # trainctl's header alone: no banner
        "trainctl: config config/example.yaml (from $TRAINCTL_CONFIG); for cluster mltrain in us-west-2, namespace "
        "training"] and "kind: Job" in result.stdout


def test_python_m_k8s_charts_without_node_is_one_line(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path), "JSII_NODE": ""}
    code = ("import os, sys; from k8s_charts import node_runtime as node; node.PINNED_NODE = node.Path('/nonexistent/node'); "
            "os.environ.pop('JSII_NODE', None); from k8s_charts.__main__ import main; sys.exit(main(['--out', sys.argv[1]]))")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env={**env, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: Node.js is needed to render manifests (cdk8s runs on "
                                                  f"it) and none was found; {node.HOW_TO_GET_IT}"]
