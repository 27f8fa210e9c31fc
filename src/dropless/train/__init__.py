"""Training: the step, the loop, resume, guards and metrics (data and checkpoints are `dropless.data` and `dropless.checkpoint`)."""
