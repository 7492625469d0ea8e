"""Training: losses, train state and steps, checkpoints, metrics, and the training loop."""
