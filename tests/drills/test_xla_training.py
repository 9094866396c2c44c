"""The Trainium path (train.device=neuron: torch_xla and the ``xla`` process group) trains, checkpoints and
resumes exactly, two processes under torchrun, on torch-xla's CPU device.

It runs in an environment of its own, with the torch the Neuron image has (2.8) and torch-xla:
``make test-xla`` (requirements-xla.txt, .venv-xla). Elsewhere torch_xla cannot be imported and
the module is skipped. tests/xla_worker.py writes down every collective the ``xla`` group is
given and carries it between the processes (XLA:CPU is one process's world; it says why).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.xla,
    pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None,
                       reason="torch_xla is not installed: `make test-xla` runs this module in .venv-xla"),
    pytest.mark.timeout(900),
]

STEPS, INTERVAL = 10, 5


def trainer_args(work: Path, device: str, steps: int) -> list[str]:
    """A small MLP on synthetic data, a constant learning rate (the schedule then does not depend on
    train.max_steps, which the interrupted run changes), validation at every checkpoint."""
    return [
        f"--train.device={device}", "--model.name=mlp", "--model.image_size=16", "--model.num_classes=4",
        "--data.synthetic_samples=4096", "--data.num_workers=0", "--train.global_batch_size=16",
        "--train.micro_batch_size=8", f"--train.max_steps={steps}", "--train.log_every_steps=1",
        "--train.precision=fp32", "--optim.schedule=constant", f"--checkpoint.dir={work}/checkpoints",
        f"--checkpoint.interval_steps={INTERVAL}", "--checkpoint.async_save=false",
        f"--metrics.jsonl_path={work}/metrics.jsonl", f"--eval.every_steps={INTERVAL}", "--eval.synthetic_samples=40",
    ]


def launch(work: Path, device: str = "neuron", steps: int = STEPS) -> subprocess.CompletedProcess:
    """torchrun, two workers: tests/xla_worker.py for the neuron device, ``-m training`` for the CPU one."""
    records = work / "collectives"
    records.mkdir(parents=True, exist_ok=True)
    worker = ["tests/xla_worker.py"] if device == "neuron" else ["-m", "training"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *worker, "train",
               *trainer_args(work, device, steps)]
    env = {**os.environ, "PJRT_DEVICE": "CPU", "XLA_TEST_COLLECTIVES": str(records), "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-5000:]
    return result


def events(work: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (work / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


def losses(work: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(work, "step")}


def checkpoint(work: Path, step: int) -> dict:
    import torch

    return torch.load(work / "checkpoints" / f"step-{step:09d}.pt", weights_only=True)


def calls(work: Path) -> dict[str, list[dict]]:
    return {path.stem: list(map(json.loads, path.read_text().splitlines()))
            for path in sorted((work / "collectives").glob("rank*.jsonl"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """An uninterrupted run; one stopped at the first checkpoint and resumed; the same job on CPU with gloo."""
    found = {name: tmp_path_factory.mktemp(name) for name in ("straight", "resumed", "cpu")}
    launch(found["straight"])
    launch(found["resumed"], steps=INTERVAL)
    launch(found["resumed"])
    launch(found["cpu"], device="cpu")
    return found


def test_every_collective_of_the_trainer_gets_xla_tensors(runs):
    for name in ("straight", "resumed"):
        by_rank = calls(runs[name])
        assert set(by_rank) == {"rank0", "rank1"}, name
        for rank, made in by_rank.items():
            assert {call["op"] for call in made} == {"allreduce", "broadcast", "allgather"}, (name, rank)
            assert all(call["devices"] and set(call["devices"]) == {"xla"} for call in made), (name, rank)
            # The two ranks issued the same collectives in the same order (XLA compiles them into
            # the same graphs; one left out would hang a Trainium job).
        assert by_rank["rank0"] == by_rank["rank1"], name


def test_the_run_is_on_the_neuron_runtime_with_two_ranks(runs):
    (round_,) = events(runs["straight"], "rendezvous")
    assert round_["world_size"] == 2 and round_["device"].startswith("Neuron device")
    # Both ranks' generators reached rank 0 (ProcessGroupXla has no gather) and were saved.
    assert len(checkpoint(runs["straight"], STEPS)["rng"]) == 2


def test_a_resumed_run_continues_exactly(runs):
    import torch

    straight, resumed = runs["straight"], runs["resumed"]
    (resume,) = events(resumed, "resume")
    assert resume["step"] == INTERVAL and resume["written_by_world_size"] == 2
    assert {step: loss for step, loss in losses(resumed).items() if step > INTERVAL} == {
        step: loss for step, loss in losses(straight).items() if step > INTERVAL}
    expected, found = checkpoint(straight, STEPS), checkpoint(resumed, STEPS)
    for name, tensor in expected["model"].items():
        assert torch.equal(found["model"][name], tensor), name
    for index, state in expected["optimizer"]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(found["optimizer"]["state"][index][key], tensor), (index, key)
    assert [e["top1"] for e in events(resumed, "eval")][-1] == [e["top1"] for e in events(straight, "eval")][-1]


def test_it_trains_what_the_cpu_trains(runs):
    """The same job on the CPU device with gloo: the losses agree to float rounding, so the xla
    group's collectives reduced across both processes (a rank alone would train another model)."""
    xla, cpu = losses(runs["straight"]), losses(runs["cpu"])
    assert set(xla) == set(cpu) == set(range(1, STEPS + 1))
    assert all(abs(xla[step] - cpu[step]) <= 1e-4 * max(1.0, abs(cpu[step])) for step in cpu), (xla, cpu)
    xla_eval, cpu_eval = events(runs["straight"], "eval"), events(runs["cpu"], "eval")
    assert [e["correct_top1"] for e in xla_eval] == [e["correct_top1"] for e in cpu_eval]
    assert [e["samples"] for e in xla_eval] == [e["samples"] for e in cpu_eval] == [40, 40]
