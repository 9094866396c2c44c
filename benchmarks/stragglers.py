"""Stragglers on loopback: false alarms in a healthy job, and how soon a throttled node is named.

Real agents (CPU, gloo, the drills' MLP) and a real etcd (tests.drill_harness.straggler_drill).
The job trains healthy for --healthy-s seconds: every ``straggler`` event then is a false alarm.
Then the last node's workers get --share of their CPU time (stopped and continued in turn every
50 ms, as a CPU quota does) for --slowed-s seconds: the report windows until the event that names
that node's pod, and the job's step time before and while it is slowed.

    python benchmarks/stragglers.py --agents 8 --healthy-s 600 --slowed-s 60
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.drill_harness import events, straggler_drill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--healthy-s", type=float, default=600)
    parser.add_argument("--slowed-s", type=float, default=60)
    parser.add_argument("--share", type=float, default=0.25)
    parser.add_argument("--log-every-steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        result = straggler_drill(work, args.agents, args.healthy_s, args.slowed_s, args.log_every_steps, args.share)
        steps = [e for e in events(work, "step") if e["world_size"] == args.agents]
        before = [e["step_time_s"] for e in steps if e["step"] <= result.slowed_at_step]
        after = [e["step_time_s"] for e in steps if e["step"] > result.slowed_at_step]
        named_right = bool(result.named_slowed) and all(e["pod"] == result.slowed_pod for e in result.named_slowed)
    print(f"| agents | healthy | reports | false alarms | throttled to | named | reports to name | "
          f"step time healthy -> throttled |\n|---|---|---|---|---|---|---|---|\n"
          f"| {args.agents} | {args.healthy_s / 60:.1f} min | {len(before)} | {len(result.named_healthy)} | "
          f"{args.share:.0%} CPU | {'yes, ' + result.slowed_pod if named_right else 'no'} | "
          f"{result.windows_to_name if result.windows_to_name is not None else '-'} | "
          f"{statistics.median(before) if before else 0:.4f} s -> {statistics.median(after) if after else 0:.4f} s |")


if __name__ == "__main__":
    main()
