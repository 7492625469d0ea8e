"""Multi-digit addition and subtraction: "23+45=" -> "68".

Options: `digits` (1..18, default 2): every operand has exactly that many digits (1 digit:
0..9); `operations` (a non-empty subset of "+-", default "+"). Subtraction puts the larger
operand first, so results are never negative. `reward` ("outcome", default, or "checked"; a
scoring option: the problems are the same under both):
  outcome  1 when the last assistant content, stripped, is the result in canonical decimal
           form ("68"; "068" or "+68" are wrong); text that is not an integer is malformed
           (reward 0, with an error);
  checked  as outcome, and the thinking must be the worked column steps below: a right answer
           reached through a wrong column sum, a miscopied operand or a dropped carry (a lucky
           answer) earns 0. An outcome-only reward pays for lucky answers, and RL then
           reinforces the wrong arithmetic behind them (docs/posttrain.md, "Why RL fell").
Either way `info["correct"]` is the answer's correctness (accuracy) and `info["reasoning_ok"]`
whether the thinking is the worked steps, and `difficulty` is the number of carries (borrows).

Prompt: one user message "{a}{op}{b}=".

Worked solution: the thinking adds (subtracts) column by column from the ones digit, writing
carries ("58+67: 8+7=15, 5+6+1=12, carry 1") and borrows ("72-45: 12-5=7 b1, 6-4=2").
"""

from glm5_jax.posttrain.envs import base


def addition_steps(a: int, b: int) -> str:
  """Column-wise addition, ones digit first; a carried 1 is written into the next column."""
  n = max(len(str(a)), len(str(b)))
  da, db = str(a).zfill(n)[::-1], str(b).zfill(n)[::-1]
  parts, carry = [], 0
  for x, y in zip(da, db):
    total = int(x) + int(y) + carry
    parts.append(f"{x}+{y}{'+1' if carry else ''}={total}")
    carry = total // 10
  if carry:
    parts.append("carry 1")
  return f"{a}+{b}: " + ", ".join(parts)


def subtraction_steps(a: int, b: int) -> str:
  """Column-wise a - b (a >= b), ones digit first: the top digit after any borrow, and "b1"
  where the column borrows from the next one."""
  n = len(str(a))
  da, db = str(a)[::-1], str(b).zfill(n)[::-1]
  parts, borrow = [], 0
  for x, y in zip(da, db):
    top, y = int(x) - borrow, int(y)
    borrow = int(top < y)
    top += 10 * borrow
    parts.append(f"{top}-{y}={top - y}{' b1' if borrow else ''}")
  return f"{a}-{b}: " + ", ".join(parts)


def carries(a: int, b: int, op: str) -> int:
  """The columns of a op b (a >= b for "-") that carry into (borrow from) the next one."""
  count, carry = 0, 0
  while a or b:
    x, y, a, b = a % 10, b % 10, a // 10, b // 10
    carry = int(x + y + carry >= 10) if op == "+" else int(x - carry < y)
    count += carry
  return count


REWARDS = ("outcome", "checked")


class Addition(base.SingleTurnEnv):
  name = "addition"
  defaults = {"digits": 2, "operations": "+", "reward": "outcome"}
  scoring_options = ("reward",)

  def _options(self, options):
    return {"digits": self.int_option(options, "digits", 1, 18),
            "operations": self.ops_option(options, "operations", "+-"),
            "reward": self.choice_option(options, "reward", REWARDS)}

  def step(self, task, messages):
    out = super().step(task, messages)
    if out.info["error"] is not None:
      return out  # malformed: no answer to check the reasoning of
    reasoning_ok = (messages[-1].get("thinking") or "").strip() == self._solution(task)[0]
    lucky = out.info["correct"] and not reasoning_ok
    reward = 0.0 if lucky and self.options["reward"] == "checked" else out.reward
    return base.Step(None, reward, True, {**out.info, "reasoning_ok": reasoning_ok})

  def difficulty(self, task):
    carried = carries(task.info["a"], task.info["b"], task.info["op"])
    return f"carries_{carried}" if task.info["op"] == "+" else f"borrows_{carried}"

  def _problem(self, rng):
    digits, ops = self.options["digits"], self.options["operations"]
    lo, hi = (0 if digits == 1 else 10**(digits - 1)), 10**digits - 1
    a, b = (int(v) for v in rng.integers(lo, hi, size=2, endpoint=True))
    op = ops[int(rng.integers(len(ops)))]
    if op == "-" and a < b:
      a, b = b, a
    prompt = f"{a}{op}{b}="
    result = a + b if op == "+" else a - b
    return (base.commutative_key(a, op, b), ({"role": "user", "content": prompt},), str(result),
            {"a": a, "b": b, "op": op})

  def _score(self, task, content):
    error = base.check_integer(content)
    if error:
      return False, error
    return content.strip() == task.answer, None

  def _solution(self, task):
    a, b, op = task.info["a"], task.info["b"], task.info["op"]
    thinking = addition_steps(a, b) if op == "+" else subtraction_steps(a, b)
    return thinking, task.answer
