"""Copy a string whose length is heavy-tailed: "copy: qwhzk" -> "qwhzk".

An environment for benchmarking rollouts with long-tailed response lengths (issue 15, the
sync-vs-async benchmark): most tasks are a few letters, a few are long, so in a synchronous
batch the longest response sets the pace while most slots sit idle.

Length law: a Pareto of shape `alpha` and scale `min_len`, truncated to [min_len, max_len]
(drawn by inverting its CDF, so no draw is wasted) and floored to an int:

  u ~ U[0, 1),  L = floor(min_len * (1 - u * (1 - (min_len / max_len) ** alpha)) ** (-1 / alpha))

With the defaults (min_len 2, max_len 32, alpha 1.0) the median is 3 and the 90th percentile
12 (p90/p50 ~ 4; tests/test_echo_env.py measures it over 1000 tasks). Smaller `alpha` gives a
heavier tail. Letters are drawn uniformly from a-z with repeats.

Options: `min_len` (1..256, default 2), `max_len` (min_len..256, default 32; with the default a
worked response is at most 44 tokens with the byte tokenizer, inside configs/rl_tiny.py's
max_new_tokens=48), `alpha` (a float in (0, 16], default 1.0), `partial` (bool, default False).

Prompt: one user message "copy: {text}". Reward 1 when the last assistant content, stripped of
surrounding whitespace, is exactly the text. With `partial=False` anything else scores 0. With
`partial=True` a wrong copy earns the share of positions right in the longest common prefix,
`prefix / max(len(text), len(content))` (so padding or truncating both cost), times 0.5 so that
no partial copy is worth as much as half an exact one; `info["correct"]` stays exact-only.
Empty content is malformed (reward 0, an error).

Worked solution: the thinking names the length ("5 letters"), the content is the text.
"""

import math
import string

from glm5_jax.posttrain.envs import base

ALPHABET = string.ascii_lowercase
MAX_LEN = 256
PARTIAL_WEIGHT = 0.5


def pareto_length(u: float, min_len: int, max_len: int, alpha: float) -> int:
  """The truncated-Pareto length for a uniform draw `u` in [0, 1) (inverse CDF, floored)."""
  tail = 1.0 - (min_len / max_len) ** alpha
  length = min_len * (1.0 - u * tail) ** (-1.0 / alpha)
  return max(min_len, min(max_len, math.floor(length)))


def common_prefix(a: str, b: str) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


class Echo(base.SingleTurnEnv):
  name = "echo"
  defaults = {"min_len": 2, "max_len": 32, "alpha": 1.0, "partial": False}

  def _options(self, options):
    lo = self.int_option(options, "min_len", 1, MAX_LEN)
    hi = self.int_option(options, "max_len", lo, MAX_LEN)
    alpha = options["alpha"]
    self.require(isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
                 and 0 < alpha <= 16, "alpha", f"must be a number in (0, 16], got {alpha!r}")
    partial = options["partial"]
    self.require(isinstance(partial, bool), "partial", f"must be a bool, got {partial!r}")
    return {"min_len": lo, "max_len": hi, "alpha": float(alpha), "partial": partial}

  def _problem(self, rng):
    o = self.options
    n = pareto_length(float(rng.random()), o["min_len"], o["max_len"], o["alpha"])
    text = "".join(ALPHABET[i] for i in rng.integers(len(ALPHABET), size=n))
    prompt = f"copy: {text}"
    return prompt, ({"role": "user", "content": prompt},), text, {"text": text, "length": n}

  def step(self, task, messages):
    turns, error = base.assistant_messages(messages)
    if error:
      return base.finish(False, error)
    content, error = base.content_of(turns[-1])
    if error:
      return base.finish(False, error)
    answer = content.strip()
    if not answer:
      return base.finish(False, "empty answer")
    if answer == task.answer or not self.options["partial"]:
      return base.finish(answer == task.answer)
    share = common_prefix(answer, task.answer) / max(len(answer), len(task.answer))
    return base.Step(None, PARTIAL_WEIGHT * share, True, {"correct": False, "error": None})

  def _solution(self, task):
    return f"{len(task.answer)} letters", task.answer
