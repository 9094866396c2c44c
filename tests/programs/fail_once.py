"""A torchrun program of a job's own whose node 0 fails for good after progress, while node 1 lives on.

- Round 0 of the first incarnation: rank 0 writes ``$PLATFORM_CHECKPOINT_DIR/step-1`` (progress),
  every rank meets it in a barrier and exits 1: each launcher restarts its workers, free of
  ``--max-restarts`` because the job progressed.
- Round 1 (the checkpoint is there): rank 0 exits 1 at once, without progress, and its launcher (``max_restarts: 0``) asks for
  a fresh incarnation: exit 79. Rank 1 sleeps: srun stops its launcher (exit 143) and reports 143.
- The next incarnation (SLURM_RESTART_COUNT 1) finds the checkpoint and ends at once.

Apart from the barrier it needs only torchrun's environment and the platform's checkpoint folder.
"""

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

rank = int(os.environ["RANK"])
checkpoints = Path(os.environ["PLATFORM_CHECKPOINT_DIR"])
if os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
    print(f"rank {rank}: a fresh incarnation finds {sorted(p.name for p in checkpoints.iterdir())}, done", flush=True)
    sys.exit(0)
if not (checkpoints / "step-1").exists():  # round 0: every rank decides before rank 0 writes it
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if rank == 0:
        (checkpoints / "step-1").mkdir(parents=True)
    dist.barrier()
    print(f"rank {rank}: step-1 written, failing", flush=True)
    sys.exit(1)
if rank == 0:
    print("rank 0: failing for good", flush=True)
    sys.exit(1)
time.sleep(600)  # until srun stops this node's launcher
