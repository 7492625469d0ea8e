"""A weighted mixture of environments behaving as one environment (the RL task mixture).

`Mixture({name: (env, weight)})`: `task(index, split)` draws which environment index `index`
belongs to from a hash of (seed, split, index) with probability weight / sum of weights, then
returns THAT environment's task `index` (so a task is rebuilt from its index alone, as the
asynchronous trainer does from a rollout file, and each environment's tasks keep their own
splits: `task.env` names the environment). `step` and `worked_solution` go to `task.env`'s
environment; `max_turns` is the largest member's (each member ends its own episodes by its own
limit). A weight of 0 keeps an environment out of training but in the held-out evaluation.

Splits are by problem content, shared by every environment (`base.split_of`), so the same
problem is never eval in one member and train in another. The mixture checks it when built
(`split_leaks`: each member's first LEAK_SAMPLE eval problems must be eval in every other
member too) and refuses a leak with a ValueError naming the members and the count.
"""

import math

from glm5_jax.posttrain.envs import base
from glm5_jax.seeds import problem_hash

LEAK_SAMPLE = 16  # with a split per env name, ~80% of these would leak: 16 never miss it


def split_leaks(members: dict, n: int = LEAK_SAMPLE) -> dict:
  """{(a, b): how many of env a's first `n` eval problems env b's split puts in train}, for
  the pairs with any (none when every env uses the shared `base.split_of`)."""
  leaks = {}
  for a, env_a in members.items():
    eval_keys = [env_a.task(i, "eval").key for i in range(n)]
    for b, env_b in members.items():
      count = sum(b != a and env_b.split_of_key(k) == "train" for k in eval_keys)
      if count:
        leaks[(a, b)] = count
  return leaks


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
    leaks = split_leaks(self.envs) if len(self.envs) > 1 else {}
    if leaks:
      raise ValueError("mixture: splits leak across environments: " + "; ".join(
          f"{n} of {LEAK_SAMPLE} eval problems of {a!r} are train problems of {b!r}"
          for (a, b), n in sorted(leaks.items())) + " (each env must split with base.split_of)")
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
