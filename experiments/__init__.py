"""absl entry points, the only code that reads command-line flags: `train.py` (the main job),
`eval.py` (the long-context suite on a trained run), `sweep.py` (named runs with dependencies)
and `forward.py` (a config's forward pass on random tokens). RL entry points come later."""
