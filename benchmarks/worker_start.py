"""How the packaged trainer's workers start: the pod's command on one node, CPU, a real etcd.

For each way of starting workers, ``--trials`` runs of one agent with ``--nproc`` workers (the `mlp`
model, gloo) measure:

- **first step**: the agent's start (the pod's command) to the first step any worker finishes;
- **restart**: its workers SIGKILLed (a crash) to the first step of the restarted ones: the
  agent's restart of its workers, which is what a lost peer costs each survivor's node today;
- **admission pause** (``--growth``): two agents, a third admitted; the survivors' gap between the last
  step of the smaller world and the first of the bigger one, in place and with
  ``PLATFORM_REGROUP_IN_PLACE=0`` (torchrun's restart of every worker).

The ways: ``forkserver`` (this launcher: a server that imported the trainer forks each worker),
``spawn`` (``--start-method=spawn``: torchrun's fresh interpreter per worker), and, with
``--before DIR`` (a checkout of the launcher that forked workers from the agent, such as
``git worktree add DIR <commit>``), ``fork``: what the launcher did before, which cannot use CUDA.

    python benchmarks/worker_start.py [--trials 3] [--nproc 2] [--growth] [--before DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.contract import launch_command
from tests.drill_harness import events, trainer_args
from trainctl.backends.local_cluster import Agent, LocalEtcd, wait_until

REPO = Path(__file__).resolve().parent.parent


def command(endpoint: str, run_id: str, nproc: int, start_method: str, max_nodes: int = 1) -> list[str]:
    argv = launch_command(min_nodes=1, max_nodes=max_nodes, nproc_per_node=nproc, endpoint=endpoint, run_id=run_id,
                          max_restarts=10, local_addr="127.0.0.1", python=sys.executable, grace_period_s=60)
    argv = [arg for arg in argv if not arg.startswith("--start-method")]
    position = argv.index("-m", 2)  # the program's -m: the launcher's own flags end there
    return [*argv[:position], f"--start-method={start_method}", *argv[position:]]


def steps_after(work: Path, moment: float, world: int | None = None) -> list[dict]:
    return [e for e in events(work, "step") if e["time"] > moment and (world is None or e["world_size"] == world)]


def rejoined(work: Path, moment: float) -> float:
    """When the first worker rendezvous after ``moment`` happened (infinity: not yet)."""
    return min((e["time"] for e in events(work, "rendezvous") if e["time"] > moment), default=float("inf"))


def one_node(endpoint: str, method: str, nproc: int, cwd: Path) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        args = [*trainer_args(work, 400_000), "--train.log_every_steps=1"]
        run = f"start-{method}-{time.monotonic_ns()}"
        started = time.time()
        agent = Agent("a", endpoint, run, work, args, command=command(endpoint, run, nproc, method), cwd=cwd,
                      env={"PYTHONPATH": str(cwd)})
        try:
            first = wait_until(lambda: steps_after(work, started), "the first step", 300, [agent])[0]["time"]
            time.sleep(2)
            crashed = agent.kill_workers()
            # The restarted workers' first report: a step after the round they joined (the agent gives a
            # restart after progress back to --max-restarts, so restart_count stays 0).
            again = wait_until(lambda: [e for e in steps_after(work, rejoined(work, crashed))],
                               "a step after the restart", 300, [agent])[0]["time"]
        finally:
            agent.stop()
        return first - started, again - crashed


def admission(endpoint: str, method: str, cwd: Path, in_place: bool) -> float:
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        args = [*trainer_args(work, 400_000), "--train.log_every_steps=1"]
        run = f"grow-{method}-{in_place}-{time.monotonic_ns()}"
        env = {"PYTHONPATH": str(cwd), **({} if in_place else {"PLATFORM_REGROUP_IN_PLACE": "0"})}
        agents = [Agent(name, endpoint, run, work, args, env=env, cwd=cwd,
                        command=command(endpoint, run, 1, method, max_nodes=3)) for name in "ab"]
        try:
            wait_until(lambda: len(steps_after(work, 0, 2)) >= 20, "two nodes training", 300, agents)
            agents.append(Agent("c", endpoint, run, work, args, env=env, cwd=cwd,
                                command=command(endpoint, run, 1, method, max_nodes=3)))
            first_big = wait_until(lambda: steps_after(work, 0, 3), "three nodes training", 300, agents)[0]["time"]
            last_small = max(e["time"] for e in steps_after(work, 0, 2) if e["time"] < first_big)
        finally:
            for agent in agents:
                agent.stop()
        return first_big - last_small


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--growth", action="store_true", help="also the survivors' pause on an admission")
    parser.add_argument("--before", type=Path, help="a checkout of the launcher that forked its workers")
    args = parser.parse_args()
    ways = [("forkserver", "forkserver", REPO), ("spawn", "spawn", REPO)]
    if args.before:
        ways.insert(0, ("fork (before)", "fork", args.before.resolve()))
    with LocalEtcd() as endpoint:
        growth = " admission pause, in place / restart (s) |" if args.growth else ""
        print(f"| workers | first step (s) | restart → next step (s) |{growth}")
        print(f"|---|---|---|{'---|' if args.growth else ''}")
        for name, method, cwd in ways:
            firsts, restarts = [], []
            for _ in range(args.trials):
                first, restart = one_node(endpoint, method, args.nproc, cwd)
                firsts.append(first)
                restarts.append(restart)
            row = (f"| {name} | {statistics.median(firsts):.2f} ({min(firsts):.2f}-{max(firsts):.2f}) "
                   f"| {statistics.median(restarts):.2f} ({min(restarts):.2f}-{max(restarts):.2f}) |")
            if args.growth:
                row += f" {admission(endpoint, method, cwd, True):.2f} / {admission(endpoint, method, cwd, False):.2f} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
