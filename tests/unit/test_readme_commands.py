"""Every command the README gives runs as written (issue 36, item 1).

Each command in the README's code blocks and inline code is found here and is either run by this
module as written, offline, or listed with where it runs instead and why it cannot run on a
machine without an AWS account, a cluster or Docker. A command added to the README without an
entry here fails the suite: someone must run it or say why it cannot be run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from tests.conftest import EXAMPLE, REPO

README = (REPO / "README.md").read_text()
PROGRAMS = ("make", ".venv/bin/trainctl", "trainctl", "npx", "python", "kubectl", "aws", "docker", "rm ", "REPO=")
NEEDS_AWS = "needs AWS credentials and a deployed platform"

# Commands run elsewhere in the suite, or that need what this machine lacks: command -> why.
ELSEWHERE = {
    "make synth": "tests/drills/test_synth_offline.py runs its recipe's commands (python app.py, cdk synth, the renderer) "
                  "offline; `make test` (.ci/run) runs the install steps",
    "make test": ".ci/run runs exactly this on a clean clone",
    "make synth CONFIG=config/my-team.yaml": "tests/drills/test_synth_offline.py: test_make_synth_with_a_team_config_*",
    'make synth CONFIG=config/my-team.yaml JOBS="jobs/a.yaml jobs/b.yaml"':
        "tests/drills/test_synth_offline.py: test_make_synth_with_a_bad_job_keeps_both_previous_outputs (JOBS=...)",
    "make diff-offline CONFIG=config/my-team.yaml":
        "tests/drills/test_synth_offline.py: test_make_diff_offline_reviews_every_stack_against_the_deployed_templates",
    "rm -rf cdk.out.deployed && cp -r cdk.out cdk.out.deployed": "plain shell; the copy is what diff-offline reads",
    ".venv/bin/trainctl preflight --config config/my-team.yaml": NEEDS_AWS + " (tests/unit/test_trainctl_aws.py: moto)",
    "trainctl preflight": NEEDS_AWS,
    "npx cdk diff --all --app cdk.out": NEEDS_AWS + ": it reads the deployed stacks",
    "npx cdk deploy --all --app cdk.out": NEEDS_AWS,
    "npx cdk deploy --all --force": NEEDS_AWS,
    "npx cdk deploy --all -c config=...": NEEDS_AWS,
    "npx cdk bootstrap aws://<account>/<region>": NEEDS_AWS,
    "aws sts get-caller-identity": NEEDS_AWS,
    "aws eks update-kubeconfig --name <name_prefix>": NEEDS_AWS,
    ".venv/bin/trainctl stage-data ~/data/imagenet --under imagenet/":
        NEEDS_AWS + " (tests/drills/test_stage_data.py runs it against moto's S3 server)",
    "kubectl apply -f dist/prepare-imagenet.yaml": "needs a cluster (the manifest is validated in tests/unit/test_charts.py)",
    ".venv/bin/trainctl submit k8s_charts/examples/resnet50-p4d.yaml --nccl-check":
        NEEDS_AWS + " (tests/drills/test_trainctl_cli.py runs submit, status, logs, list and cancel against the loopback "
                    "API server with kube-apiserver's semantics)",
    ".venv/bin/trainctl submit k8s_charts/examples/resnet50-p4d.yaml": NEEDS_AWS + " (tests/drills/test_trainctl_cli.py)",
    ".venv/bin/trainctl status resnet50-imagenet": NEEDS_AWS + " (tests/drills/test_trainctl_cli.py)",
    ".venv/bin/trainctl logs resnet50-imagenet --rank 0 --follow": NEEDS_AWS + " (tests/drills/test_trainctl_cli.py)",
    ".venv/bin/trainctl list": NEEDS_AWS + " (tests/drills/test_trainctl_cli.py)",
    ".venv/bin/trainctl nodes": NEEDS_AWS + " (tests/drills/test_node_check.py runs it against the loopback API server)",
    ".venv/bin/trainctl cancel resnet50-imagenet": NEEDS_AWS + " (tests/drills/test_trainctl_cli.py)",
    "trainctl cancel --all": NEEDS_AWS + " (tests/drills/test_operator_safety.py)",
    ".venv/bin/trainctl submit k8s_charts/examples/local/mlp-elastic.yaml --backend local":
        "runs offline, for a minute or more: tests/drills/test_local_runs.py runs this example with --backend local and "
        "kill -9's a node",
    "REPO=$(aws cloudformation describe-stacks --stack-name <name_prefix>-registry": NEEDS_AWS,
    "aws ecr get-login-password | docker login --username AWS --password-stdin ${REPO%%/*}":
        NEEDS_AWS + " and a Docker engine",
    "docker build -f training/docker/Dockerfile.gpu -t $REPO:gpu-0.1.0 . && docker push $REPO:gpu-0.1.0":
        "needs a Docker engine and the registry (tests/unit/test_images.py checks the Dockerfiles)",
    ".venv/bin/trainctl submit k8s_charts/examples/resnet50-p4d.yaml --backend slurm --dry-run":
        "needs a platform config with a slurm section (tests/unit/test_slurm_cli.py runs it with config/slurm-example.yaml)",
    ".venv/bin/trainctl submit k8s_charts/examples/resnet50-p4d.yaml --backend slurm":
        NEEDS_AWS + " (tests/drills/test_slurm_requeue.py runs submit, status, logs, cancel and list against a real Slurm)",
    ".venv/bin/trainctl status resnet50-imagenet --backend slurm": NEEDS_AWS + " (tests/drills/test_slurm_requeue.py)",
    "trainctl cancel NAME --backend slurm": NEEDS_AWS + " (tests/drills/test_slurm_requeue.py)",
    "kubectl describe pod": "needs a cluster",
    "kubectl -n kube-system logs deploy/cluster-autoscaler-aws-cluster-autoscaler": "needs a cluster",
}
# Teardown commands name a stack or resource of a deployed platform.
ELSEWHERE_PATTERNS = {
    r"npx cdk destroy <name_prefix>-\w+ -c config=\.\.\.": NEEDS_AWS,
    r"aws (ec2|fsx|s3) .*": NEEDS_AWS,
}


def readme_commands() -> list[str]:
    """Command lines of the bash/console blocks (a console block's `$ ` lines) and inline code
    that starts with a program."""
    commands = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", README, flags=re.M | re.S):
        if lang == "mermaid":
            continue
        for line in body.splitlines():
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            line = line.split("  #")[0].rstrip().rstrip("\\").rstrip()
            if line.strip() and not line.startswith(("  ", "#")):
                commands.append(line)
    commands += [span for span in re.findall(r"`([^`\n]+)`", README) if span.startswith(PROGRAMS)
                 and " " in span]
    return list(dict.fromkeys(commands))


def test_every_readme_command_is_run_here_or_says_why_not():
    run_here = {command for command, _ in RUN_HERE}
    unaccounted = [command for command in readme_commands() if command not in run_here and command not in ELSEWHERE
                   and not any(re.fullmatch(p, command) for p in ELSEWHERE_PATTERNS)]
    assert unaccounted == [], "README commands neither run by tests/unit/test_readme_commands.py nor listed with a reason"
    stale = [command for command in [*ELSEWHERE, *run_here] if command not in readme_commands()]
    assert stale == [], "listed here but no longer in the README"


@pytest.fixture(scope="module")
def user_env(tmp_path_factory):
    """A user's shell after step 5 of Deploy: their config copied from the example, trainctl's
    settings in a fresh home, no AWS credentials."""
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "TRAINCTL_CONFIG"}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), AWS_EC2_METADATA_DISABLED="true",
               PATH="/usr/local/bin:/usr/bin:/bin")
    my_team = REPO / "config" / "my-team.yaml"
    created = not my_team.exists()
    if created:
        shutil.copy(EXAMPLE, my_team)
    yield env
    if created:
        my_team.unlink()


def use_config(result) -> None:
    assert result.returncode == 0, result.stderr
    assert "later trainctl commands use" in result.stdout


def render(result) -> None:
    assert result.returncode == 0, result.stderr
    assert [doc["kind"] for doc in yaml.safe_load_all(result.stdout)] == ["Job"]
    assert result.stderr.startswith(f"trainctl: config {REPO / 'config' / 'my-team.yaml'} (from ")


# Run as written, in this order (the second relies on the first), each with what it must show.
RUN_HERE = [
    (".venv/bin/trainctl use-config config/my-team.yaml", use_config),
    (".venv/bin/trainctl render k8s_charts/examples/resnet50-p4d.yaml", render),
]


def test_the_offline_readme_commands_run_as_written(user_env):
    trainctl = REPO / ".venv" / "bin" / "trainctl"
    if not trainctl.exists():
        pytest.fail(f"{trainctl} is missing: `make synth` installs it (pip install -e .)")
    for command, check in RUN_HERE:
        result = subprocess.run(["bash", "-c", command], cwd=REPO, env=user_env, capture_output=True, text=True,
                                timeout=300)
        check(result)
