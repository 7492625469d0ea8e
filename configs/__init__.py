"""Experiment configs: each module's `get_config(arg)` returns an ml_collections ConfigDict.

Import them as modules (`from configs import tiny; tiny.get_config("attention=M")`) or name
them by path to an entry point (`--config=configs/tiny.py:attention=M`, which ml_collections
loads by path). Either way a config that imports its siblings (`configs.common`,
`configs.tiny`) needs the directory holding `configs/` on `sys.path`: the entry points in
experiments/ and tools/ put the working directory there, so run them from the repository root
(or set PYTHONPATH to it); the tests get it from `pythonpath = .` in setup.cfg.
"""
