"""The bare loop, the reference every trainer figure is a ratio of, does not learn its one batch (so it cannot slow down)."""

from __future__ import annotations

from training.diagnostics.throughput import bare_loop
from training.config import load_train_config


def test_the_bare_loop_does_not_learn_its_one_batch():
    # Trained on one batch, a loop learns it: loss and gradients sink into subnormal floats,
    # which x86 cores compute several times slower (this loop fell to 0.42-0.45 of its early rate
    # by steps 100-300 when it still learnt). A reference that slows down flatters the trainer.
    # So the bare loop steps with learning rate 0: the same loss at step 300 as at step 1. (Its rate
    # is the benchmark's business, not this suite's: on a shared machine a rate is noise.)
    config = load_train_config(None, [
        "--model.name=mlp", "--model.image_size=16", "--model.num_classes=1000", "--train.micro_batch_size=8",
        "--train.precision=fp32", "--train.device=cpu", "--optim.name=sgd",
    ])
    losses: list = []
    bare_loop(config, steps=200, warmup=100, losses=losses)
    assert len(losses) == 300 and losses[0].item() > 1.0
    assert {loss.item() for loss in losses} == {losses[0].item()}
