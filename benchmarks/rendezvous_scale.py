"""The rendezvous at scale by simulation: N agents' rendezvous handlers against a real three-member etcd.

Each simulated agent is what a pod's agent does with the rendezvous, with no trainer and no workers:
the platform's real handler (training/launcher/rendezvous.py, the shipped tuning), torch's own rank
assignment through the agents' store (``SimpleElasticAgent._assign_worker_ranks`` on the round's
EtcdStore, the pinned torch's code), then the agent's monitor loop (``num_nodes_waiting`` every 0.1 s,
torchrun's ``--monitor-interval``), and a new round when it says so. Many agents run as threads of one
process (``--processes`` of them); one extra process holds a single agent, the one SIGKILLed.

For each N: all arrive at once, then the job trains ``--steady`` seconds at full size, then the
single agent's process is SIGKILLed. Measured: time to the full world (every agent back from its
rendezvous with world N and its worker ranks), etcd writes (Raft proposals committed) and reads a second
while steady, etcd's CPU (the three members, summed) and memory (the largest member), bytes etcd sends
its clients a second, the ``state`` key's size, and the SIGKILL -> every survivor in the next round.
``--spread S`` also runs each N with arrivals spread evenly over S seconds (min_nodes 1, so the job
starts small and admits the rest in batches): the time from the last arrival to the full world.

The simulator shares the machine with etcd: on a 2-core machine its agents' checks fall behind
beyond a few hundred agents, and ``check lag`` (how late, at the 99th percentile, an agent's monitor
loop ran against its 0.1 s period) says when the figures are the simulator's rather than etcd's.

    python benchmarks/rendezvous_scale.py [--sizes 64,256,1024] [--steady 30] [--spread 0] [--processes 8]

Costs are fitted as a power of N (log-log least squares) over the sizes run.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import queue
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.drill_harness import ETCD_COUNTERS, etcd_metrics  # after the path insert: run as a script
from training.contract import PLATFORM_TUNING

MONITOR_INTERVAL_S = 0.1
MEASURED = (*ETCD_COUNTERS, "process_resident_memory_bytes", "etcd_network_client_grpc_sent_bytes_total")


def _assign_ranks(store, rank: int, world_size: int) -> None:
    """torch's own rank assignment (agent/server/api.py, SimpleElasticAgent._assign_worker_ranks): each
    agent writes its role, rank 0 reads all and writes everyone's ranks, each reads its own."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec

    spec = WorkerSpec(role="trainer", local_world_size=8, rdzv_handler=None, entrypoint="train.py")
    SimpleElasticAgent._assign_worker_ranks(_AGENT_STUB, store, rank, world_size, spec)


class _AgentStub:
    """``self`` of the unbound call above: the method reads nothing of it (torch 2.13, 2.14)."""


_AGENT_STUB = _AgentStub()


def _agents(indices: list[int], starts: list[float], endpoints: str, run_id: str, min_nodes: int, max_nodes: int,
            events: multiprocessing.Queue, stop_file: str) -> None:
    """One process of simulated agents: a thread each, agent ``indices[i]`` starting at ``starts[i]``, until
    ``stop_file`` exists (a file, not a multiprocessing.Event: its set() can hang on waiters that died)."""
    import logging

    from training.launcher.etcd_v3 import EtcdClient
    from training.launcher.rendezvous import EtcdRendezvousHandler

    logging.basicConfig(level=logging.ERROR)
    lags: list[float] = []
    stop = threading.Event()

    def agent(index: int, at: float) -> None:
        time.sleep(max(0.0, at - time.time()))
        handler = EtcdRendezvousHandler(run_id, min_nodes, max_nodes,
                                        EtcdClient(endpoints, timeout_s=PLATFORM_TUNING.read_timeout),
                                        PLATFORM_TUNING, local_addr="127.0.0.1")
        events.put(("arrived", index, time.time()))
        try:
            while not stop.is_set():
                info = handler.next_rendezvous()
                _assign_ranks(info.store, info.rank, info.world_size)
                events.put(("round", index, time.time(), info.world_size, info.rank))
                due = time.monotonic() + MONITOR_INTERVAL_S
                while not stop.is_set():
                    time.sleep(max(0.0, due - time.monotonic()))
                    lags.append(time.monotonic() - due)
                    due = time.monotonic() + MONITOR_INTERVAL_S
                    if handler.num_nodes_waiting() > 0:
                        break
        except Exception as error:  # noqa: BLE001 - reported: the benchmark says which agent failed and how
            events.put(("failed", index, time.time(), f"{type(error).__name__}: {error}"))
        finally:
            if stop.is_set():
                handler.shutdown()

    threads = [threading.Thread(target=agent, args=(index, at), daemon=True) for index, at in zip(indices, starts, strict=True)]
    for thread in threads:
        thread.start()
    while not os.path.exists(stop_file):
        time.sleep(1.0)
        if lags:
            taken = sorted(lags)
            lags.clear()
            events.put(("lag", indices[0], time.time(), taken[int(0.99 * (len(taken) - 1))]))
    stop.set()  # the threads are daemons: one still waiting in a rendezvous ends with the process
    time.sleep(2 * MONITOR_INTERVAL_S)


