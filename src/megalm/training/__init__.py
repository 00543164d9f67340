"""Training loop, optimizers and schedules, checkpoints, metrics."""
