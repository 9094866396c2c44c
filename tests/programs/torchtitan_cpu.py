"""torchtitan's own trainer (torchtitan==0.3.0, tests/requirements-torchtitan.txt) on CPU with gloo, as far as it goes.

Run by torchrun (the platform's launcher in tests/drills/test_torchtitan_cpu.py) as a script, with
torchtitan's own flags: ``--module torchtitan_cpu --config llama3_debugmodel_cpu ...``; torchtitan
then imports this file again as the config registry (torchtitan/config/manager.py,
``_load_config``: a fully qualified module name is imported as is), where only
:func:`llama3_debugmodel_cpu` is used.

torchtitan 0.3.0 does not train on CPU as released. Each patch below names the upstream line that
stops it; none changes what is computed, only which device API is asked:

1. torchtitan/tools/utils.py:55 ``device_type = _get_available_device_type() or "cuda"``: with no
   accelerator torch returns None (torch/_utils.py, ``_get_available_device_type``) and torchtitan
   takes CUDA, so trainer.py:301 ``device_module.set_device`` fails in a CPU build. Patched: "cpu".
2. torchtitan/components/metrics.py:42-50 ``DeviceMemoryMonitor`` asks the device module for its
   name, properties and memory statistics; ``torch.cpu`` has none of them. Patched: constants.
3. torchtitan/distributed/utils.py:586 ``barrier(device_ids=[device_module.current_device()])``:
   ``torch.cpu.current_device()`` is the string "cpu" (torch/cpu/__init__.py), not an index.
   Patched: 0 (gloo ignores device_ids).
4. torchtitan/distributed/fsdp.py:41 ``set_gradient_divide_factor(1.0)`` makes FSDP2 reduce-scatter
   with ``ReduceOp.PREMUL_SUM`` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:850),
   which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). Patched: FSDP's own
   ``force_sum_reduction_for_comms`` (a SUM and a division by the same factor, 1.0).
5. torchtitan/distributed/utils.py:595 calls ``torch.distributed.set_timeout``, new in torch 2.14
   (torch/distributed/distributed_c10d.py there); torch 2.13 has the same operation as
   ``_set_pg_timeout``. Patched only where missing: torchtitan 0.3.0 wants torch >= 2.14.

And one setting, in the config below rather than a patch: torchtitan's language-model attention
backends are flex, flex_flash and varlen (torchtitan/models/common/config_utils.py:83-101, "sdpa
is no longer supported for language models"); FlexAttention has no backward on CPU (torch
2.13/2.14 torch/nn/attention/flex_attention.py ``_validate_device``), varlen_attn calls
``aten::_flash_attention_forward`` (CUDA only) and flex_flash needs Hopper. The maskless
``ScaledDotProductAttention`` torchtitan keeps (trainer.py:732-748 builds no masks for it) runs on
CPU: causal attention over the packed sequence instead of per-document masks.

And outside torchtitan: ``spmd_backend`` is left at its default (spmd_types) on GPU; on CPU its
FSDP2 path stops in ``fully_shard`` (torch 2.13 _fsdp_param.py:346, "all parameters must be
DTensors on the full SPMD mesh"), so the test passes ``--parallelism.spmd_backend partial_dtensor``.

``TITAN_STEP_SECONDS`` paces the steps (a sleep after each), so that a test can act between two
checkpoints; it changes nothing trained.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import types


def llama3_debugmodel_cpu():
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _patch_for_cpu() -> None:
    import torch
    import torch._utils
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    from torch.distributed.distributed_c10d import _set_pg_timeout

    torch._utils._get_available_device_type = lambda: "cpu"  # 1
    cpu = torch.cpu
    cpu.get_device_name = lambda *_a, **_k: "cpu"  # 2
    cpu.get_device_properties = lambda *_a, **_k: types.SimpleNamespace(name="cpu", total_memory=1 << 34)
    cpu.memory_stats = lambda *_a, **_k: {}
    cpu.reset_peak_memory_stats = lambda *_a, **_k: None
    cpu.empty_cache = lambda *_a, **_k: None
    cpu.current_device = lambda: 0  # 3

    divide_factors = collectives._get_gradient_divide_factors

    def sum_only(group, all_reduce_group, dtype, device_type="", factor=None, _force=False):  # 4
        return divide_factors(group, all_reduce_group, dtype, device_type, factor, True)

    collectives._get_gradient_divide_factors = sum_only
    if not hasattr(dist, "set_timeout"):  # 5
        dist.set_timeout = _set_pg_timeout


def _pace(seconds: float) -> None:
    from torchtitan.trainer import Trainer

    train_step = Trainer.train_step

    def paced(self, *args, **kwargs):
        result = train_step(self, *args, **kwargs)
        time.sleep(seconds)
        return result

    Trainer.train_step = paced


if __name__ == "__main__":
    _patch_for_cpu()
    if os.environ.get("TITAN_STEP_SECONDS"):
        _pace(float(os.environ["TITAN_STEP_SECONDS"]))
    sys.argv[0] = "torchtitan.train"
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
