"""Training: the update step, validation, checkpoints, distributed set-up and metrics."""
