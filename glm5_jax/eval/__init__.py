"""Evaluation: the long-context retrieval suite, checkpoint conversion and the SWA layer search.

  suite         RULER-style tasks at several lengths and depths; teacher-forced exact match
  checkpoints   a run's latest params, optionally converted training-free to another pattern
  evaluate      evaluate_run / search_swa_pattern: checkpoints wired to the suite
  swa_search    the beam search over which layers become SWA (pure; takes a score function)
  report        suite results as JSON and markdown

Entry points: experiments/eval.py, tools/search_swa_pattern.py; sweeps of runs that train and
evaluate live in glm5_jax.sweeps.
"""
