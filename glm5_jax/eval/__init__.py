"""Evaluation: the long-context retrieval suite, checkpoint conversion, the SWA layer search and
sweeps of training runs.

  suite         RULER-style tasks at several lengths and depths; teacher-forced exact match
  checkpoints   a run's latest params, optionally converted training-free to another pattern
  evaluate      evaluate_run / search_swa_pattern: checkpoints wired to the suite
  swa_search    the beam search over which layers become SWA (pure; takes a score function)
  report        suite results as JSON and markdown
  sweep_spec, sweep_runner, sweep_jobs, sweep_report
                sweep configs (runs with dependencies), running them resumably, the report

Entry points: experiments/eval.py, experiments/sweep.py, tools/search_swa_pattern.py.
"""
