"""Experiment configs: each module's `get_config(arg)` returns an ml_collections ConfigDict.

Import them as modules (`from configs import tiny; tiny.get_config("attention=M")`) or name
them by path to an entry point (`--config=configs/tiny.py:attention=M`, which ml_collections
loads by path). Either way a config that imports its siblings (`configs.common`,
`configs.tiny`) imports the installed `configs` package: setup.cfg installs it beside
`glm5_jax` (`pip install -e .` or a normal install), so no entry point edits `sys.path`.
"""
