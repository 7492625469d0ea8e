"""The released GLM-5: 744B total / ~40B active (docs/reference.md section 1).

  python tools/param_count.py --config=configs/glm5_744b.py
  python experiments/train.py --config=configs/glm5_744b.py --workdir=gs://bucket/glm5 \
      --config.data.tokenizer=/path/to/tokenizer.json      (multi-host TPU pod)

The mesh shards params over `fsdp` (all devices by default) and experts over `expert`; set
`--config.mesh.shape.expert=...` / `tensor=...` to fit the slice.
"""

import ml_collections

from configs.common import parse_arg
from glm5_jax import data, optim
from glm5_jax.config import model_config
from glm5_jax.sharding import mesh_config
from glm5_jax.train import config as train_defaults


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  parse_arg(arg)  # takes no arguments: an error naming this file if given any
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.model = model_config(attention_pattern="D" * 78)  # every layer DSA, own indexer
  config.data = data.data_config(seq_len=4096, batch_size=1024)
  config.optim = optim.optim_config(learning_rate=2e-4, warmup_steps=2000)
  config.train = train_defaults.train_config(steps=100_000)
  config.ckpt = train_defaults.ckpt_config(every_steps=1000)
  config.eval = train_defaults.eval_config(every_steps=5000, batches=16)
  config.mesh = mesh_config(fsdp=-1, data=1)
  return config
