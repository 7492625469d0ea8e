"""How far the trainer's log-probs of a rollout are from the engine's, with and without routing
replay (`glm5_jax.routing_replay`, `rl.routing_replay`).

  python tools/replay_mismatch.py                      # configs/rl_tiny.py, random params
  python tools/replay_mismatch.py --prompts=16 --group=4 --params_std=0.05

Rollouts of `--prompts` addition tasks x `--group` samples (`rollout.generate_samples`, routing
recorded) from random params (`--params_std`: every kernel and the router bias N(0, std), norm
scales 1 + N(0, std), so routing is far from uniform; the HF init's 0.02 with a zero bias makes
the tiny model's top-k near-ties). Then, over the rollout's response tokens, max and mean
|logp_trainer - logp_engine| with the trainer replaying the recorded routing and choosing its
own, and the share of response tokens whose expert set (in any MoE layer) or DSA key set (in
any DSA layer) differs from the engine's when the trainer chooses its own:

  same params            the engine and the trainer at the same params, fp32 cache
  bf16 cache             the same, the engine's KV / indexer caches in bfloat16
  bias update only       the trainer's router bias after one RL update (loss-free balancing),
                         everything else as rolled out: what replay removes entirely
  one RL update          the trainer after one full RL update (random advantages), as an
                         off-policy trainer sees a rollout one version old
"""

import os

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

import glm5_jax
from glm5_jax.config import ModelConfig
from glm5_jax.posttrain import envs, rl_step, rollout
from glm5_jax.train import losses

_CONFIG = flags.DEFINE_string("config", "configs/rl_tiny.py", "RL config file.")
_PROMPTS = flags.DEFINE_integer("prompts", 8, "Tasks rolled out.")
_GROUP = flags.DEFINE_integer("group", 4, "Samples per task.")
_PARAMS_STD = flags.DEFINE_float("params_std", 0.1, "Std of the random params.")
_SEED = flags.DEFINE_integer("seed", 0, "Params, sampling and advantages seed.")


def load_config(path):
  import importlib  # pylint: disable=g-import-not-at-top
  relative = os.path.relpath(os.path.abspath(path), os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  return importlib.import_module(relative[:-3].replace(os.sep, ".")).get_config()


def random_params(cfg, std: float, seed: int):
  rng = np.random.default_rng(seed)
  flat = traverse_util.flatten_dict(glm5_jax.abstract_params(cfg))
  return traverse_util.unflatten_dict({
      path: jnp.asarray((path[-1] == "scale") + std * rng.standard_normal(s.shape), s.dtype)
      for path, s in flat.items()})


def mismatch(cfg, params, batch) -> dict:
  """max / mean |logp - rollout_logp| over the response tokens with and without replay, and
  the share of response tokens routed differently without it."""
  mask = batch["loss_mask"] > 0
  recorded = mask & (batch["routing_moe"][:, :, 0, 0] >= 0)
  out = {}
  for replay in (True, False):
    b = batch if replay else {k: v for k, v in batch.items() if not k.startswith("routing_")}
    logp, used = _scored(cfg, params, b)
    gap = np.abs(np.asarray(logp) - batch["rollout_logp"])[mask]
    out["replay" if replay else "own"] = (float(gap.max()), float(gap.mean()))
    if not replay:
      for kind in used:
        same = (np.sort(np.asarray(used[kind]), -1) == np.sort(batch[f"routing_{kind}"], -1))
        out[f"{kind}_differs"] = float((~same.all((-2, -1)))[recorded].mean())
  return out


def _scored(cfg, params, batch):
  return _SCORED(params, {k: jnp.asarray(v) for k, v in batch.items()}, cfg=cfg)


def _scored_impl(params, batch, *, cfg):
  out = glm5_jax.forward(cfg, params, batch["tokens"], batch["positions"], batch["segment_ids"],
                         mtp=False, routing=rl_step.batch_routing(batch), return_routing=True)
  return losses.token_logprobs(out["logits"], batch["tokens"])[0], out["routing"]


_SCORED = jax.jit(_scored_impl, static_argnames="cfg")


def rollout_batch(config, params, env, seed):
  tasks = [env.task(i, "train") for i in range(_PROMPTS.value)]
  samples = rollout.generate_samples(config, params, env, tasks, seed=seed,
                                     group_size=_GROUP.value)
  return rollout.to_batch(samples, config.data.seq_len)


def main(argv):
  del argv
  config = load_config(_CONFIG.value)
  config.rl.routing_replay = True
  config.optim.warmup_steps = 0  # the one update below moves the params at the full rate
  cfg = ModelConfig.from_config(config.model)
  params = random_params(cfg, _PARAMS_STD.value, _SEED.value)
  env = envs.make(config.rl.env, **config.rl.env_options)
  batch = rollout_batch(config, params, env, _SEED.value)
  rows = {"same params": mismatch(cfg, params, batch)}

  bf16 = config.copy_and_resolve_references()
  bf16.model.cache_dtype = "bfloat16"
  rows["bf16 cache"] = mismatch(cfg, params, rollout_batch(bf16, params, env, _SEED.value))

  optimizer, schedule = rl_step.build_rl_optimizer(config, params)
  train_step = rl_step.make_rl_train_step(config, cfg, optimizer, schedule)
  rng = np.random.default_rng(_SEED.value)
  advantages = rng.standard_normal((len(batch["tokens"]), 1)).astype(np.float32)
  train_batch = {**batch, "advantages": advantages * batch["loss_mask"]}
  state = rl_step.init_rl_state(jax.tree.map(jnp.copy, params), optimizer)
  updated = jax.device_get(train_step(state, train_batch)[0].params)
  bias_only = traverse_util.unflatten_dict({
      path: (traverse_util.flatten_dict(updated)[path] if path[-1] == "e_score_correction_bias"
             else x) for path, x in traverse_util.flatten_dict(params).items()})
  rows["bias update only"] = mismatch(cfg, bias_only, batch)
  rows["one RL update"] = mismatch(cfg, updated, batch)

  tokens = int((batch["loss_mask"] > 0).sum())
  print(f"routing replay: |logp_trainer - logp_engine| over {tokens} response tokens "
        f"({_PROMPTS.value} addition tasks x {_GROUP.value}, {config.model.dtype} model, random "
        f"params std {_PARAMS_STD.value}, {jax.default_backend()})")
  print(f"{'scenario':<18} {'replay max':>11} {'replay mean':>12} {'own max':>10} "
        f"{'own mean':>10} {'experts differ':>15} {'dsa keys differ':>16}")
  for name, r in rows.items():
    print(f"{name:<18} {r['replay'][0]:>11.2e} {r['replay'][1]:>12.2e} {r['own'][0]:>10.2e} "
          f"{r['own'][1]:>10.2e} {r.get('moe_differs', float('nan')):>15.1%} "
          f"{r.get('dsa_differs', float('nan')):>16.1%}")


if __name__ == "__main__":
  app.run(main)
