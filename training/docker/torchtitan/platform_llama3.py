"""torchtitan 0.3.0 configs for this platform: Llama 3.1 8B pretraining on p5 (or p4d) nodes.

torchtitan 0.3.0 has no TOML files: a config is a Python function in a "config registry" module,
named on the command line (``--module platform_llama3 --config llama3_8b_platform``), and any
field can still be overridden there (``--training.steps 2000``); torchtitan/config/manager.py
imports a fully qualified module name as is. This file is baked into the image
(training/docker/Dockerfile.torchtitan, WORKDIR /workspace: ``python -m`` puts the working
directory on sys.path) and used by k8s_charts/examples/llama3-8b-torchtitan-p5.yaml.

What it sets on top of torchtitan's own ``llama3_8b`` (torchtitan/models/llama3/config_registry.py):

- FSDP2 over every rank (``data_parallel_shard_degree=-1``: all that is left after TP/PP, which
  are 1), bf16 parameters and fp32 gradient reduction (``mixed_precision_param`` /
  ``mixed_precision_reduce``, torchtitan/config/configs.py TrainingConfig);
- activation checkpointing: torchtitan's selective (per-op) policy, as its 8B config does
  (``FullAC`` trades more recomputation for memory at longer sequences);
- torch.compile of the model and the loss (``CompileConfig(enable=True)``);
- DCP checkpoints in the job's checkpoint folder on FSx, ``$PLATFORM_CHECKPOINT_DIR`` (the
  platform sets it from the spec's checkpoint_path): step-N folders the platform's launcher
  counts as progress. DCP saves each rank's shards with a global plan, so a restart at another
  world size (a node lost, min_nodes..max_nodes) reshards on load. torchtitan's dataloader
  state cannot be resharded (torchtitan/components/dataloader.py:161 asserts the same
  dp degree), so it is left out of loading: after a resize the data stream starts over with a
  new seed-derived order. Model, optimizer, LR schedule and step are restored.
"""

from __future__ import annotations

import os
import sys

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.config import CompileConfig, ParallelismConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.llama3.config_registry import llama3_8b
from torchtitan.trainer import Trainer

CHECKPOINT_DIR_ENV = "PLATFORM_CHECKPOINT_DIR"  # training/contract.py CHECKPOINT_DIR_ENV (not importable here)
EXIT_CONFIG = 78  # training/contract.py EXIT_CONFIG: a config error, not retried


def llama3_8b_platform() -> Trainer.Config:
    config = llama3_8b()
    # The tokenizer (and, for fine-tuning, the weights) on FSx: scripts/download_hf_assets.py of
    # torchtitan, or huggingface-cli, into this folder once.
    # The job spec's env names it (the example: under /fsx/models); no default path here, so a
    # spec without it stops at once with exit 78, which the platform does not retry.
    if not os.environ.get("LLAMA3_ASSETS"):
        print("LLAMA3_ASSETS: not set; allowed: the folder of the tokenizer on the shared file system, "
              "set in the job spec's env", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)
    config.hf_assets_path = os.environ["LLAMA3_ASSETS"]
    config.training.mixed_precision_param = "bfloat16"
    config.training.mixed_precision_reduce = "float32"
    config.parallelism = ParallelismConfig(data_parallel_shard_degree=-1)
    config.activation_checkpoint = SelectiveAC.Config()
    config.compile = CompileConfig(enable=True)
    config.checkpoint = CheckpointManager.Config(
        enable=True,
        folder=os.environ[CHECKPOINT_DIR_ENV],  # absolute: not joined to dump_folder
        interval=500,
        keep_latest_k=3,
        last_save_model_only=False,  # the last checkpoint resumes too
        exclude_from_loading=["dataloader"],
    )
    config.profiler.enable_profiling = False
    return config
