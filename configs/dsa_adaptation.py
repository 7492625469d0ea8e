"""DSA adaptation of a dense MLA run (docs/reference.md section 3), on the tiny model.

GLM-5 turns a dense-attention model into DSA in two stages, each a run that starts from the
previous run's params (`train.init_from`):

  warmup  every parameter but the lightning indexers is frozen, attention stays dense, and the
          indexers learn KL(head-summed main attention || softmax(index scores)). GLM-5 ran
          1000 steps at LR 5e-3 -> 2e-4; the tiny recipe keeps the LR range, fewer steps.
  sparse  top-k attention on, every parameter trains with Muon Split, the indexer loss is
          restricted to the selected keys and the indexer inputs are detached, so the LM loss
          never reaches the indexer.

  python experiments/train.py --config=configs/tiny.py:attention=M --workdir=/tmp/mla
  python experiments/train.py --config=configs/dsa_adaptation.py:stage=warmup \
      --workdir=/tmp/dsa_warmup --config.train.init_from=/tmp/mla
  python experiments/train.py --config=configs/dsa_adaptation.py:stage=sparse \
      --workdir=/tmp/dsa_sparse --config.train.init_from=/tmp/dsa_warmup

`arg` (configs.common.parse_arg): `stage=warmup` (the default) or `stage=sparse`; a bare
`warmup` / `sparse` works too. The model is configs/tiny.py's with every layer DSA.
"""

import ml_collections

from configs import tiny
from configs.common import parse_arg

STAGES = ("warmup", "sparse")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, stage="warmup")
  if arg.stage not in STAGES:
    raise ValueError(f"configs/dsa_adaptation.py: stage={arg.stage!r}; expected one of {STAGES}")
  config = tiny.get_config()
  config.model.attention_pattern = "D"
  config.train.dsa_stage = arg.stage
  config.train.dsa_dense_steps = 0  # the indexers start from the previous stage
  config.train.init_from = ""  # set to the previous stage's workdir (dense MLA for warmup)
  if arg.stage == "warmup":
    config.train.steps = 200
    config.optim.name = "adamw"  # only the indexers train; GLM-5's warm-up LR schedule
    config.optim.learning_rate = 5e-3
    config.optim.min_lr_ratio = 2e-4 / 5e-3
    config.optim.warmup_steps = 10
  else:
    config.train.steps = 400
    config.optim.learning_rate = 1e-3
    config.optim.warmup_steps = 20
  return config
