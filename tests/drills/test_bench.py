"""The bare loop, the reference every trainer figure is a ratio of: the trainer's optimizer, and
it does not learn its one batch (so it cannot slow down)."""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from training.config import load_train_config
from training.diagnostics.throughput import bare_loop

# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = pytest.mark.untimed


def _config(optimizer: str, *more: str):
    return load_train_config(None, [
        "--model.name=mlp", "--model.image_size=16", "--model.num_classes=1000", "--train.micro_batch_size=8",
        "--train.precision=fp32", "--train.device=cpu", f"--optim.name={optimizer}", *more,
    ])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_bare_loop_does_not_learn_its_one_batch(optimizer):
    # Trained on one batch, a loop learns it: loss and gradients sink into subnormal floats,
    # which x86 cores compute several times slower (this loop fell to 0.42-0.45 of its early rate
    # by steps 100-300 when it still learnt). A reference that slows down flatters the trainer.
    # So the bare loop steps with learning rate 0: the same loss at step 300 as at step 1, with
    # either optimizer (AdamW's weight decay too is scaled by the rate). (Its rate is the
    # benchmark's business, not this suite's: on a shared machine a rate is noise.)
    losses: list = []
    bare_loop(_config(optimizer, "--optim.weight_decay=0.05"), steps=200, warmup=100, losses=losses)
    assert len(losses) == 300 and losses[0].item() > 1.0
    assert {loss.item() for loss in losses} == {losses[0].item()}


def _settings(optimizer: torch.optim.Optimizer):
    """Everything that decides what a step computes, but the learning rate."""
    return type(optimizer), [
        {**{k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")},
         "shapes": [tuple(p.shape) for p in group["params"]]}
        for group in optimizer.param_groups]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_bare_loop_steps_the_trainers_optimizer_at_rate_zero(optimizer, tmp_path):
    from training.loop.trainer import Trainer

    config = _config(optimizer, f"--checkpoint.dir={tmp_path}", f"--metrics.jsonl_path={tmp_path}/metrics.jsonl")
    stepped = []
    # torch's hook on every optimizer's step (torch/optim/optimizer.py, v2.13.0): the optimizer the loop really steps.
    handle = register_optimizer_step_post_hook(
        lambda opt, args, kwargs: stepped.append((opt, [group["lr"] for group in opt.param_groups])))
    try:
        bare_loop(config, steps=2, warmup=1)
    finally:
        handle.remove()
    assert len(stepped) == 3 and len({id(opt) for opt, _ in stepped}) == 1
    reference, rates = stepped[0]
    assert set(rates) == {0.0}
    trainers = Trainer(config).optimizer
    assert _settings(reference) == _settings(trainers)  # class, groups (no decay on biases), betas or momentum
    assert len(trainers.param_groups) == 2
