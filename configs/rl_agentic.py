"""Agentic RL of the tiny GLM-5: code synthesis, repo repair, or a task mixture, from SFT.

  python experiments/rl.py --config=configs/rl_agentic.py:task=code --workdir=/tmp/glm5_code
  python experiments/rl.py --config=configs/rl_agentic.py:task=repo_repair \
      --workdir=/tmp/glm5_repo
  python experiments/rl.py --config=configs/rl_agentic.py:task=mixture --workdir=/tmp/glm5_mix
  python experiments/rl.py --config=configs/rl_agentic.py:task=mixture --mode=async \
      --workdir=/tmp/glm5_mix_async                     # trainer + rollout workers

The model's code runs in the sandbox (glm5_jax/posttrain/sandbox.py; docs/posttrain.md,
Sandbox): the run refuses to start where the OS cannot isolate a program unless
`--config.rl.sandbox.allow_unsafe=True`. Limits: `--config.rl.sandbox.wall_seconds=...` etc.

`arg` (configs.common.parse_arg): `task` ("code", "repo_repair" or "mixture": code 2 :
repo_repair 1 : addition 1, repo_repair rollouts at most 0 versions stale in async mode),
`steps` (RL steps, default 60), `sft_steps` (default 400), `num_per_env` (SFT conversations per
environment, default 300; writing them runs each worked solution in the sandbox, 8 at a time:
~0.04 s per code conversation and ~0.1 s per repo-repair one on 2 CPUs), `reward` ("all" or "fraction" for the code
and repo-repair tests, default "all").

Rows: a code conversation is at most ~360 tokens (byte tokenizer), a repo-repair one ~700, so
SFT and RL rows are 512 (code) or 1024 tokens; a turn may generate up to 192 tokens (the
write_file turn carries the whole fixed file).
"""

import ml_collections

from configs import sft_tiny
from configs.common import parse_arg
from glm5_jax import optim
from glm5_jax.posttrain.config import rl_config
from glm5_jax.posttrain.rl_config_checks import rl_data_config
from glm5_jax.posttrain.tasks import task_config
from glm5_jax.sharding import mesh_config
from glm5_jax.train import config as train_defaults

TASKS = ("code", "repo_repair", "mixture")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, task="code", steps=60, sft_steps=400, num_per_env=300, reward="all")
  if arg.task not in TASKS:
    raise ValueError(f"configs/rl_agentic.py: task must be one of {TASKS}, got {arg.task!r}")
  seq_len = 512 if arg.task == "code" else 1024
  sft_envs = {"code": "code", "repo_repair": "repo_repair",
              "mixture": "code+repo_repair+addition"}[arg.task]
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.sft = sft_tiny.get_config(f"envs={sft_envs},steps={arg.sft_steps},"
                                   f"num_per_env={arg.num_per_env}")
  config.sft.data.seq_len = seq_len
  config.sft.data.batch_size = 8
  config.model = config.sft.model
  config.data = rl_data_config(seq_len=seq_len)
  options = {"reward": arg.reward}
  config.rl = rl_config(group_size=8, prompts_per_step=8, max_new_tokens=192, temperature=1.0,
                        steps=arg.steps, eval_every_steps=20, eval_tasks=32, eval_samples=0)
  if arg.task == "mixture":
    config.rl.env = "mixture"
    config.rl.max_staleness = 1
    config.rl.tasks.code = task_config(2.0, **options)
    config.rl.tasks.repo_repair = task_config(1.0, max_staleness=0, **options)
    config.rl.tasks.addition = task_config(1.0)
  else:
    config.rl.env = arg.task
    config.rl.env_options.update(options)
  config.optim = optim.optim_config(learning_rate=1e-3, warmup_steps=min(5, arg.steps // 2))
  config.train = train_defaults.train_config(steps=arg.steps)
  config.ckpt = train_defaults.ckpt_config(every_steps=1, keep=2)
  config.mesh = mesh_config()
  return config
