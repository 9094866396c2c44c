"""The launcher on every torch the platform ships: the pod's exact command, real agents, a real etcd.

Runs in the suite's environment (torch 2.13, CPU) and, by ``make test-torches``, under the Trainium
image's torch 2.8 (.venv-xla) and torch 2.14.1's CUDA build (.venv-torch214, the torchtitan image's
release line): it needs none of the suite's fixtures (``--noconftest``).
docs/DESIGN.md, "The launcher and torch", says what each case stands for.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import signal
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from training.contract import EXIT_CONFIG, EXIT_CRASH_LOOP, EXIT_STOPPED, launch_command
from tests.drill_harness import events, trainer_args
from trainctl.backends.local_cluster import LOCAL_TUNING, Agent, LocalEtcd, wait_until
from training.launcher import compat

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def etcd():
    with LocalEtcd() as endpoint:
        yield endpoint


def hooked(tmp_path: Path, source: str) -> dict[str, str]:
    """An environment whose Python processes run ``source`` at start (a sitecustomize on PYTHONPATH):
    the agent, the forkserver and every spawned process; a forked process inherits what it did."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(textwrap.dedent(source))
    return {"PYTHONPATH": os.pathsep.join([str(hook), str(REPO)])}


def cpu_trainer_args(work: Path, samples: int) -> list[str]:
    """The drills' trainer on the CPU: the Trainium environment's torch-xla would make "auto" its device."""
    return [*trainer_args(work, samples), "--train.device=cpu"]


def run_alone(tmp_path: Path, etcd: str, run_id: str, timeout: float = 120, **agent) -> tuple[int, str]:
    """One agent of a one-node job (unless ``agent`` says otherwise): its exit status and its log."""
    agent = Agent("a", etcd, run_id, tmp_path, cpu_trainer_args(tmp_path, 4000), **{"min_nodes": 1, "max_nodes": 1,
                                                                                    **agent})
    try:
        return agent.wait(timeout), agent.output()
    finally:
        agent.stop()


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_this_torch_has_every_surface_the_launcher_uses():
    import torch

    assert compat.problem() is None, torch.__version__
    assert compat.torch_version(torch.__version__) >= compat.OLDEST_TORCH


# torch's CUDA build counts the devices in LaunchConfig.__post_init__ (2.13, 2.14), which registers
# poison_fork: every process forked afterwards is "in a bad fork" and its first CUDA call raises
# "Cannot re-initialize CUDA in forked subprocess" (torch/cuda/__init__.py, _lazy_init). On a CUDA
# build (.venv-torch214) this hook only makes 2.8's LaunchConfig count the devices too, and the poison
# is torch's own. On the CPU build it also stands in for the device count: the same rule, inherited by
# every fork of the process that counted and cleared by exec, read where _lazy_init reads it.
DEVICE_COUNT_HOOK = """
    import json, os
    import torch
    import torch.distributed.launcher.api as launcher_api

    def _record(**fields):
        with open(os.environ["PROBE_RECORD"], "a") as out:
            out.write(json.dumps({"pid": os.getpid(), **fields}) + "\\n")

    if not torch.backends.cuda.is_built():
        _counted_in = []

        def is_available():
            _counted_in.append(os.getpid())
            return False

        torch.cuda.is_available = is_available
        torch.cuda._is_in_bad_fork = lambda: bool(_counted_in) and _counted_in[0] != os.getpid()

    _post_init = launcher_api.LaunchConfig.__post_init__

    def __post_init__(self):
        torch.cuda.is_available()  # what torch 2.13 and 2.14 do here for a NUMA default
        _record(role="agent")
        _post_init(self)

    launcher_api.LaunchConfig.__post_init__ = __post_init__
    os.register_at_fork(after_in_child=lambda: _record(role="forked", bad_fork=torch.cuda._is_in_bad_fork()))
"""


