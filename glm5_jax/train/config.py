"""Defaults and checks of the training loop's own config sections: `train`, `ckpt`, `eval`.

Model, data, optim and mesh defaults live beside their code (`glm5_jax.config`,
`glm5_jax.data`, `glm5_jax.optim`, `glm5_jax.sharding`); configs/*.py compose all of them, and
`glm5_jax.config_validation.validate_config` checks every section.
"""

import math

import ml_collections

from glm5_jax.config import check_fields, require

# docs/reference.md section 3; what each stage trains: glm5_jax.train.state.
from glm5_jax.attention.mode import DSA_STAGES  # noqa: E402  (one definition)
LOSS_WEIGHTS = ("mtp_loss_weight", "z_loss_weight", "indexer_loss_weight",
                "sequence_balance_weight", "balance_bias_rate")


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
  # Gradient accumulation: each step's data.batch_size rows run as this many microbatches in
  # turn (activation memory of one microbatch), with the result of one pass over all of them.
  c.microbatches = 1
  # 0: the losses read the model's fp32 [B, L, Y] logits. N > 0: the LM head runs inside the
  # loss N positions at a time, with a bf16 cotangent, and no [B, L, Y] array exists forward
  # or backward (glm5_jax.train.fused_ce; same losses to rounding). Evaluation keeps the logits.
  c.ce_chunk = 0
  # With ce_chunk > 0: form the fused head's gradients in the forward pass, where the loss
  # weights already give each position's cotangent (glm5_jax.train.fused_ce.loss_with_gradients):
  # 3 of the head's 4 matmuls (its backward recomputes no logits) for dW [D, Y] in the
  # kernel's dtype and each head's dh [B, L, D] held to the backward (0.63 + 0.27 GB, bf16,
  # for configs/glm5_gpu_3b.py), and an fp32 dW accumulator [D, Y] during the loss's forward.
  c.ce_grad_in_forward = False
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


def validate_train_config(c) -> None:
  """Rejects a bad `train` section with a `ConfigError` naming the field."""
  check_fields(c, train_config(), "train")
  require(c.steps >= 1, "train.steps", f"must be >= 1, got {c.steps}")
  require(c.dsa_stage in DSA_STAGES, "train.dsa_stage",
          f"must be one of {DSA_STAGES}, got {c.dsa_stage!r}")
  require(c.dsa_dense_steps >= 0, "train.dsa_dense_steps",
          f"must be an int >= 0, got {c.dsa_dense_steps}")
  require(c.dsa_dense_steps == 0 or c.dsa_stage == "sparse", "train.dsa_dense_steps",
          "a dense phase comes before the sparse stage only; got "
          f"dsa_stage={c.dsa_stage!r} (set it to 0)")
  for name in LOSS_WEIGHTS:
    require(math.isfinite(c[name]) and c[name] >= 0, f"train.{name}",
            f"must be a finite number >= 0, got {c[name]}")
  require(isinstance(c.microbatches, int) and c.microbatches >= 1, "train.microbatches",
          f"must be an int >= 1 (1: no gradient accumulation), got {c.microbatches!r}")
  require(isinstance(c.ce_chunk, int) and c.ce_chunk >= 0, "train.ce_chunk",
          f"must be an int >= 0 (0: the logits path), got {c.ce_chunk!r}")
  require(c.ce_chunk > 0 or not c.ce_grad_in_forward, "train.ce_grad_in_forward",
          "needs the fused head (train.ce_chunk > 0); got ce_chunk=0")
  require(c.log_every_steps >= 1, "train.log_every_steps",
          f"must be >= 1 (metrics are written every that many steps), got {c.log_every_steps}")


def validate_ckpt_config(c) -> None:
  """Rejects a bad `ckpt` section with a `ConfigError` naming the field."""
  check_fields(c, ckpt_config(), "ckpt")
  require(c.every_steps >= 1, "ckpt.every_steps",
          f"must be >= 1 (a checkpoint every that many steps), got {c.every_steps}")
  require(c.keep >= 1, "ckpt.keep", f"must be >= 1 (the checkpoints kept; fewer would delete "
          f"every one), got {c.keep}")


def validate_eval_config(c) -> None:
  """Rejects a bad `eval` section with a `ConfigError` naming the field."""
  check_fields(c, eval_config(), "eval")
  require(c.every_steps >= 0, "eval.every_steps",
          f"must be >= 0 (0 disables evaluation), got {c.every_steps}")
  require(c.batches >= (1 if c.every_steps else 0), "eval.batches",
          f"must be >= 1 when evaluation is on (eval.every_steps={c.every_steps}), got "
          f"{c.batches}")
