"""Command-line tools for glm5_jax (run from the repository root, e.g. `python -m tools.X`)."""