@dataclass
class Result:
    agents: int
    arrivals: str
    full_world_s: float | None = None  # from the first arrival (at once) or the last (spread)
    steady_writes_per_s: float | None = None
    steady_reads_per_s: float | None = None
    etcd_cpu_pct: float | None = None  # of one core, the three members summed
    etcd_memory_mib: float | None = None  # the largest member
    etcd_sent_mb_per_s: float | None = None
    state_bytes: int | None = None
    kill_to_next_round_s: float | None = None
    check_lag_p99_s: float | None = None
    failures: list[str] = field(default_factory=list)


class Run:
    def __init__(self, size: int, processes: int, spread_s: float, steady_s: float):
        self.size, self.processes, self.spread_s, self.steady_s = size, processes, spread_s, steady_s
        self.stop_file = Path(tempfile.mkdtemp(prefix="rendezvous-scale-")) / "stop"
        self.rounds: dict[int, tuple[float, int]] = {}  # agent -> (time, world size) of its newest round
        self.arrived: dict[int, float] = {}
        self.lags: list[float] = []
        self.failures: list[str] = []

    def drain(self, until: float, done=lambda: False) -> bool:
        said = time.time()
        while time.time() < until:
            if time.time() - said > 15:
                said = time.time()
                sizes = statistics.multimode(w for _, w in self.rounds.values()) if self.rounds else []
                print(f"  {len(self.arrived)} arrived, {len(self.rounds)} in a round (most at size {sizes[:1]})",
                      file=sys.stderr, flush=True)
            try:
                kind, index, at, *rest = self.events.get(timeout=0.2)
            except queue.Empty:
                if done():
                    return True
                continue
            if kind == "arrived":
                self.arrived[index] = at
            elif kind == "round":
                self.rounds[index] = (at, rest[0])
            elif kind == "lag":
                self.lags.append(rest[0])
            elif kind == "failed":
                self.failures.append(f"agent {index}: {rest[0]}"[:300])
                print(f"  {self.failures[-1]}", file=sys.stderr, flush=True)
            if done():
                return True
        return done()

    def full(self, agents: set[int], size: int) -> bool:
        return all(self.rounds.get(a, (0, 0))[1] == size for a in agents)

    def run(self, endpoints: str, leader_metrics: list[str]) -> Result:
        result = Result(self.size, "at once" if not self.spread_s else f"over {self.spread_s:.0f} s")
        run_id = f"scale-{self.size}-{int(time.time())}"
        min_nodes = 1 if self.spread_s else self.size - 1
        # Arrivals: the single agent (the one killed) first, the rest evenly over the spread; 10 s for the
        # processes to import torch first.
        starts = [time.time() + 10 + (self.spread_s * i / max(1, self.size - 1)) for i in range(self.size)]
        context = multiprocessing.get_context("spawn")
        self.events = context.Queue()
        groups = [[0], *(list(range(1 + p, self.size, self.processes)) for p in range(self.processes))]
        procs = []
        for group in (g for g in groups if g):
            proc = context.Process(target=_agents, args=(group, [starts[i] for i in group], endpoints, run_id,
                                                         min_nodes, self.size, self.events, str(self.stop_file)))
            proc.start()
            procs.append(proc)
        everyone = set(range(self.size))
        try:
            limit = max(starts) + 600
            if not self.drain(limit, lambda: len(self.arrived) == self.size and self.full(everyone, self.size)):
                result.failures = self.failures or [f"no full world in {limit - starts[0]:.0f} s: "
                                                    f"{sum(1 for a in everyone if self.rounds.get(a, (0, 0))[1] == self.size)} "
                                                    "agents at full size"]
                return result
            reference = max(self.arrived.values()) if self.spread_s else min(self.arrived.values())
            result.full_world_s = round(max(t for t, _ in self.rounds.values()) - reference, 2)
            self.drain(time.time() + 5)  # the first checks after the round
            self.lags.clear()
            before = [etcd_metrics(m, MEASURED) for m in leader_metrics]
            began = time.time()
            self.drain(began + self.steady_s)
            after = [etcd_metrics(m, MEASURED) for m in leader_metrics]
            span = time.time() - began

            def delta(name: str, pick=max) -> float:
                return pick(a.get(name, 0) - b.get(name, 0) for a, b in zip(after, before, strict=True))

            result.steady_writes_per_s = round(delta("etcd_server_proposals_committed_total") / span, 2)
            result.steady_reads_per_s = round(delta("etcd_mvcc_range_total", sum) / span, 1)
            result.etcd_cpu_pct = round(100 * delta("process_cpu_seconds_total", sum) / span, 1)
            result.etcd_memory_mib = round(max(a["process_resident_memory_bytes"] for a in after) / 2**20, 1)
            result.etcd_sent_mb_per_s = round(delta("etcd_network_client_grpc_sent_bytes_total", sum) / span / 1e6, 2)
            result.check_lag_p99_s = round(max(self.lags), 3) if self.lags else None
            result.state_bytes = _state_bytes(endpoints, run_id)
            # SIGKILL the process of agent 0 alone: the survivors' next round has size - 1 members.
            killed_at = time.time()
            os.kill(procs[0].pid, signal.SIGKILL)
            survivors = everyone - {0}
            if self.drain(killed_at + 120, lambda: all(self.rounds[a][0] > killed_at and self.rounds[a][1] == self.size - 1
                                                       for a in survivors)):
                result.kill_to_next_round_s = round(max(self.rounds[a][0] for a in survivors) - killed_at, 2)
            result.failures = self.failures
            return result
        finally:
            self.stop_file.touch()
            for proc in procs:
                proc.join(timeout=20)
                if proc.is_alive():
                    proc.kill()


