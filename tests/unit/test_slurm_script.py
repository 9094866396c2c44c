"""The sbatch script rendered from a job spec, and the launcher's Slurm rendezvous (no Slurm needed).

tests/drills/test_slurm_requeue.py runs the script on a real Slurm; here: what it asks Slurm for, what each
node runs, and the one-line errors, for the packaged trainer and a job's own program.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from config import PlatformConfig
from k8s_charts.job_charts import nccl_environment
from config.job_spec import parse_job_spec
from trainctl.backends.slurm import SlurmRuntime, pyxis_image, render_script
from training.contract import (
    EXIT_CONFIG, SLURM_KILL_WAIT_S, SLURM_NODE_FLAG, SlurmEnvironmentError, shutdown_timeout,
    slurm_launch_command, slurm_rendezvous_arguments,
)

REPO = Path(__file__).resolve().parents[2]
IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainer:gpu-0.1.0"


@pytest.fixture(scope="module")
def config() -> PlatformConfig:
    return PlatformConfig.model_validate(yaml.safe_load((REPO / "config/example.yaml").read_text()))


def spec(config, **fields):
    base = {"name": "bert", "image": IMAGE, "node_group": "p4d", "min_nodes": 2, "max_nodes": 4,
            "trainer_args": {"model.name": "mlp"}}
    return parse_job_spec({**base, **fields}, config)


def directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def srun_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("srun ")]


def test_the_script_asks_for_min_to_max_whole_nodes_requeued_on_failure(config):
    script = render_script(config, spec(config), partition="p4d", kill_wait_s=SLURM_KILL_WAIT_S)
    assert directives(script) == [
        "--job-name=bert", "--partition=p4d", "--nodes=2-4", "--ntasks-per-node=1", "--exclusive", "--requeue",
        "--output=/fsx/slurm/bert/logs/batch.log", "--open-mode=append", "--comment=trainctl:mltrain"]
    fixed = render_script(config, spec(config, min_nodes=4), partition="p4d", kill_wait_s=SLURM_KILL_WAIT_S)
    assert "--nodes=4" in directives(fixed)


def test_each_node_runs_the_launcher_with_the_eks_pods_environment(config):
    job = spec(config)
    script = render_script(config, job, partition="p4d", kill_wait_s=SLURM_KILL_WAIT_S)
    (srun,) = srun_lines(script)
    expected = slurm_launch_command(nproc_per_node=8, max_restarts=job.max_restarts, kill_wait_s=SLURM_KILL_WAIT_S,
                                    program=job.program_arguments(config))
    assert srun.endswith(" ".join(expected))
    assert f"--shutdown-timeout={shutdown_timeout(SLURM_KILL_WAIT_S)}" in srun
    assert "--container-image=123456789012.dkr.ecr.us-west-2.amazonaws.com#trainer:gpu-0.1.0" in srun
    assert '"--container-mounts=/fsx:/fsx"' in srun and "--container-workdir=/app" in srun
    assert "--kill-on-bad-exit=1" in srun and "--output=/fsx/slurm/bert/logs/node-%n.log" in srun
    # The job's environment wins over an image's own values of the same names (Pyxis --container-env).
    named = re.search(r"--container-env=(\S+)", srun).group(1).split(",")
    exported = re.findall(r"^export (\w+)=", script, flags=re.M)
    assert sorted(named) == sorted(exported) and "NCCL_SOCKET_IFNAME" in named
    # EFA and NCCL from the same function the pods' environment comes from.
    for key, value in nccl_environment(True, rdma=True).items():
        assert f"export {key}={value}" in script or f"export {key}='{value}'" in script


def test_a_fresh_incarnation_asked_for_by_any_node_requeues_the_job(config):
    script = render_script(config, spec(config), partition="p4d", kill_wait_s=SLURM_KILL_WAIT_S)
    assert 'export PLATFORM_RESTART_MARKER="/fsx/slurm/bert/logs/restart-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}"' in (
        script)
    assert script.endswith('code=$?\nif [ "$code" -eq 79 ] || [ -e "$PLATFORM_RESTART_MARKER" ]; then scontrol requeue '
                           '"$SLURM_JOB_ID"; fi\nexit "$code"\n')


def test_the_jobs_folders_are_made_before_any_node_starts(config, tmp_path):
    script = render_script(config, spec(config), partition="p4d", kill_wait_s=SLURM_KILL_WAIT_S)
    (line,) = [line for line in script.splitlines() if line.startswith("mkdir -p /fsx/")]
    assert line.startswith("mkdir -p /fsx/checkpoints/bert /fsx/cache/bert /fsx/staging/bert || ")
    # A folder the user may not make (a file where its parent should be): one line, exit 78 (config), before srun.
    (tmp_path / "fsx").mkdir()
    (tmp_path / "fsx" / "checkpoints").write_text("")
    done = subprocess.run(["bash", "-c", line.replace("/fsx/", f"{tmp_path}/fsx/")], capture_output=True, text=True)
    assert done.returncode == EXIT_CONFIG
    assert done.stderr.splitlines()[-1] == ("config error: cannot create the job's folders on /fsx as the submitting "
                                            "user; allowed: folders this user may write (docs/slurm.md, Running jobs)")


def test_a_python_on_the_nodes_replaces_the_container(config):
    script = render_script(config, spec(config), partition="p4d", kill_wait_s=SLURM_KILL_WAIT_S,
                           runtime=SlurmRuntime(python="/fsx/envs/trainer/bin/python"))
    (srun,) = srun_lines(script)
    assert "--container" not in script
    assert " /fsx/envs/trainer/bin/python -m training.launcher --slurm-job " in srun


def test_an_own_program_gets_the_launcher_from_the_platform_image(config):
    job = spec(config, trainer_args={}, program={"module": "torchtitan.train", "args": ["--job.config_file", "x.toml"]})
    script = render_script(config, job, partition="p4d", kill_wait_s=SLURM_KILL_WAIT_S)
    copy, main = srun_lines(script)
    assert f"--container-image={pyxis_image(config.jobs.launcher_image)}" in copy
    assert "cp -R --parents training/__init__.py training/contract.py training/launcher /platform-launcher/" in copy
    assert "launcher-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}:/platform-launcher:ro" in main
    assert " python /platform-launcher/training/launcher/__main__.py --slurm-job " in main
    assert main.endswith("-m torchtitan.train --job.config_file x.toml")
    assert "export PLATFORM_CHECKPOINT_DIR=/fsx/checkpoints/bert" in script


def test_the_script_is_valid_bash(config, tmp_path):
    for runtime in (SlurmRuntime(), SlurmRuntime(python="/usr/bin/python3")):
        path = tmp_path / "job.sbatch"
        path.write_text(render_script(config, spec(config), partition="p4d", kill_wait_s=SLURM_KILL_WAIT_S,
                                      runtime=runtime))
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


def test_enroot_logs_in_to_ecr_with_a_fresh_token_at_each_import(config, tmp_path):
    script = render_script(config, spec(config), partition="p4d", kill_wait_s=SLURM_KILL_WAIT_S)
    entry = ("machine 123456789012.dkr.ecr.us-west-2.amazonaws.com login AWS password "
             "$(aws ecr get-login-password --region us-west-2)")
    assert f"echo '{entry}' >> \"$enroot_config/.credentials\"" in script
    # Run those lines twice in a HOME of their own: one entry, the command kept for Enroot to run.
    lines = [line for line in script.splitlines() if "enroot_config" in line]
    for _ in range(2):
        subprocess.run(["bash", "-euc", "\n".join(lines)], env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
                       check=True)
    credentials = tmp_path / ".config" / "enroot" / ".credentials"
    assert credentials.read_text() == entry + "\n" and credentials.stat().st_mode & 0o777 == 0o600
    host = render_script(config, spec(config), partition="p4d", kill_wait_s=SLURM_KILL_WAIT_S,
                         runtime=SlurmRuntime(python="/usr/bin/python3"))
    assert "enroot" not in host


def test_pyxis_image_separates_the_registry():
    assert pyxis_image("123456789012.dkr.ecr.us-west-2.amazonaws.com/team/trainer:1") == (
        "123456789012.dkr.ecr.us-west-2.amazonaws.com#team/trainer:1")
    assert pyxis_image("localhost:5000/trainer:1") == "localhost:5000#trainer:1"


SLURM_TASK = {"SLURM_JOB_ID": "42", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "3",
              "SLURM_LAUNCH_NODE_IPADDR": "10.0.1.17"}


def test_the_rendezvous_is_static_at_the_batch_host_one_run_per_incarnation():
    assert slurm_rendezvous_arguments(SLURM_TASK) == [
        "--nnodes=3", "--node-rank=1", "--rdzv-backend=static", "--master-addr=10.0.1.17", "--rdzv-id=slurm-42-0"]
    requeued = slurm_rendezvous_arguments({**SLURM_TASK, "SLURM_RESTART_COUNT": "2"})
    assert requeued[-1] == "--rdzv-id=slurm-42-2"


@pytest.mark.parametrize("environ", [
    {k: v for k, v in SLURM_TASK.items() if k != "SLURM_LAUNCH_NODE_IPADDR"},
    {**SLURM_TASK, "SLURM_NODEID": "3"},
    {**SLURM_TASK, "SLURM_JOB_NUM_NODES": "two"},
])
def test_a_task_outside_a_whole_allocation_step_is_refused(environ):
    with pytest.raises(SlurmEnvironmentError, match=r"^--slurm-job: .*; allowed: "):
        slurm_rendezvous_arguments(environ)


def test_the_launcher_outside_slurm_ends_with_one_config_line():
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    done = subprocess.run([sys.executable, "-m", "training.launcher", SLURM_NODE_FLAG, "--nproc-per-node=1",
                           "-m", "training", "train"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_CONFIG
    assert done.stderr.strip().splitlines() == [
        "config error: --slurm-job: Slurm's task variables are missing or invalid ('SLURM_JOB_ID'); "
        "allowed: inside an srun step of a Slurm job"]
