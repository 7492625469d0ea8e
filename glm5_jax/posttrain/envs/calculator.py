"""Multi-turn tool use: the model calls a calculator, reads the result, then answers.

  system       "Use calc(expression) for arithmetic, then answer."
  user         "What is 483*271?"
  assistant    thinking "483*271 is big: use calc", tool_calls ["calc(483*271)"]
  observation  "130893"
  assistant    thinking "calc returned 130893", content "130893"

Options: `digits` (each operand's exact digit count, 1..9, default 3); `operations` (subset of
"+-*", default "+-*"); `max_turns` (assistant turns allowed, 2..16, default 3). Subtraction may
be negative: the tool does the work.

Tool syntax (strict): each entry of an assistant message's `tool_calls` is the text
`calc(EXPR)` (surrounding whitespace ignored), EXPR an integer expression with + - *,
parentheses and unary minus, at most 64 characters, evaluated by `arith.evaluate` (never
`eval`). One call per turn. A well-formed call's observation is the value ("130893"); a
malformed one gets an observation starting "error: " and the episode continues, so the model can
retry within max_turns.

Episode: a turn with tool calls continues (observation appended) unless it is turn max_turns,
which finishes with reward 0 (a model that never stops calling the tool). A turn without tool
calls is the final answer: reward 1 when its content, stripped, is the result in canonical
decimal form AND the conversation made at least one well-formed calc call. This is a tool-use
env, so a right answer without a call scores 0 (`info["error"]` says so,
`info["answer_correct"]` records the answer alone).
"""

import re

from glm5_jax.posttrain.envs import arith, base

SYSTEM = "Use calc(expression) for arithmetic, then answer."
CALL = re.compile(r"calc\((.*)\)", re.DOTALL)
MAX_EXPR_LEN = 64


def run_tool(call) -> tuple[str, bool]:
  """(observation, well-formed) for one tool call text."""
  if not isinstance(call, str):
    return f"error: a tool call must be text, got {type(call).__name__}", False
  match = CALL.fullmatch(call.strip())
  if not match:
    return f"error: expected calc(expression), got {base.preview(call)}", False
  try:
    value, _ = arith.evaluate(match.group(1), operations="+-*", allow_unary=True,
                              max_len=MAX_EXPR_LEN)
  except arith.ArithError as e:
    return f"error: {e}", False
  return str(value), True


def calls_of(message: dict) -> tuple[list, str | None]:
  calls = message.get("tool_calls") or []
  if not isinstance(calls, (list, tuple)):
    return [], f"tool_calls must be a list of str, got {type(calls).__name__}"
  return list(calls), None


class Calculator(base.Env):
  name = "calculator"
  defaults = {"digits": 3, "operations": "+-*", "max_turns": 3}

  def _options(self, options):
    return {"digits": self.int_option(options, "digits", 1, 9),
            "operations": self.ops_option(options, "operations", "+-*"),
            "max_turns": self.int_option(options, "max_turns", 2, 16)}

  @property
  def max_turns(self):
    return self.options["max_turns"]

  def _problem(self, rng):
    digits, ops = self.options["digits"], self.options["operations"]
    lo, hi = (0 if digits == 1 else 10**(digits - 1)), 10**digits - 1
    a, b = (int(v) for v in rng.integers(lo, hi, size=2, endpoint=True))
    op = ops[int(rng.integers(len(ops)))]
    expr = f"{a}{op}{b}"
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    messages = ({"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is {expr}?"})
    return base.commutative_key(a, op, b), messages, str(result), {"expression": expr}

  def step(self, task, messages):
    turns, error = base.assistant_messages(messages)
    if error:
      return base.finish(False, error, tool_calls=0)
    history = []
    for m in turns[:-1]:
      history += calls_of(m)[0]
    good_calls = sum(run_tool(c)[1] for c in history)
    calls, error = calls_of(turns[-1])
    if error:
      return base.finish(False, error, tool_calls=good_calls)
    if calls:
      if len(turns) >= self.max_turns:
        return base.finish(False, f"still calling the tool at max_turns={self.max_turns}",
                           tool_calls=good_calls)
      if len(calls) > 1:
        observation, ok = f"error: one tool call per turn, got {len(calls)}", False
      else:
        observation, ok = run_tool(calls[0])
      return base.Step(observation, 0.0, False, {
          "correct": False, "error": None if ok else observation, "tool_calls": good_calls + ok})
    content, error = base.content_of(turns[-1])
    error = error or base.check_integer(content)
    if error:
      return base.finish(False, error, tool_calls=good_calls, answer_correct=False)
    answer_correct = content.strip() == task.answer
    if not good_calls:
      return base.finish(False, "answered without a well-formed calc call", tool_calls=0,
                         answer_correct=answer_correct)
    return base.finish(answer_correct, None, tool_calls=good_calls, answer_correct=answer_correct)

  def worked_solution(self, task):
    expr = task.info["expression"]
    result, ok = run_tool(f"calc({expr})")
    assert ok and result == task.answer, (task, result)
    return [dict(m) for m in task.messages] + [
        {"role": "assistant", "thinking": f"{expr} is big: use calc", "content": "",
         "tool_calls": [f"calc({expr})"]},
        {"role": "observation", "content": result},
        {"role": "assistant", "thinking": f"calc returned {result}", "content": result},
    ]
