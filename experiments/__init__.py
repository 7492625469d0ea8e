"""absl entry points, the only code that reads command-line flags: `train.py` (the main job),
`eval.py` (the long-context suite on a trained run), `sweep.py` (named runs with dependencies),
`forward.py` (a config's forward pass on random tokens), `generate.py` (completions from a run,
an HF checkpoint or random params), `sft.py` (SFT on chat conversations) and `rl.py` (RL,
synchronous or asynchronous). README.md shows one command for each."""
