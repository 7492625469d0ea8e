"""SFT: the pre-training loop (`glm5_jax.train.loop.train`) on chat conversations.

An SFT experiment config is an ordinary training config whose data is `chat_jsonl` sources
(assistant-only loss masks, `glm5_jax.data.chat`), plus an `sft` section that names the
built-in dataset (`sft_data.write_builtin`: worked solutions of the environments). A
`chat_jsonl` source with an empty `glob` reads that built-in set, written to
`<workdir>/sft_builtin.jsonl`; a source with a glob reads its own files. Orbax resume, Muon
Split, metrics and held-out loss come with the training loop.
"""

import copy
import os
import time

from absl import logging

from glm5_jax.config import ConfigError, check_fields, require
from glm5_jax.posttrain import envs, sft_data
from glm5_jax.train import checkpoint as ckpt
from glm5_jax.train.loop import train

BUILTIN_FILE = "sft_builtin.jsonl"
SFT_FIELDS = dict(envs="", num_per_env=0, seed=0, env_options={})


def training_config(config, workdir: str):
  """The training-loop config of an SFT config: a copy without the `sft` section, each
  `chat_jsonl` source with an empty glob pointed at the built-in set (written to `workdir`
  first; idempotent). Raises `ConfigError` naming a bad `sft` field."""
  config = copy.deepcopy(config)
  section = config.get("sft")
  if section is not None:
    with config.unlocked():
      del config["sft"]
  builtin = [name for name, spec in config.data.sources.items()
             if spec.kind == "chat_jsonl" and not spec.glob]
  if not builtin:
    return config
  require(section is not None, f"data.sources.{builtin[0]}.glob",
          "is empty, which reads the built-in set, but the config has no `sft` section naming "
          "it (configs/sft_tiny.py's sft_section)")
  check_fields(section, SFT_FIELDS, "sft")
  names = [n for n in section.envs.split(",") if n]
  unknown = sorted(set(names) - set(envs.NAMES))
  require(names and not unknown, "sft.envs",
          f"comma-separated names of {envs.NAMES}, got {section.envs!r}")
  require(section.num_per_env >= 1, "sft.num_per_env", f"must be >= 1, got "
          f"{section.num_per_env}")
  path = os.path.join(os.path.abspath(workdir), BUILTIN_FILE)
  try:
    sft_data.write_builtin(path, names, section.num_per_env, seed=section.seed,
                           env_options={k: dict(v) for k, v in section.env_options.items()})
  except ValueError as e:
    raise ConfigError(f"config.sft: {e}") from e
  for name in builtin:
    config.data.sources[name].glob = path
  return config


def finished(config, workdir: str) -> bool:
  """Whether `workdir` holds a checkpoint at `train.steps` (the SFT run is complete)."""
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return False
  manager = ckpt.make_manager(workdir, every_steps=1, keep=1, async_save=False)
  try:
    return manager.latest_step() == config.train.steps
  finally:
    manager.close()


def run_sft(config, workdir: str, **train_kwargs) -> dict:
  """Writes the built-in data if the config reads it, then trains (resuming) in `workdir`;
  returns the training loop's summary."""
  os.makedirs(workdir, exist_ok=True)
  return train(training_config(config, workdir), workdir, **train_kwargs)


def ensure_sft_start(config, workdir: str) -> dict:
  """Where RL starts, for an RL experiment `config`: with `rl.init_from` set, nothing to do;
  else trains the config's `sft` section into `<workdir>/sft` (unless that run already
  finished) and sets `rl.init_from` to it. Returns {"sft": the SFT summary (when it ran),
  "sft_seconds", "stopped": "SFT" when it stopped early (SIGTERM), else None} ({} when
  rl.init_from was given). A stopped SFT leaves `rl.init_from` empty: RL must not start from a
  partial SFT model; rerunning resumes the SFT."""
  if config.rl.init_from:
    return {}
  require("sft" in config, "rl.init_from", "is empty and the config has no `sft` section to "
          "train first; name a checkpoint workdir")
  sft_dir = os.path.join(workdir, "sft")
  start = time.time()
  out = {}
  if finished(config.sft, sft_dir):
    logging.info("SFT in %s already finished: RL starts from it", sft_dir)
  else:
    logging.info("SFT (%d steps) into %s", config.sft.train.steps, sft_dir)
    out["sft"] = run_sft(config.sft, sft_dir)
  out["sft_seconds"] = time.time() - start
  out["stopped"] = "SFT" if out.get("sft", {}).get("stopped_early") else None
  if out["stopped"]:
    logging.warning("SFT stopped early at step %d of %d: RL does not start; rerun to resume "
                    "the SFT", out["sft"]["steps"], config.sft.train.steps)
    return out
  config.rl.init_from = sft_dir
  return out
