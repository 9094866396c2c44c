"""Median wall time of a full offline synth, through the pinned CDK CLI and `python app.py`.

    make benchmark            # or: .venv/bin/python benchmarks/synth_time.py --runs 5

Both paths run side by side in one process, each into a fresh output directory, with no
AWS credentials; the ratio shows what the CLI adds over the app itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def offline_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CDK_"))}
    env.update(
        PATH=f"{REPO / 'node_modules' / '.bin'}:{Path(sys.executable).parent}:{env.get('PATH', '')}",
        AWS_EC2_METADATA_DISABLED="true",
        CDK_DISABLE_CLI_TELEMETRY="true",
    )
    return env


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--config", default="config/example.yaml")
    args = parser.parse_args()
    env = offline_env()
    cli = str(REPO / "node_modules" / ".bin" / "cdk")
    samples: dict[str, list[float]] = {"cdk synth (pinned CLI)": [], "python app.py": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):  # interleaved, so drift affects both alike
            out = Path(tmp) / f"run{i}"
            samples["cdk synth (pinned CLI)"].append(
                timed([cli, "synth", "--quiet", "-o", str(out / "cli"), "-c", f"config={args.config}"], env)
            )
            samples["python app.py"].append(
                timed([sys.executable, "app.py", "-o", str(out / "py"), "-c", f"config={args.config}"], env)
            )
    print(f"full offline synth of {args.config}, {args.runs} runs each, {os.cpu_count()} CPUs")
    medians = {}
    for name, values in samples.items():
        medians[name] = statistics.median(values)
        print(f"  {name:24s} median {medians[name]:6.2f} s   min {min(values):6.2f} s   max {max(values):6.2f} s")
    cli_median, app_median = medians.values()
    print(f"  ratio CLI / python app.py: {cli_median / app_median:.2f}")


if __name__ == "__main__":
    main()
