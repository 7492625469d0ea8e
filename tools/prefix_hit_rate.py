"""Prefix-cache hit rate of multi-turn rollouts, with and without engine sessions.

  python tools/prefix_hit_rate.py                                    # random tiny params
  python tools/prefix_hit_rate.py --init_from=/tmp/glm5_sft --tasks=16 --group_size=8

Plays `--tasks` calculator tasks x `--group_size` samples (`rollout.generate_samples`, the
rollout the RL loop runs) twice with the same seed: without sessions (every turn re-prefills
the whole conversation) and with them (each episode's slot keeps its cache between turns,
`glm5_jax.infer.sessions`). Prints, for each, prompt tokens submitted, tokens prefilled and
the hit rate `1 - prefilled / prompt` (both count the group prefix sharing that prefills one
prompt for its G samples), the session hits / misses / evictions, mean turns, and whether the
two runs' samples agree (tokens equal, log-probs to 1e-4); the last line is all of it as JSON.

Params: `--init_from` (a training run's workdir: its latest params, e.g. an SFT run on the
calculator env, whose episodes do call the tool) or random params of configs/rl_tiny.py's model
(std 0.02: most turns run out of tokens, so few episodes reach a second turn).
`--max_slots` below tasks x group_size puts the engine under slot pressure (LRU evictions).
"""

import json

from absl import app, flags
from flax import linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import glm5_jax

from configs import rl_tiny
from glm5_jax.config import ModelConfig
from glm5_jax.posttrain import envs, rollout
from glm5_jax.train import console

_INIT_FROM = flags.DEFINE_string("init_from", "", "A training run's workdir (latest params); "
                                 "empty: random params.")
_TASKS = flags.DEFINE_integer("tasks", 8, "Calculator tasks (train split, indices 0..N-1).")
_GROUP = flags.DEFINE_integer("group_size", 8, "Samples per task.")
_MAX_TURNS = flags.DEFINE_integer("max_turns", 3, "The calculator's max_turns.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 48, "Tokens per turn at most.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 192, "Tokens per episode at most.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_MAX_SLOTS = flags.DEFINE_integer("max_slots", rollout.MAX_SLOTS, "Engine slots at most.")
_SEED = flags.DEFINE_integer("seed", 0, "Rollout seed (and random params' seed).")


def load_params(config):
  if _INIT_FROM.value:
    from glm5_jax.eval.checkpoints import load_run
    run = load_run(_INIT_FROM.value)
    config.model = run.model
    return run.params, f"{_INIT_FROM.value} (step {run.step})"
  return random_params(ModelConfig.from_config(config.model), _SEED.value), "random (std 0.02)"


def random_params(cfg: ModelConfig, seed: int):
  """N(0, 0.02) params (norm scales 1 + that), drawn by numpy: no init compile."""
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    x = 0.02 * rng.standard_normal(leaf.shape, np.float32)
    if getattr(path[-1], "key", None) == "scale":
      x += 1
    return jnp.asarray(x, leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, nn.meta.unbox(glm5_jax.abstract_params(cfg)))


def main(argv):
  del argv
  console.quiet_library_info()
  config = rl_tiny.get_config()
  del config["sft"]
  params, source = load_params(config)
  config.data.seq_len = _SEQ_LEN.value
  config.rl.update(group_size=_GROUP.value, max_new_tokens=_MAX_NEW.value,
                   temperature=_TEMPERATURE.value)
  rollout.MAX_SLOTS = _MAX_SLOTS.value
  env = envs.make("calculator", max_turns=_MAX_TURNS.value)
  tasks = [env.task(i, "train") for i in range(_TASKS.value)]
  out = {"params": source, "tasks": _TASKS.value, "group_size": _GROUP.value,
         "slots": min(_TASKS.value * _GROUP.value, _MAX_SLOTS.value)}
  samples = {}
  for sessions in (False, True):
    stats = {}
    samples[sessions] = rollout.generate_samples(config, params, env, tasks, seed=_SEED.value,
                                                 sessions=sessions, stats=stats)
    stats["mean_turns"] = float(np.mean([s.turns for s in samples[sessions]]))
    stats["reward"] = float(np.mean([s.reward for s in samples[sessions]]))
    key = "sessions" if sessions else "no_sessions"
    out[key] = stats
    print(f"{key:12s} prompt tokens {stats['prompt_tokens']:6d}  prefilled "
          f"{stats['prefilled_tokens']:6d}  hit rate {stats['hit_rate']:.3f}  session hits "
          f"{stats['session_hits']} misses {stats['session_misses']} evictions "
          f"{stats['evictions']}  mean turns {stats['mean_turns']:.2f}  reward "
          f"{stats['reward']:.3f}")
  out["samples_equal"] = all(
      np.array_equal(a.tokens, b.tokens) and np.allclose(a.rollout_logp, b.rollout_logp,
                                                         rtol=1e-4, atol=1e-4)
      for a, b in zip(samples[False], samples[True]))
  print(f"samples equal with and without sessions: {out['samples_equal']}")
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
