"""SFT of the tiny GLM-5 on chat conversations (configs/tiny.py's model, Muon Split).

  python experiments/sft.py --config=configs/sft_tiny.py --workdir=/tmp/glm5_sft
  python experiments/sft.py --config=configs/sft_tiny.py:envs=addition+strings,steps=600 ...
  python experiments/sft.py --config=configs/sft_tiny.py \
      --config.data.sources.sft.glob='/data/chats/*.jsonl' --workdir=/tmp/glm5_sft_own

With `data.sources.sft.glob` empty (the default) experiments/sft.py writes the built-in set
(`sft.envs` worked solutions, `glm5_jax.posttrain.sft_data`) to `<workdir>/sft_builtin.jsonl`
and trains on it; a glob trains on those jsonl files instead. The `sft` section is read by
experiments/sft.py only (it is removed before the training loop sees the config).

Rows of 128 tokens hold two addition conversations (about 50 tokens each with their short
thinking). DSA attends densely for the first half while the indexers learn (as configs/tiny.py).

`arg` (configs.common.parse_arg): `envs` (names joined by "+", default "addition"), `steps`
(default 300), `num_per_env` (default 4000).
"""

import ml_collections

from configs import tiny
from configs.common import parse_arg
from glm5_jax import data, optim
from glm5_jax.sharding import mesh_config
from glm5_jax.train import config as train_defaults

SEQ_LEN = 128


def sft_section(envs=("addition",), num_per_env=4000, seed=0) -> ml_collections.ConfigDict:
  """The built-in dataset: worked solutions of `num_per_env` train tasks of each env."""
  c = ml_collections.ConfigDict()
  c.envs = ",".join(envs)  # comma-separated names of glm5_jax.posttrain.envs.NAMES
  c.num_per_env = num_per_env
  c.seed = seed  # the envs' seed option (which tasks)
  c.env_options = ml_collections.ConfigDict()  # {env: {option: value}}, e.g. addition digits
  return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, envs="addition", steps=300, num_per_env=4000)
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.model = tiny.get_config().model
  # overlong="error": a worked solution that does not fit is a config mistake, not data to cut.
  config.data = data.data_config(seq_len=SEQ_LEN, batch_size=16, sources=dict(
      sft=data.source_config("chat_jsonl", glob="", weight=1.0, overlong="error",
                             holdout_fraction=0.02)))
  # 30 warmup steps, fewer in a run too short for them (the schedule needs warmup < steps).
  config.optim = optim.optim_config(learning_rate=1e-2, warmup_steps=min(30, arg.steps // 2))
  config.train = train_defaults.train_config(steps=arg.steps, dsa_dense_steps=arg.steps // 2,
                                             log_every_steps=25)
  config.ckpt = train_defaults.ckpt_config(every_steps=100, keep=2)
  config.eval = train_defaults.eval_config(every_steps=arg.steps, batches=2)
  config.mesh = mesh_config()
  config.sft = sft_section(envs=tuple(arg.envs.split("+")), num_per_env=arg.num_per_env)
  return config
