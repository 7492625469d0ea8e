"""Defaults of the training loop's own config sections: `train`, `ckpt`, `eval`.

Model, data, optim and mesh defaults live beside their code (`glm5_jax.config`,
`glm5_jax.data`, `glm5_jax.optim`); configs/*.py compose all of them.
"""

import ml_collections


def train_config(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.steps = 1000
  c.dsa_stage = "sparse"  # dense | warmup | sparse (docs/reference.md section 3)
  # With dsa_stage "sparse" on a run from scratch: attend densely for the first N steps while
  # the indexers learn their KL to that dense attention (the warm-up objective, but every other
  # parameter trains on the LM loss too), then switch top-k on. An indexer that starts random
  # and only ever sees its own selection cannot find the keys retrieval needs.
  c.dsa_dense_steps = 0
  c.init_from = ""  # workdir of another run to take params from (e.g. dense MLA -> DSA)
  c.mtp_loss_weight = 0.3
  c.z_loss_weight = 0.0
  c.indexer_loss_weight = 1.0
  c.sequence_balance_weight = 1e-4  # DeepSeek-V3's alpha
  c.balance_bias_rate = 1e-3  # DeepSeek-V3's gamma
  c.log_every_steps = 20
  c.update(overrides)
  return c


def ckpt_config(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.every_steps = 200
  c.keep = 3
  c.async_save = True
  # A latest checkpoint that fails its fingerprint (or cannot be read) is an error; True: move it
  # to <workdir>/checkpoints_damaged/ with a warning and resume from the step before.
  c.restore_fallback = False
  c.update(overrides)
  return c


def eval_config(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.every_steps = 250  # 0 disables
  c.batches = 8
  c.update(overrides)
  return c
