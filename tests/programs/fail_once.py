"""A torchrun program of a job's own that fails for good once, after a checkpoint, on one node only.

Rank 0 writes ``$PLATFORM_CHECKPOINT_DIR/step-1`` (progress, for the launcher) and exits 1; with
``max_restarts: 0`` its launcher then asks for a fresh incarnation (exit 79) while the other node's
launcher is stopped by srun (exit 143). The fresh incarnation finds the checkpoint and ends at once.
It imports nothing: it only needs torchrun's RANK and the platform's checkpoint folder.
"""

import os
import sys
import time
from pathlib import Path

checkpoints = Path(os.environ["PLATFORM_CHECKPOINT_DIR"])
if (checkpoints / "step-1").exists():
    print(f"rank {os.environ['RANK']}: resumed from step-1, done", flush=True)
    sys.exit(0)
if os.environ["RANK"] == "0":
    (checkpoints / "step-1").mkdir(parents=True)
    print("rank 0: checkpoint step-1 written, failing for good", flush=True)
    sys.exit(1)
time.sleep(600)  # until srun stops this node's launcher
