"""torchtitan itself (0.3.0, its llama3 debug model) under the platform's launcher: FSDP2 on gloo, DCP
checkpoints, a node killed, the survivor resharding the checkpoint at world size 1.

Needs torchtitan, which the project's environment does not have: ``make test-titan`` builds
.venv-titan (tests/requirements-torchtitan.txt) and runs this module; elsewhere it is skipped.
The nodes run that environment's Python; the launcher reaches them as the packaged launcher
files alone (training/__init__.py, training/contract.py, training/launcher/ on PYTHONPATH), so
nothing else of ``training`` is importable. torchtitan 0.3.0 needs five small patches to train on
CPU at all; tests/programs/torchtitan_cpu.py lists each with the upstream line that stops it.

torchtitan's dataloader cannot be resharded (torchtitan/components/dataloader.py:161, "dataloader
resharding is not supported yet"), so a restart at another world size leaves the dataloader's
state out (``--checkpoint.exclude_from_loading dataloader``) and reads its data from the start:
the losses after a resume at world size 1 cannot be those of a run that never changed size.
What they are compared with instead is a planned resize: the same job stopped at the checkpoint
the drill resumes from and restarted on one node. Equal losses show the kill lost nothing but
the steps after that checkpoint, and that the model and optimizer state resharded from two
ranks to one is what was saved. The LR schedule is set by ``--lr_scheduler.total_steps`` so that
stopping early changes nothing else.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from training.contract import torchrun_arguments
from trainctl.backends.local_cluster import LOCAL_TUNING, Agent, wait_until


TITAN_PYTHON = REPO / ".venv-titan" / "bin" / "python"
PROGRAM = REPO / "tests" / "programs" / "torchtitan_cpu.py"
LAUNCHER_FILES = ("training/__init__.py", "training/contract.py", "training/launcher")
STEPS, INTERVAL, GLOBAL_BATCH = 16, 4, 4
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his",
         "her", "it", "an", "were", "are", "which", "this", "be", "or"]
STEP_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")


def _torchtitan_version() -> str | None:
    if not TITAN_PYTHON.exists():
        return None
    found = subprocess.run([str(TITAN_PYTHON), "-c", "import torchtitan, importlib.metadata as m; "
                            "print(m.version('torchtitan'))"], capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else None


pytestmark = [pytest.mark.timeout(600), pytest.mark.skipif(_torchtitan_version() is None,
                                             reason="torchtitan is not installed: make test-titan builds .venv-titan")]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    """A word-level tokenizer (vocabulary 28 < the debug model's 2048), a text data set, the launcher alone."""
    root = tmp_path_factory.mktemp("titan")
    tokenizer, data, launcher = root / "tokenizer", root / "data", root / "platform-launcher"
    tokenizer.mkdir()
    data.mkdir()
    script = f"""
import json, random
from tokenizers import Tokenizer, models, pre_tokenizers
specials = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
tok = Tokenizer(models.WordLevel({{t: i for i, t in enumerate(specials + {WORDS!r})}}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.add_special_tokens(specials[:2])
tok.save("{tokenizer}/tokenizer.json")
json.dump({{"bos_token": specials[0], "eos_token": specials[1], "add_bos_token": True, "add_eos_token": True}},
          open("{tokenizer}/tokenizer_config.json", "w"))
rng = random.Random(0)
with open("{data}/data.json", "w") as out:
    for _ in range(400):
        out.write(json.dumps({{"text": " ".join(rng.choice({WORDS!r}) for _ in range(300))}}) + "\\n")
"""
    subprocess.run([str(TITAN_PYTHON), "-c", script], check=True)
    for path in LAUNCHER_FILES:  # what the pod's init container copies (docs/job-spec.md)
        (launcher / path).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (REPO / path).is_dir() else shutil.copy)(REPO / path, launcher / path)
    return {"tokenizer": tokenizer, "data": data, "launcher": launcher}


