"""Sweep configs (glm5_jax.sweeps): `get_config(arg)`, `arg` "quick" for a few-step size."""
