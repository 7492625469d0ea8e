"""A weighted mixture of environments behaving as one environment (the RL task mixture).

`Mixture({name: (env, weight)})`: `task(index, split)` draws which environment index `index`
belongs to from a hash of (seed, split, index) with probability weight / sum of weights, then
returns THAT environment's task `index` (so a task is rebuilt from its index alone, as the
asynchronous trainer does from a rollout file, and each environment's tasks keep their own
splits: `task.env` names the environment). `step` and `worked_solution` go to `task.env`'s
environment; `max_turns` is the largest member's (each member ends its own episodes by its own
limit). A weight of 0 keeps an environment out of training but in the held-out evaluation.
"""

import math

from glm5_jax.posttrain.envs import base
from glm5_jax.seeds import problem_hash


class Mixture(base.Env):
  name = "mixture"

  def __init__(self, members: dict, *, seed: int = 0):  # pylint: disable=super-init-not-called
    if not members:
      raise ValueError("mixture: needs at least one environment")
    weights = {name: float(w) for name, (_, w) in members.items()}
    bad = {n: w for n, w in weights.items() if not (math.isfinite(w) and w >= 0)}
    if bad:
      raise ValueError(f"mixture: weights must be finite and >= 0, got {bad}")
    total = sum(weights.values())
    if not total > 0:
      raise ValueError(f"mixture: the weights {weights} must sum to a positive number")
    self.envs = {name: env for name, (env, _) in members.items()}
    self.weights = {name: w / total for name, w in weights.items()}
    self.seed = seed
    self.options = {"weights": self.weights}

  def __repr__(self):
    return "Mixture(" + ", ".join(f"{e!r}: {w:.3f}" for e, w in self.weights.items()) + ")"

  @property
  def concurrent_steps(self):
    return any(env.concurrent_steps for env in self.envs.values())

  @property
  def max_turns(self):
    return max(env.max_turns for env in self.envs.values())

  def env_of(self, index: int, split: str) -> str:
    u = problem_hash("mixture", self.seed, split, int(index)) / 2.0**64
    acc = 0.0
    chosen = None
    for name, w in self.weights.items():
      if w > 0:
        chosen = name
        acc += w
        if u < acc:
          return name
    return chosen  # u within rounding of 1

  def task(self, index, split):
    if split not in base.SPLITS:
      raise ValueError(f"mixture: split must be one of {base.SPLITS}, got {split!r}")
    return self.envs[self.env_of(index, split)].task(index, split)

  def _member(self, task):
    env = self.envs.get(getattr(task, "env", None))
    if env is None:
      raise ValueError(f"mixture: task of env {getattr(task, 'env', None)!r} is not one of "
                       f"{sorted(self.envs)}")
    return env

  def step(self, task, messages):
    return self._member(task).step(task, messages)

  def worked_solution(self, task):
    return self._member(task).worked_solution(task)
