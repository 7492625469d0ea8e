"""The `rl` config section: defaults (`rl_config`) and checks (`validate_rl_config`).

Reasoning RL and on-policy distillation (docs/reference.md section 4). An RL experiment config
composes the usual sections (model, optim, train, mesh, ...) with this one; the policy loss
reads eps_low / eps_high / icepop_beta, the rollouts the sampling fields, the loop the rest.
"""

import math

import ml_collections

from glm5_jax.config import check_fields, require

RL_LOSSES = ("grpo", "distill")


def rl_config(**overrides) -> ml_collections.ConfigDict:
  """The `rl` section's defaults (tiny-model, CPU scale), with `overrides` applied."""
  c = ml_collections.ConfigDict()
  c.loss = "grpo"  # "grpo" (group-relative rewards) | "distill" (a teacher's log-probs)
  c.env = "addition"  # a name of glm5_jax.posttrain.envs.NAMES
  c.env_options = ml_collections.ConfigDict()  # keyword options of envs.make(env, ...)
  # GLM-5 uses 32 prompts x 32 samples (docs/reference.md section 4); CPU-sized here.
  c.group_size = 8  # samples per prompt (G); distillation is usually run with 1
  c.prompts_per_step = 8  # prompts per step; a step trains on prompts_per_step * group_size
  c.max_new_tokens = 32  # per assistant turn
  c.temperature = 1.0  # rollout sampling; the loss always uses the raw (temperature 1) policy
  c.top_p = 1.0
  c.eps_low = 0.2  # PPO clip range [1 - eps_low, 1 + eps_high] (docs/reference.md section 4)
  c.eps_high = 0.28
  c.icepop_beta = 2.0  # IcePop keeps tokens with pi_train / pi_rollout in [1/beta, beta]
  # Optimizer updates per rollout batch: its rows are split into this many minibatches (rows
  # m, m + k, m + 2k, ...), each one update, all with old_logp = the log-probs before the first
  # update, so PPO's clip binds from the second update on. 1: one update, old_logp = logp.
  c.minibatches = 1
  c.normalize_std = True  # GRPO: divide advantages by the group's std (False: Dr. GRPO)
  c.mtp_loss_weight = 0.0  # > 0: keep training the MTP head on the response tokens
  # Rollouts record each token's MoE experts and DSA top-k keys and the trainer replays them,
  # so its log-probs of a rollout are the engine's (glm5_jax.routing_replay).
  c.routing_replay = False
  c.steps = 100  # RL steps (also the length of the learning-rate schedule)
  c.teacher = ""  # workdir of the teacher checkpoint for loss "distill"; "" for "grpo"
  c.init_from = ""  # workdir of the run (e.g. SFT) whose latest params RL starts from
  c.eval_every_steps = 10  # held-out accuracy every this many steps; 0 disables
  c.eval_tasks = 64  # held-out tasks per evaluation
  c.eval_samples = 8  # also sample each eval task this many times at `temperature`; 0: greedy only
  c.seed = 0  # rollout sampling and task order
  c.update(overrides)
  return c


def validate_rl_config(c) -> None:
  """Rejects a bad `rl` section with a `ConfigError` naming the field (`config.rl.<field>`).

  The environment name is checked where the environment is built (`envs.make`), which knows the
  registry and each environment's options.
  """
  check_fields(c, rl_config(), "rl")
  require(c.loss in RL_LOSSES, "rl.loss", f"must be one of {RL_LOSSES}, got {c.loss!r}")
  require(bool(c.env), "rl.env", "must name an environment, got ''")
  if c.loss == "distill":
    require(bool(c.teacher), "rl.teacher",
            "loss 'distill' needs the teacher checkpoint's workdir, got ''")
    require(c.group_size >= 1, "rl.group_size", f"must be >= 1, got {c.group_size}")
  else:
    require(not c.teacher, "rl.teacher",
            f"only loss 'distill' reads a teacher; got {c.teacher!r} with loss {c.loss!r}")
    require(c.group_size >= 2, "rl.group_size",
            f"GRPO compares samples within a group, so it needs >= 2, got {c.group_size} (a "
            "group of 1 always has advantage 0)")
  require(c.prompts_per_step >= 1, "rl.prompts_per_step",
          f"must be >= 1, got {c.prompts_per_step}")
  require(c.minibatches >= 1, "rl.minibatches", f"must be >= 1, got {c.minibatches}")
  require(c.max_new_tokens >= 1, "rl.max_new_tokens", f"must be >= 1, got {c.max_new_tokens}")
  require(math.isfinite(c.temperature) and c.temperature > 0, "rl.temperature",
          f"must be > 0 (RL samples; greedy rollouts of a group are identical), got "
          f"{c.temperature}")
  require(0 < c.top_p <= 1, "rl.top_p", f"must be in (0, 1], got {c.top_p}")
  require(0 < c.eps_low < 1, "rl.eps_low", f"must be in (0, 1), got {c.eps_low}")
  require(math.isfinite(c.eps_high) and c.eps_high > 0, "rl.eps_high",
          f"must be a finite number > 0, got {c.eps_high}")
  require(math.isfinite(c.icepop_beta) and c.icepop_beta > 1, "rl.icepop_beta",
          f"must be a finite number > 1 (the band [1/beta, beta]), got {c.icepop_beta}")
  require(math.isfinite(c.mtp_loss_weight) and c.mtp_loss_weight >= 0, "rl.mtp_loss_weight",
          f"must be a finite number >= 0, got {c.mtp_loss_weight}")
  require(c.steps >= 1, "rl.steps", f"must be >= 1, got {c.steps}")
  require(c.eval_every_steps >= 0, "rl.eval_every_steps",
          f"must be >= 0 (0 disables evaluation), got {c.eval_every_steps}")
  require(c.eval_tasks >= (1 if c.eval_every_steps else 0), "rl.eval_tasks",
          f"must be >= 1 when evaluation is on (rl.eval_every_steps={c.eval_every_steps}), "
          f"got {c.eval_tasks}")
  require(c.eval_samples >= 0, "rl.eval_samples",
          f"must be >= 0 (0: greedy evaluation only), got {c.eval_samples}")
