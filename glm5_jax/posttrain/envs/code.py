"""Function synthesis: the model writes a Python function, hidden unit tests score it.

  user       "Write a Python function f(n) that returns the sum of the digits of the integer
              n >= 0 written in base 7. Example: f(100) == 4. Answer with the code only."
  assistant  thinking "digit_sum in base 7", content "def f(n):\n    t = 0\n ..."

Problems come from `code_problems` (8 generated families with parameters); the canonical key
is the family and its parameters, so the train/eval split never shares a function.

Scoring: the answer's content (a ```python fence around it is removed) is run in the sandbox
(`glm5_jax.posttrain.sandbox`) on `num_tests` hidden inputs, the first of which is the prompt's
example; its outputs are compared with the reference's outside the sandbox (`code_run`).
Option `reward`: "all" (1 when every test passes, else 0) or "fraction" (the share passed).
`info["correct"]` is all-pass either way; `info["passed"]` / `info["tests"]` the counts.

Options: `families` (a subset of code_problems.FAMILIES, default all), `num_tests` (1..64,
default 8), `reward` ("all" | "fraction", default "all"), `max_code_chars` (1..20000, default
2000; longer answers score 0 unrun), `sandbox` (a dict: `sandbox.Limits` fields and
`allow_unsafe`; default {}: the default limits, refusing to run where the OS cannot isolate).
"""

import re

import numpy as np

from glm5_jax.posttrain.envs import base, code_problems, code_run
from glm5_jax.seeds import problem_hash

FENCE = re.compile(r"^\s*```(?:python|py)?\s*\n(.*?)\n?```\s*$", re.DOTALL)
REWARDS = ("all", "fraction")


def strip_fence(text: str) -> str:
  match = FENCE.match(text)
  return match.group(1) if match else text


class Code(base.SingleTurnEnv):
  name = "code"
  concurrent_steps = True  # each step waits on a sandbox process
  defaults = {"families": code_problems.FAMILIES, "num_tests": 8, "reward": "all",
              "max_code_chars": 2000, "sandbox": {}}

  def _options(self, options):
    families = options["families"]
    ok = (isinstance(families, (list, tuple)) and families and
          all(f in code_problems.FAMILIES for f in families) and
          len(set(families)) == len(families))
    self.require(ok, "families", f"must be distinct names from {code_problems.FAMILIES}, got "
                 f"{families!r}")
    self.require(options["reward"] in REWARDS, "reward",
                 f"must be one of {REWARDS}, got {options['reward']!r}")
    self.box = code_run.sandbox_option(self, options["sandbox"])
    return {"families": tuple(f for f in code_problems.FAMILIES if f in families),
            "num_tests": self.int_option(options, "num_tests", 1, 64),
            "reward": options["reward"],
            "max_code_chars": self.int_option(options, "max_code_chars", 1, 20000)}
    # (The sandbox is kept out of `options`, which seed the task draws: limits never change
    # which problems a run sees.)

  def __repr__(self):  # the sandbox dict is long and rarely set
    return f"Code(families={self.options['families']}, reward={self.options['reward']!r})"

  def _problem(self, rng):
    family, params = code_problems.draw(rng, self.options["families"])
    key = code_problems.key(family, params)
    # The hidden inputs depend on the problem alone, not on the draw that found it.
    case_rng = np.random.default_rng(problem_hash(self.name, "cases", key))
    args = code_problems.cases(family, params, case_rng, self.options["num_tests"])
    f = code_problems.reference(family, params)
    expected = [repr(f(*a)) for a in args]
    signature, what = code_problems.describe(family, params)
    example = f"f({', '.join(map(repr, args[0]))}) == {expected[0]}"
    prompt = (f"Write a Python function {signature} that {what}. Example: {example}. "
              "Answer with the code only.")
    info = {"family": family, "params": params, "args": args, "expected": expected}
    return key, ({"role": "user", "content": prompt},), code_problems.solution(family, params), info

  def _score(self, task, content):
    info = self.score_code(task, content)
    return info["correct"], info["error"]

  def score_code(self, task, content: str) -> dict:
    """{"correct", "error", "passed", "tests", "fraction"} of `content` on the hidden tests."""
    code = strip_fence(content)
    n = len(task.info["args"])
    out = {"correct": False, "error": None, "passed": 0, "tests": n, "fraction": 0.0}
    if not code.strip():
      out["error"] = "empty answer"
    elif len(code) > self.options["max_code_chars"]:
      out["error"] = f"the code has {len(code)} characters, more than max_code_chars"
    else:
      outputs, error, _ = code_run.run_function({"solution.py": code}, "solution", "f",
                                                task.info["args"], self.box)
      if error:
        out["error"] = error
      else:
        ok = code_run.passed(outputs, task.info["expected"])
        out.update(passed=sum(ok), fraction=sum(ok) / n, correct=all(ok))
    return out

  def step(self, task, messages):
    turns, error = base.assistant_messages(messages)
    content, error = (None, error) if error else base.content_of(turns[-1])
    if error:
      return base.finish(False, error, passed=0, tests=len(task.info["args"]))
    info = self.score_code(task, content)
    reward = info["fraction"] if self.options["reward"] == "fraction" else float(info["correct"])
    return base.Step(None, reward, True, info)

  def _solution(self, task):
    family, params = task.info["family"], task.info["params"]
    hint = ", ".join(f"{k}={v!r}" for k, v in sorted(params.items()))
    return f"{family} with {hint}", task.answer
