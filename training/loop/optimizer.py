"""The optimizer and its parameter groups: weight decay for the weights of convolutions, linear
layers and embeddings, none for biases and normalization layers, as the reference recipes do."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from training.config import OptimSection

# Normalization layers, whose weights (scales) and biases are not decayed: torchvision's
# split_normalization_params (torchvision/ops/_utils.py, v0.28.0), which its classification
# recipes apply with --norm-weight-decay 0.0, plus LayerNorm's relatives. Hugging Face's Trainer
# excludes nn.LayerNorm by type the same way (transformers 5.23, trainer.py,
# get_decay_parameter_names; pytorch_utils.py, ALL_LAYERNORM_LAYERS).
NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.LayerNorm, nn.GroupNorm,
               nn.RMSNorm, nn.LocalResponseNorm)


def is_decayed(module: nn.Module, name: str) -> bool:
    """Does weight decay apply to ``module``'s own parameter ``name``? Not to a normalization
    layer's, nor to a bias (any parameter whose name says bias, as Hugging Face's rule reads
    names: BERT's ``mlm_bias`` too)."""
    return not isinstance(module, NORM_LAYERS) and "bias" not in name.lower()


def parameter_groups(module: nn.Module, weight_decay: float, decay_all: bool = False) -> list[dict[str, Any]]:
    """Two groups, in the module's order within each: the decayed parameters, then the others
    (weight decay 0); with ``decay_all`` one group of every parameter, decayed."""
    if decay_all:
        return [{"params": list(module.parameters()), "weight_decay": weight_decay}]
    decayed, kept = [], []
    seen: set[int] = set()
    for child in module.modules():
        for name, parameter in child.named_parameters(recurse=False):
            if id(parameter) in seen:  # shared (tied) parameters belong to their first owner
                continue
            seen.add(id(parameter))
            (decayed if is_decayed(child, name) else kept).append(parameter)
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]


def build_optimizer(module: nn.Module, optim: OptimSection, fused: bool = False) -> torch.optim.Optimizer:
    """``fused``: one kernel per update that can be skipped on the device (its ``found_inf``, see
    training/loop/lost_peer.py); CPU and CUDA kernels in torch 2.8 to 2.14 (native_functions.yaml,
    ``_fused_sgd_``, ``_fused_adamw_``). Otherwise torch's default (foreach on CUDA)."""
    groups = parameter_groups(module, optim.weight_decay, optim.decay_norms_and_biases)
    implementation = {"fused": True} if fused else {}
    if optim.name == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay,
                               **implementation)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, **implementation)


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any], module: nn.Module) -> None:
    """Load a checkpoint's optimizer state, also one written with the other grouping (one group:
    written before the groups existed, or with ``optim.decay_norms_and_biases``; two: without).

    An optimizer's state is keyed by each parameter's position across its groups in order, so a
    state written under the other grouping is renumbered by parameter; the groups' settings
    (weight decay) are this job's, and so is the implementation (fused or not): torch's
    ``load_state_dict`` takes every setting of the saved groups, ``fused`` and ``foreach`` too
    (torch 2.13 torch/optim/optimizer.py, ``update_group``).
    """
    implementation = [{key: group.get(key) for key in ("fused", "foreach")} for group in optimizer.param_groups]
    _load_grouped(optimizer, saved, module)
    for group, kept in zip(optimizer.param_groups, implementation, strict=True):
        group.update(kept)
        # torch placed Adam's step counts by the saved groups' settings (on the host, unless they were
        # fused or capturable: torch 2.13 optimizer.py _process_value_according_to_param_policy): placed
        # again by this job's. The fused kernels take them on the parameters' device (else "Expected all
        # tensors to be on the same device"), the others on the host (else an .item() per parameter).
        for parameter in group["params"]:
            state = optimizer.state.get(parameter, {})
            if isinstance(state.get("step"), torch.Tensor):
                device = parameter.device if kept["fused"] else torch.device("cpu")
                state["step"] = state["step"].to(device=device, dtype=torch.float32)


def _load_grouped(optimizer: torch.optim.Optimizer, saved: dict[str, Any], module: nn.Module) -> None:
    if len(saved["param_groups"]) == len(optimizer.param_groups):
        optimizer.load_state_dict(saved)
        return
    weight_decay = optimizer.param_groups[0]["weight_decay"]
    written = [p for group in parameter_groups(module, weight_decay, len(saved["param_groups"]) == 1)
               for p in group["params"]]
    position = {id(p): i for i, p in enumerate(written)}
    here = [p for group in optimizer.param_groups for p in group["params"]]
    if len(written) != len(here) or any(id(p) not in position for p in here):
        optimizer.load_state_dict(saved)  # not a grouping of these parameters: torch says what differs
        return
    state = {new: saved["state"][position[id(p)]] for new, p in enumerate(here) if position[id(p)] in saved["state"]}
    converted = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": converted["param_groups"]})
