"""DSA stage 1, dense warm-up (docs/reference.md section 3), on the tiny model.

Start from a dense MLA run; every parameter but the lightning indexers is frozen, attention
stays dense, and the indexers learn KL(head-summed main attention || softmax(index scores)).
GLM-5 ran 1000 steps at LR 5e-3 -> 2e-4; the tiny recipe keeps the LR range, fewer steps.

  python experiments/train.py --config=configs/tiny.py:attention=M --workdir=/tmp/mla
  python experiments/train.py --config=configs/dsa_warmup.py --workdir=/tmp/dsa_warmup \
      --config.train.init_from=/tmp/mla
  python experiments/train.py --config=configs/dsa_sparse.py --workdir=/tmp/dsa_sparse \
      --config.train.init_from=/tmp/dsa_warmup

`arg` is passed to configs/tiny.py.
"""

import os

from glm5_jax.config import load_config_file


def get_config(arg: str | None = None):
  config = load_config_file(os.path.join(os.path.dirname(__file__), "tiny.py"), arg)
  config.model.attention_pattern = "D"
  config.train.dsa_stage = "warmup"
  config.train.steps = 200
  config.train.dsa_dense_steps = 0  # the indexers start from the previous stage
  config.train.init_from = ""  # set to the dense MLA run's workdir
  config.optim.name = "adamw"  # only the indexers train; GLM-5's warm-up LR schedule
  config.optim.learning_rate = 5e-3
  config.optim.min_lr_ratio = 2e-4 / 5e-3
  config.optim.warmup_steps = 10
  return config
