"""The training loop: the trainer, its state, checkpoints, what a worker needs to survive
elasticity, and its metrics."""