def _state_bytes(endpoints: str, run_id: str) -> int | None:
    from training.launcher.etcd_v3 import EtcdClient
    from training.launcher.rendezvous import KEY_ROOT

    kv = EtcdClient(endpoints).get(f"{KEY_ROOT}/{run_id}/state")
    return len(kv.value) if kv else None


def fitted_exponent(sizes: list[int], values: list[float | None]) -> str:
    points = [(math.log(n), math.log(v)) for n, v in zip(sizes, values, strict=True) if v]
    if len(points) < 2:
        return "-"
    mean_x, mean_y = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return f"N^{slope:.2f}"


COLUMNS = [("full world s", "full_world_s"), ("writes/s", "steady_writes_per_s"), ("reads/s", "steady_reads_per_s"),
           ("etcd CPU %", "etcd_cpu_pct"), ("etcd MiB", "etcd_memory_mib"), ("sent MB/s", "etcd_sent_mb_per_s"),
           ("state B", "state_bytes"), ("kill->round s", "kill_to_next_round_s"), ("check lag p99 s", "check_lag_p99_s")]


def main() -> None:
    from trainctl.backends.local_cluster import LocalEtcdCluster

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1024", help="agent counts, comma separated")
    parser.add_argument("--steady", type=float, default=30.0, help="seconds at full size measured")
    parser.add_argument("--spread", type=float, default=0.0, help="also run each size with arrivals over this long")
    parser.add_argument("--processes", type=int, default=8, help="processes the agents' threads share")
    args = parser.parse_args()
    print(f"tuning: {PLATFORM_TUNING.conf()}", flush=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    results: list[Result] = []
    for spread in [0.0, *([args.spread] if args.spread else [])]:
        for size in sizes:
            with LocalEtcdCluster(3) as endpoints:
                result = Run(size, args.processes, spread, args.steady).run(endpoints, endpoints.split(","))
            results.append(result)
            print(json.dumps(asdict(result)), flush=True)
    print("\n| agents | arrivals | " + " | ".join(title for title, _ in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for r in results:
        cells = [("-" if getattr(r, key) is None else f"{getattr(r, key):g}") for _, key in COLUMNS]
        failures = f" failures: {r.failures[:3]}" if r.failures else ""
        print(f"| {r.agents} | {r.arrivals} | " + " | ".join(cells) + " |" + failures)
    once = [r for r in results if r.arrivals == "at once"]
    if len(once) >= 2:
        print("| growth | | " + " | ".join(fitted_exponent([r.agents for r in once], [getattr(r, key) for r in once])
                                          for _, key in COLUMNS) + " |")


if __name__ == "__main__":
    main()