def test_a_worker_can_initialize_the_device_whatever_the_agent_did(tmp_path, etcd):
    """Failure 2 of issue 48: on a GPU, the worker forked from the agent died at torch.cuda.set_device."""
    probe = tmp_path / "forks.jsonl"
    env = {**hooked(tmp_path, DEVICE_COUNT_HOOK), "PROBE_RECORD": str(probe)}
    agent = Agent("a", etcd, "device-init", tmp_path, [*cpu_trainer_args(tmp_path, 4000), "--train.max_steps=10"],
                  min_nodes=1, max_nodes=1, nproc_per_node=2, env=env)
    try:
        assert agent.wait(180) == 0, agent.output()[-3000:]
    finally:
        agent.stop()
    found = records(probe)
    assert [r for r in found if r["role"] == "agent"], "the agent never counted the devices: the case is not shown"
    forked = [r for r in found if r["role"] == "forked"]
    assert len(forked) >= 2, found  # the two workers (and the forkserver's readiness probe)
    assert not [r for r in forked if r["bad_fork"]], f"workers that cannot initialize CUDA: {forked}"
    assert events(tmp_path, "finished")


def test_the_launcher_drill(tmp_path, etcd):
    """Two agents; one SIGKILLed, the survivor's workers keeping their state; a newcomer admitted with them regrouping in place;
    a SIGTERM to every agent that writes the stop checkpoint; a resume from it."""
    args = cpu_trainer_args(tmp_path, 400_000)
    run = f"drill-{os.getpid()}"
    agents = [Agent(name, etcd, run, tmp_path, args, max_nodes=2) for name in "ab"]
    try:
        wait_until(lambda: len([e for e in events(tmp_path, "step") if e["world_size"] == 2]) >= 4,
                   "two nodes training", 180, agents)
        killed_at = agents[1].kill_node()
        wait_until(lambda: [e for e in events(tmp_path, "step") if e["time"] > killed_at and e["world_size"] == 1],
                   "the survivor training alone", 120, agents[:1])
        survivor = agents[0].worker_pids()
        grew_at = time.time()
        agents.append(Agent("c", etcd, run, tmp_path, args, max_nodes=2))
        wait_until(lambda: [e for e in events(tmp_path, "step") if e["time"] > grew_at and e["world_size"] == 2],
                   "two nodes training again", 180, [agents[0], agents[2]])
        assert agents[0].worker_pids() == survivor  # the same process: joined the new round in place
        # The kill: the survivor kept its state (recovery from memory); the admission: regrouped in place.
        recovered = next(e for e in events(tmp_path, "resume") if e["time"] > killed_at)
        assert recovered["checkpoint"] is None and recovered["bytes_read"] == 0
        assert "joined round 1 in place (no restart, recovery after a lost peer)" in agents[0].output()
        assert "joined round 2 in place (no restart, regroup)" in agents[0].output()

        stopped_at = time.time()
        for agent in (agents[0], agents[2]):
            agent.terminate()
        codes = [agent.wait(120) for agent in (agents[0], agents[2])]
        assert codes == [EXIT_STOPPED, EXIT_STOPPED], [a.output()[-2000:] for a in agents]
        stop = [e for e in events(tmp_path, "checkpoint_saved") if e["time"] > stopped_at]
        assert stop, agents[0].output()[-3000:]
        assert f"the workers wrote their stop checkpoint (step {stop[-1]['step']})" in agents[0].output()

        resumed_at = time.time()
        agents.append(Agent("d", etcd, f"{run}-again", tmp_path, args, max_nodes=1))
        wait_until(lambda: [e for e in events(tmp_path, "resume") if e["time"] > resumed_at],
                   "the resume", 120, agents[3:])
        resume = [e for e in events(tmp_path, "resume") if e["time"] > resumed_at][0]
        assert resume["step"] == stop[-1]["step"]
    finally:
        for agent in agents:
            agent.stop()


