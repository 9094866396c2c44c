"""The bare loop, the reference every trainer figure is a ratio of, holds its rate however long it runs."""

from __future__ import annotations

from training.diagnostics.throughput import bare_loop
from training.config import load_train_config


def test_the_bare_loops_rate_holds_as_it_steps_on_its_one_batch():
    # Trained on one batch, a loop learns it: loss and gradients sink into subnormal floats,
    # which x86 cores compute several times slower (this loop fell to 0.42-0.45 of its early rate
    # by steps 100-300 when it still learnt). A reference that slows down flatters the trainer.
    config = load_train_config(None, [
        "--model.name=mlp", "--model.image_size=16", "--model.num_classes=1000", "--train.micro_batch_size=8",
        "--train.precision=fp32", "--train.device=cpu", "--optim.name=sgd",
    ])
    early = max(bare_loop(config, steps=8, warmup=2) for _ in range(3))
    late = bare_loop(config, steps=200, warmup=100)
    assert late > 0.7 * early, (late, early)