def node(name: str, etcd: str, run_id: str, work: Path, assets: dict, *, max_nodes: int, steps: int,
         step_seconds: float = 0) -> Agent:
    command = [str(TITAN_PYTHON), "-m", "training.launcher",
               *torchrun_arguments(min_nodes=1, max_nodes=max_nodes, nproc_per_node=1, endpoint=etcd, run_id=run_id,
                                   max_restarts=0, tuning=LOCAL_TUNING, local_addr="127.0.0.1"),
               str(PROGRAM), "--module", "torchtitan_cpu", "--config", "llama3_debugmodel_cpu",
               "--parallelism.spmd_backend", "partial_dtensor", "--debug.seed", "7", "--validator.no-enable",
               "--training.local_batch_size", str(GLOBAL_BATCH // max_nodes), "--training.global_batch_size",
               str(GLOBAL_BATCH), "--training.seq_len", "128", "--training.steps", str(steps),
               "--lr_scheduler.total_steps", str(STEPS), "--metrics.log_freq", "1",
               "--hf_assets_path", str(assets["tokenizer"]), "--dataloader.dataset_path", str(assets["data"]),
               "--checkpoint.enable", "--checkpoint.folder", str(work / "checkpoints"),
               "--checkpoint.interval", str(INTERVAL), "--checkpoint.exclude_from_loading", "dataloader",
               "--dump_folder", str(work / "outputs")]
    env = {"PYTHONPATH": str(assets["launcher"]), "PLATFORM_CHECKPOINT_DIR": str(work / "checkpoints")}
    if step_seconds:
        env["TITAN_STEP_SECONDS"] = str(step_seconds)
    return Agent(name, etcd, run_id, work, [], command=command, env=env)


def losses(*agents: Agent) -> dict[int, float]:
    """Each step's loss as rank 0 logged it; a step trained twice (lost to a kill) keeps its last."""
    found: dict[int, float] = {}
    for agent in agents:
        for step, loss in STEP_LINE.findall(re.sub(r"\x1b\[[0-9;]*m", "", agent.output())):
            found[int(step)] = float(loss)
    return found


def saved(work: Path, step: int) -> bool:
    return (work / "checkpoints" / f"step-{step}" / ".metadata").is_file()  # DCP writes it last


def test_torchtitan_resumes_at_a_smaller_world_size_from_its_dcp_checkpoint(tmp_path, assets, etcd_module):
    cut = 2 * INTERVAL
    planned = tmp_path / "planned"
    planned.mkdir()
    pair = [node(n, etcd_module, "titan-planned", planned, assets, max_nodes=2, steps=cut) for n in ("a", "b")]
    assert [a.wait(timeout=240) for a in pair] == [0, 0], pair[0].output()[-3000:]
    assert saved(planned, cut)
    alone = node("c", etcd_module, "titan-planned-1", planned, assets, max_nodes=1, steps=STEPS)
    assert alone.wait(timeout=240) == 0, alone.output()[-3000:]
    expected = {**losses(*pair), **losses(alone)}
    assert sorted(expected) == list(range(1, STEPS + 1))

    drill = tmp_path / "drill"
    drill.mkdir()
    a, b = (node(n, etcd_module, "titan-drill", drill, assets, max_nodes=2, steps=STEPS, step_seconds=0.5)
            for n in ("a", "b"))
    try:
        wait_until(lambda: saved(drill, cut), f"the step-{cut} checkpoint", timeout=240, agents=[a, b])
        b.kill_node()
        assert not saved(drill, cut + INTERVAL)  # the survivor must go back to step `cut`
        assert a.wait(timeout=300) == 0, a.output()[-3000:]
    finally:
        a.stop()
        b.stop()

    output = a.output()
    assert f"Loading the checkpoint from {drill / 'checkpoints' / f'step-{cut}'}" in output
    assert saved(drill, STEPS)
    trained = losses(a)
    assert sorted(trained) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        # bf16 parameters (torchtitan's default mixed_precision_param), as on GPU: a bf16 epsilon is 2**-8. The
        # first step after the resume matches to the printed digit; later ones drift by about 1e-4 (measured).
        assert trained[step] == pytest.approx(expected[step], rel=1e-3), step
    assert trained[cut + 1] == expected[cut + 1]
    assert trained[cut + 1] < trained[1] - 1  # resumed training, not a fresh model


def test_the_example_jobs_arguments_are_torchtitans_and_set_what_the_docs_say():
    """k8s_charts/examples/llama3-8b-torchtitan-p5.yaml's program.args, parsed by torchtitan 0.3.0 itself
    (torchtitan/config/manager.py) with the image's config module: a misspelt flag fails here, not on p5."""
    spec = yaml.safe_load((REPO / "k8s_charts/examples/llama3-8b-torchtitan-p5.yaml").read_text())
    program = spec["program"]
    script = f"""
import json, os, sys
sys.path.insert(0, {str(REPO / "training/docker/torchtitan")!r})
os.environ.update({spec["env"]!r})  # the job spec's env, as the pod has it (LLAMA3_ASSETS among it)
os.environ["PLATFORM_CHECKPOINT_DIR"] = "/fsx/checkpoints/llama3-8b-torchtitan"
from torchtitan.config import ConfigManager
c = ConfigManager().parse_args({program["args"]!r})
print(json.dumps(dict(checkpoint=[c.checkpoint.enable, c.checkpoint.folder, c.checkpoint.exclude_from_loading],
    compile=c.compile.enable, fsdp=c.parallelism.data_parallel_shard_degree, tp=c.parallelism.tensor_parallel_degree,
    ac=type(c.activation_checkpoint).__qualname__, param=c.training.mixed_precision_param,
    steps=c.training.steps, seq_len=c.training.seq_len, dump=c.dump_folder, assets=c.hf_assets_path)))
"""
    found = subprocess.run([str(TITAN_PYTHON), "-c", script], capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr[-3000:]
    assert json.loads(found.stdout.strip().splitlines()[-1]) == {
        "checkpoint": [True, "/fsx/checkpoints/llama3-8b-torchtitan", ["dataloader"]], "compile": True,
        "fsdp": -1, "tp": 1, "ac": "SelectiveAC.Config", "param": "bfloat16", "steps": 10000, "seq_len": 8192,
        "dump": "/fsx/runs/llama3-8b-torchtitan", "assets": spec["env"]["LLAMA3_ASSETS"]}