INTERNAL_ERROR_HOOK = """
    import torch.distributed.elastic.agent.server.api as agent_api

    def _initialize_workers(self, worker_group):
        raise AttributeError("'LocalElasticAgent' object has no attribute '_a_member_this_torch_lacks'")

    agent_api.SimpleElasticAgent._initialize_workers = _initialize_workers
"""


def test_an_internal_error_of_the_launcher_ends_the_job_in_one_line_and_is_not_a_restart(tmp_path, etcd):
    """Failure 3 of issue 48: the agent's own error became exit 79, a whole-job restart, in a loop."""
    code, output = run_alone(tmp_path, etcd, "internal-error", env=hooked(tmp_path, INTERNAL_ERROR_HOOK))
    assert code == EXIT_CONFIG, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("config error: the launcher failed on torch ") and "_a_member_this_torch_lacks" in last


def test_a_launcher_that_never_trained_ends_the_job_instead_of_restarting_it(tmp_path, etcd):
    """A rendezvous that cannot gather its nodes (here: 2 needed, 1 came, within a 1 s join timeout)."""
    code, output = run_alone(tmp_path, etcd, "never-trained", min_nodes=2, max_nodes=2,
                             tuning=replace(LOCAL_TUNING, join_timeout=1))
    assert code == EXIT_CRASH_LOOP, output[-3000:]
    assert "before the job wrote any checkpoint (RendezvousTimeoutError" in output.strip().splitlines()[-1]


def test_a_stop_without_a_checkpoint_says_so(tmp_path, etcd):
    """A job's own program that writes no checkpoint: the launcher must not say "the workers checkpointed"."""
    program = tmp_path / "sleeper.py"
    program.write_text("import time\nprint('the program is running', flush=True)\ntime.sleep(600)\n")
    (tmp_path / "checkpoints").mkdir()
    command = launch_command(min_nodes=1, max_nodes=1, nproc_per_node=1, endpoint=etcd, run_id="no-checkpoint",
                             max_restarts=0, local_addr="127.0.0.1", python=sys.executable, grace_period_s=20,
                             program=[str(program)])
    agent = Agent("a", etcd, "no-checkpoint", tmp_path, [], command=command,
                  env={"PLATFORM_CHECKPOINT_DIR": str(tmp_path / "checkpoints")})
    try:
        wait_until(lambda: "the program is running" in agent.output(), "the program", 120, [agent])
        agent.terminate()
        assert agent.wait(60) == 128 + signal.SIGTERM
    finally:
        agent.stop()
    assert "stopped by SIGTERM; no new checkpoint was written" in agent.output()
    assert "checkpointed" not in agent.output()


def test_a_torch_that_lacks_a_surface_is_refused_in_one_line_before_any_rendezvous(tmp_path, etcd):
    """Failure 1 of issue 48, as any future release could bring it: a member the launcher relies on is gone."""
    hook = """
        import torch.distributed.elastic.agent.server.api as agent_api
        del agent_api.SimpleElasticAgent._restart_workers
    """
    code, output = run_alone(tmp_path, etcd, "lacks-surface", timeout=60, env=hooked(tmp_path, hook))
    output = output.strip()
    assert code == EXIT_CONFIG and "Traceback" not in output, output[-3000:]
    assert output.splitlines()[-1].startswith("config error: torch ")
    assert "SimpleElasticAgent._restart_workers" in output.splitlines()[-1]


def _launcher_source(name: str) -> ast.Module:
    return ast.parse((REPO / "training" / "launcher" / name).read_text())


