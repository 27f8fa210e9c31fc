"""Training: data, step, checkpoints, metrics and the loop."""
