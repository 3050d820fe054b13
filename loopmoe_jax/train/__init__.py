"""Training: optimizer and schedules, the train step, Orbax checkpoints, metrics, the loop."""
