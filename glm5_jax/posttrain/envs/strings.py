"""String manipulation: reverse or sort a short lowercase string ("reverse: abcde" -> "edcba").

Options: `op` ("reverse" or "sort", default "reverse"); `min_len` / `max_len` (the string's
length range, inclusive, 1..32, defaults 3 and 8). Letters are drawn from a-z with repeats;
sorting keeps the repeats.

Prompt: one user message "{op}: {text}". Reward 1 when the last assistant content, stripped of
surrounding whitespace, is exactly the result; anything else (other letters, inner spaces,
another case) scores 0. There is no malformed form: any text is just right or wrong, except
empty content (an error).

Worked solution: the thinking spells the letters out in the result's order, one at a time
("from the end: e d c b a", "in order: a b c d").
"""

import string

from glm5_jax.posttrain.envs import base

OPS = ("reverse", "sort")
ALPHABET = string.ascii_lowercase


class Strings(base.SingleTurnEnv):
  name = "strings"
  defaults = {"op": "reverse", "min_len": 3, "max_len": 8}

  def _options(self, options):
    self.require(options["op"] in OPS, "op", f"must be one of {OPS}, got {options['op']!r}")
    lo = self.int_option(options, "min_len", 1, 32)
    hi = self.int_option(options, "max_len", lo, 32)
    return {"op": options["op"], "min_len": lo, "max_len": hi}

  def _problem(self, rng):
    op = self.options["op"]
    n = int(rng.integers(self.options["min_len"], self.options["max_len"], endpoint=True))
    text = "".join(ALPHABET[i] for i in rng.integers(len(ALPHABET), size=n))
    result = text[::-1] if op == "reverse" else "".join(sorted(text))
    prompt = f"{op}: {text}"
    # Twins: reversing a string and its reverse is one fact; sorting depends on the letters only.
    key = min(text, text[::-1]) if op == "reverse" else result
    return f"{op}: {key}", ({"role": "user", "content": prompt},), result, {"op": op, "text": text}

  def _score(self, task, content):
    if not content.strip():
      return False, "empty answer"
    return content.strip() == task.answer, None

  def _solution(self, task):
    label = "from the end" if task.info["op"] == "reverse" else "in order"
    return f"{label}: {' '.join(task.answer)}", task.answer