def test_the_agent_touches_no_member_of_torchs_agent_that_compat_does_not_check():
    """A private member used without being checked at start is how the launcher broke on torch 2.8 and 2.11:
    every underscore member the agent reads from torch's classes is in compat's lists, which were read at
    each supported release. (The drills above run only under the torches a test environment installs.)"""
    tree = _launcher_source("agent.py")
    own = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    own |= {target.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"}
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and (isinstance(node.value, ast.Name) and node.value.id == "self"
                 or isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super")}
    checked = {path.split(".")[-1] for _module, path, _use in compat.SURFACES} | set(compat.AGENT_ATTRIBUTES)
    unchecked = {name for name in used if name not in checked and not (name in own and _defined_here(tree, name))}
    assert not unchecked, f"members of torch's agent used without a check in training/launcher/compat.py: {unchecked}"


def _defined_here(tree: ast.Module, name: str) -> bool:
    """Whether the agent itself assigns self.<name> or defines it without calling torch's (super()) version."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return not any(isinstance(call, ast.Attribute) and call.attr == name and isinstance(call.value, ast.Call)
                           for call in ast.walk(node))
    return True


def test_the_launcher_reads_only_launch_config_fields_the_oldest_torch_has():
    """``config.shutdown_timeout`` (torch 2.13 and newer) stopped every job on 2.8 and 2.11."""
    tree = _launcher_source("main.py")
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "config"}
    assert read and read <= set(compat.LAUNCH_CONFIG_FIELDS), read - set(compat.LAUNCH_CONFIG_FIELDS)


def test_a_worker_server_that_cannot_import_the_trainer_ends_the_job_in_one_line(tmp_path, etcd):
    """Python's forkserver drops a failed preload silently (multiprocessing/forkserver.py, ``main``): the
    workers would start cold and fail one by one. The launcher asks the server, and stops in one line."""
    code, output = run_alone(tmp_path, etcd, "cold-server",
                             env=hooked(tmp_path, 'import sys\nsys.modules["training.loop.trainer"] = None\n'))
    assert code == EXIT_CONFIG, output[-3000:]
    assert "WorkerServerError: the worker server could not import training.launcher.worker_server:" in \
        output.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "budget", "rest"), [
    (["--nnodes=1", "--shutdown-timeout=105", "-m", "training", "train"], 105, ["--nnodes=1", "-m", "training", "train"]),
    (["--shutdown_timeout", "7.5", "--nnodes", "2", "x.py", "--shutdown-timeout=1"], 7.5,
     ["--nnodes", "2", "x.py", "--shutdown-timeout=1"]),  # the program's own arguments are the program's
    (["--rdzv-conf", "a=1", "--", "--shutdown-timeout=3"], None, ["--rdzv-conf", "a=1", "--", "--shutdown-timeout=3"]),
])
def test_the_launcher_reads_its_own_flag_and_leaves_the_rest_to_torchrun(argv, budget, rest):
    from torch.distributed.run import get_args_parser

    from training.launcher.main import _options_with_values, _own_flags

    assert _own_flags(argv, _options_with_values(get_args_parser())) == (rest, budget, None)


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "soon", ""])
def test_a_bad_stop_budget_is_one_line_naming_the_flag(value):
    from torch.distributed.run import get_args_parser

    from training.launcher.main import _options_with_values, _own_flags

    _rest, _budget, problem = _own_flags([f"--shutdown-timeout={value}", "-m", "training"],
                                         _options_with_values(get_args_parser()))
    assert problem == f"--shutdown-timeout: got {value!r}; allowed: seconds, 0 or more"


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None,
                    reason="torch_xla is not installed: `make test-torches` runs this in .venv-xla (the Neuron image's torch)")
def test_the_neuron_path_trains_through_the_launchers_worker_server(tmp_path, etcd):
    """train.device=neuron (torch_xla, on its CPU device here) in a worker of the forkserver, world 1: XLA's CPU
    device is one process's world (tests/drills/test_xla_training.py carries two ranks' collectives by hand)."""
    args = [*trainer_args(tmp_path, 4000), "--train.device=neuron", "--train.max_steps=10"]
    agent = Agent("a", etcd, "neuron", tmp_path, args, min_nodes=1, max_nodes=1, env={"PJRT_DEVICE": "CPU"})
    try:
        assert agent.wait(300) == 0, agent.output()[-3000:]
    finally:
        agent.stop()
    (round_,) = events(tmp_path, "rendezvous")
    assert round_["device"].startswith("Neuron device") and events(tmp_path, "finished")
