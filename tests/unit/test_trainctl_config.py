"""trainctl finds its platform config as kubectl finds its context (issue 36, item 3): --config,
then $TRAINCTL_CONFIG, then the per-user settings file `trainctl use-config` writes; never an
example. Each command names the config it used in a header, and every error names it too."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from tests.conftest import EXAMPLE, REPO
from tests.trainctl_fixtures import HEADER, one_error


def trainctl(*args: str, cwd=REPO, settings_home=None, env_config: str | None = None):
    """trainctl with no AWS credentials and no kubeconfig, so a command stops at its first remote call."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "TRAINCTL_CONFIG"}
    env.update(AWS_EC2_METADATA_DISABLED="true", KUBECONFIG=str(settings_home / "no-kubeconfig"),
               XDG_CONFIG_HOME=str(settings_home), PYTHONPATH=str(REPO))
    if env_config is not None:
        env["TRAINCTL_CONFIG"] = env_config
    return subprocess.run([sys.executable, "-m", "trainctl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


def header_of(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith(HEADER)]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_without_a_config_from_any_source_it_says_how_to_name_one_and_uses_no_example(tmp_path):
    for cwd in (REPO, tmp_path):  # from the checkout, where config/example.yaml lies, and from elsewhere
        result = trainctl("list", "--context", "lab", cwd=cwd, settings_home=tmp_path)
        assert result.returncode == 2
        assert one_error(result.stderr) == (
            "error: no platform config given; fix: pass --config PATH, set $TRAINCTL_CONFIG, or run `trainctl "
            f"use-config PATH` once (it writes {tmp_path / 'trainctl' / 'settings.yaml'})")
        assert "example" not in result.stderr and "-c config=" not in result.stderr


def test_the_flag_wins_over_the_environment_which_wins_over_the_settings_file(tmp_path):
    mine, theirs = tmp_path / "mine.yaml", tmp_path / "theirs.yaml"
    for path, prefix in ((mine, "mine"), (theirs, "theirs")):
        path.write_text(EXAMPLE.read_text().replace("name_prefix: mltrain", f"name_prefix: {prefix}"))
    saved = trainctl("use-config", str(mine), cwd=tmp_path, settings_home=tmp_path)
    assert saved.returncode == 0, saved.stderr
    assert yaml.safe_load((tmp_path / "trainctl" / "settings.yaml").read_text()) == {"config": str(mine)}

    from_settings = trainctl("list", cwd="/", settings_home=tmp_path)  # any directory: the path was made absolute
    assert header_of(from_settings) == (f"trainctl: config {mine} (from {tmp_path / 'trainctl' / 'settings.yaml'}); "
                                        "cluster mine in us-west-2, namespace training")
    from_env = trainctl("list", settings_home=tmp_path, env_config=str(theirs))
    assert header_of(from_env).startswith(f"trainctl: config {theirs} (from $TRAINCTL_CONFIG); cluster theirs ")
    from_flag = trainctl("list", "--config", str(EXAMPLE), "--context", "lab", settings_home=tmp_path,
                         env_config=str(theirs))
    assert header_of(from_flag) == (f"trainctl: config {EXAMPLE} (from --config); kubeconfig context lab, "
                                    "namespace training")


def test_every_error_names_the_config_it_was_judged_against(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: j\nimage: repo.example.com/t:1\nnode_group: p5\n")
    result = trainctl("render", str(job), settings_home=tmp_path, env_config="config/example.yaml")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f'config error: {job}: node_group: got "p5" (not a node group of this platform); allowed: p4d, trn1 '
        "[config config/example.yaml (from $TRAINCTL_CONFIG)]")
    missing = trainctl("list", "--config", "nope.yaml", settings_home=tmp_path)
    assert one_error(missing.stderr) == ("config error: nope.yaml: cannot read the file (No such file or directory); "
                                         "the config comes from --config; pass an existing platform config with "
                                         "--config PATH")


def test_use_config_refuses_a_config_that_does_not_validate_and_keeps_the_saved_one(tmp_path):
    assert trainctl("use-config", str(EXAMPLE), settings_home=tmp_path).returncode == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("region: us-west-2", "region: Oregon"))
    result = trainctl("use-config", str(bad), settings_home=tmp_path)
    assert result.returncode == 2 and f"config error: {bad}: region: got \"Oregon\"" in result.stderr
    assert yaml.safe_load((tmp_path / "trainctl" / "settings.yaml").read_text()) == {"config": str(EXAMPLE)}


def test_a_broken_settings_file_is_one_line_naming_it(tmp_path):
    settings = tmp_path / "trainctl" / "settings.yaml"
    settings.parent.mkdir()
    settings.write_text("cluster: x\n")
    result = trainctl("list", settings_home=tmp_path)
    assert result.returncode == 2
    assert one_error(result.stderr) == (f"error: {settings}: config: got None; fix: allowed: the path of a platform "
                                        "config; run `trainctl use-config PATH` to write it")
