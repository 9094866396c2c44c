"""A job's own torchrun program (not the packaged trainer) under the platform's launcher, as a pod runs it.

The "user's image" is an interpreter that has torch and nothing of this project: a virtual
environment whose only addition is the shared environment's site-packages as a plain path (so
the editable install of this repository, a .pth hook there, is not loaded). The launcher reaches it
as in a pod: the init container's copy command (training.contract.launcher_copy_command, the same
list the chart renders) runs in the repository's root as it does in the platform image's /app,
into a folder that stands for the pod's launcher volume; the agent runs its entry script from
there, from a working directory of its own. The program (tests/programs/fsdp_dcp.py) shards
its model with FSDP2 on gloo and saves and loads with DCP in $PLATFORM_CHECKPOINT_DIR.

Two nodes train, one is killed; the survivor resumes from the last DCP checkpoint at world size 1,
the job completes, and every step's loss is an uninterrupted run's. And a node whose workers
crash after a checkpoint, with no restart to spend (--max-restarts=0), restarts them for free:
the launcher counts the program's newer checkpoint in $PLATFORM_CHECKPOINT_DIR as progress.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO
from training.contract import LAUNCHER_ENTRY, LAUNCHER_MOUNT, launch_command, launcher_copy_command
from trainctl.backends.local_cluster import LOCAL_TUNING, Agent, read_events, wait_until

pytestmark = pytest.mark.timeout(300)

STEPS, INTERVAL = 60, 10


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> dict[str, Path]:
    """A Python with torch and without this project, the program in it, and the launcher injected beside it."""
    root = tmp_path_factory.mktemp("image")
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip",
                    str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # A path line only extends sys.path: the .pth files there (this repository's editable install) stay unread.
    Path(site, "shared-torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (root / "workspace").mkdir()
    program = shutil.copy(REPO / "tests" / "programs" / "fsdp_dcp.py", root / "workspace" / "fsdp_dcp.py")
    volume = root / "platform-launcher"
    volume.mkdir()
    subprocess.run(launcher_copy_command(str(volume)), cwd=REPO, check=True)  # the init container, /app -> volume
    probe = subprocess.run([str(python), "-c", "import torch, importlib.util as u; print(u.find_spec('training'))"],
                           cwd=root / "workspace", capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "None"  # the image has torch, not this project
    return {"python": python, "program": Path(program), "volume": volume, "workspace": root / "workspace"}


def test_the_injected_launcher_needs_only_torch_and_the_standard_library(image):
    """What the copy holds imports nothing but torch, the standard library and itself (no python-etcd,
    no pydantic, no yaml): the modules a pod's launcher imports, after torch's own."""
    probe = ("import sys, torch, torch.distributed.run, torch.distributed.elastic.agent.server.local_elastic_agent\n"
             "before = {m.split('.')[0] for m in sys.modules}\n"
             f"sys.path.insert(0, {str(image['volume'])!r})\n"
             "import training.launcher.main, training.launcher.agent, training.launcher.rendezvous\n"
             "new = {m.split('.')[0] for m in sys.modules} - before - set(sys.stdlib_module_names)\n"
             "print(sorted(new), training.__file__)")
    found = subprocess.run([str(image["python"]), "-c", probe], cwd=image["workspace"], capture_output=True,
                           text=True, check=True).stdout.split()
    assert found[0] == "['training']" and found[1].startswith(str(image["volume"]))


def agent(name: str, etcd: str, run_id: str, work: Path, image: dict, *, max_nodes: int, step_seconds: float
          ) -> Agent:
    command = launch_command(
        min_nodes=1, max_nodes=max_nodes, nproc_per_node=1, endpoint=etcd, run_id=run_id, max_restarts=0,
        local_addr="127.0.0.1", python=str(image["python"]), grace_period_s=30, tuning=LOCAL_TUNING,
        launcher=LAUNCHER_ENTRY.replace(LAUNCHER_MOUNT, str(image["volume"]), 1),
        program=[str(image["program"]), f"--steps={STEPS}", f"--interval={INTERVAL}",
                 f"--loss-file={work / 'losses.jsonl'}", f"--step-seconds={step_seconds}"])
    (work / "checkpoints").mkdir(exist_ok=True)
    return Agent(name, etcd, run_id, work, [], command=command, cwd=image["workspace"],
                 env={"PLATFORM_CHECKPOINT_DIR": str(work / "checkpoints"), "PYTHONPATH": ""})


def losses(work: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_events(work / "losses.jsonl") if e["event"] == "step"}


def test_the_injected_launcher_runs_an_fsdp_program_through_a_lost_node(tmp_path, image, etcd_module):
    reference = tmp_path / "reference"
    reference.mkdir()
    work = tmp_path / "drill"
    work.mkdir()
    a = agent("a", etcd_module, "own-program", work, image, max_nodes=2, step_seconds=0.1)
    b = agent("b", etcd_module, "own-program", work, image, max_nodes=2, step_seconds=0.1)
    alone = None
    try:
        # The uninterrupted run beside the drill once both nodes started together (a third launcher's start
        # could hold one of them past the last call): its own job, and the kill waits on steps, not on time.
        wait_until(lambda: [e for e in read_events(work / "losses.jsonl") if e["event"] == "start"],
                   "the two nodes' first round", timeout=120, agents=[a, b])
        alone = agent("reference", etcd_module, "own-program-reference", reference, image, max_nodes=1,
                      step_seconds=0)
        wait_until(lambda: (work / "checkpoints" / "step-20").is_dir() and len(losses(work)) >= 25,
                   "two nodes past their second checkpoint", timeout=120, agents=[a, b])
        b.kill_node()
        assert a.wait(timeout=150) == 0, a.output()[-3000:]
        assert alone.wait(timeout=120) == 0, alone.output()[-3000:]
    finally:
        for node in (alone, a, b):
            if node is not None:
                node.stop()

    starts = [e for e in read_events(work / "losses.jsonl") if e["event"] == "start"]
    assert [s["world_size"] for s in starts] == [2, 1]
    assert starts[1]["resumed_from"] >= 20 and starts[1]["resumed_from"] % INTERVAL == 0
    assert not any(s["training_importable"] or s["training_loop_importable"] for s in starts)
    assert (work / "checkpoints" / f"step-{STEPS}" / ".metadata").is_file()
    expected, trained = losses(reference), losses(work)
    assert sorted(trained) == list(range(1, STEPS + 1))
    for step, loss in trained.items():
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
    assert sorted(expected) == list(range(1, STEPS + 1))


def test_a_crash_after_the_programs_checkpoint_costs_no_restart(tmp_path, image, etcd_module):
    node = agent("a", etcd_module, "own-program-crash", tmp_path, image, max_nodes=1, step_seconds=0.05)
    try:
        wait_until(lambda: (tmp_path / "checkpoints" / "step-20").is_dir(), "a checkpoint", timeout=120, agents=[node])
        node.kill_workers()  # a crash (an OOM kill, a lost GPU): the agent has --max-restarts=0
        assert node.wait(timeout=120) == 0, node.output()[-3000:]
    finally:
        node.stop()
    assert "does not count against --max-restarts" in node.output()
    starts = [e for e in read_events(tmp_path / "losses.jsonl") if e["event"] == "start"]
    assert [s["resumed_from"] >= 20 for s in starts] == [False, True]
