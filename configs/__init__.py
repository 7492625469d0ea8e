"""Experiment configs: each config file's `get_config(arg)` returns an ml_collections ConfigDict.

  tiny.py, glm5_744b.py, glm5_gpu_3b.py, dsa_adaptation.py, long_context.py   pre-training
  sft_tiny.py, rl_tiny.py, rl_agentic.py, rl_long_tail.py, rl_staged.py     post-training
  sweeps/*.py    sweep configs (`get_config(arg)` -> the sweep's named runs)
  common.py      `parse_arg`, the parser of `get_config`'s string argument
  overrides.py   the entry points' config flags: an unknown `--config.<path>` field is one
                 ConfigError line and exit status 1, not a traceback

Import them as modules (`from configs import tiny; tiny.get_config("attention=M")`) or name
them by path to an entry point (`--config=configs/tiny.py:attention=M`, which ml_collections
loads by path; the path is relative to the working directory). Either way a config that imports
its siblings (`configs.common`, `configs.tiny`) imports the installed `configs` package:
setup.cfg installs it beside `glm5_jax` (`pip install -e .` or a normal install), so no entry
point edits `sys.path`.
"""
