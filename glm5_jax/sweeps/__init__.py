"""Sweeps: named training / evaluation / search runs with dependencies, run resumably.

  spec     sweep configs (configs/sweeps/*.py): run constructors, dependency order, references
  runner   runs a sweep in-process or as worker processes; resume, locks, SIGTERM
  jobs     what each run kind does (glm5_jax.train for train runs, glm5_jax.eval for the rest)
  report   results.json, results.md and plots of a sweep

Dependencies point one way: experiments/sweep.py -> glm5_jax.sweeps -> glm5_jax.{train, eval}.
"""
