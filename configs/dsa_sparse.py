"""DSA stage 2, sparse adaptation (docs/reference.md section 3), on the tiny model.

Start from the warm-up run: top-k attention on, every parameter trains with Muon Split, the
indexer loss is restricted to the selected keys and the indexer inputs are detached, so the LM
loss never reaches the indexer. See configs/dsa_warmup.py for the whole recipe.

`arg` is passed to configs/tiny.py.
"""

import os

from glm5_jax.config import load_config_file


def get_config(arg: str | None = None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "tiny.py"), arg)
  config.model.attention_pattern = "D"
  config.train.dsa_stage = "sparse"
  config.train.steps = 400
  config.train.dsa_dense_steps = 0  # the indexers start from the previous stage
  config.train.init_from = ""  # set to the warm-up run's workdir
  config.optim.learning_rate = 1e-3
  config.optim.warmup_steps = 20
  return config
