"""What every environment shares: Task, Step, the Env base class, deterministic draws, splits.

Tasks. `Env.task(index, split)` draws a problem from a numpy Generator seeded by a hash of
(env name, options, split, index, draw); it keeps the first draw whose problem belongs to
`split`. A problem's split is a hash of its canonical key alone (`split_of`), the same in every
environment: the calculator's "What is 23+45?" and addition's "23+45=" share the key "23+45",
the code env's function and the repo-repair env's repaired function share
`code_problems.key`, so a problem held out in one environment is never trained on in another
(a mixture checks this when built: `mixture.split_leaks`). The canonical key is the same for
every problem that is the same fact written another way (each env's `_problem` says how:
commutative operands sorted, "45+23=" and "23+45=" -> "23+45"; countdown's numbers sorted; a
string and its reverse for reversal, the letters' multiset for sorting), so a held-out problem
never has a twin in train. It is in the same split under every option set and seed, and
re-drawing costs ~1 / EVAL_SHARE draws for an eval task. Any task can be rebuilt alone from
its index. (Until issue 43 the hash also took the env's name: each env's held-out set moved
once then.)

Options. Each env lists its options with defaults (`defaults`); every env also takes `seed`
(int, default 0), which only selects another stream of tasks (the split of a problem never
depends on it). Options named in `scoring_options` change only how an answer is scored, never
which problems are drawn: task i is the same problem with or without them (an RL run with a
stricter reward trains and evaluates on the SFT run's problems). Unknown options and bad values
raise ValueError naming the env and the option.

Signal (for RL's logs, `glm5_jax.posttrain.learning_signal`): `difficulty(task)` names a task's difficulty
bucket where the env has one (addition: its carries), and an env that can check the reasoning
behind an answer records `info["reasoning_ok"]` in its finishing Step.

Steps. `step(task, messages)` reads the model's answer from the LAST assistant message of the
conversation (its `content`, and `tool_calls` where the env has tools; never `thinking`) and
either finishes with a reward in [0, 1] or returns an observation to append and continues.
It never raises on what a model wrote: a malformed answer or conversation finishes with reward
0, `info["correct"]` False and `info["error"]` saying why. `info["error"]` is None for a
well-formed answer (right or wrong).
"""

import dataclasses
import re
from typing import Any, NamedTuple

import numpy as np

from glm5_jax.seeds import problem_hash

SPLITS = ("train", "eval")
EVAL_SHARE = 5  # one problem in EVAL_SHARE is held out
MAX_DRAWS = 10_000
INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only: str.isdigit() also accepts e.g. "٣"


@dataclasses.dataclass(frozen=True)
class Task:
  """One problem. `messages` is the prompt conversation (system / user) to render; `answer` is
  the reference final answer (a str; for countdown one solution of possibly many); `info` holds
  the problem's parts (operands, numbers, target, ...)."""
  env: str
  index: int
  split: str
  messages: tuple[dict, ...]
  answer: Any
  info: dict
  key: str = ""  # the canonical key: decides the split, shared by the problem's twins


class Step(NamedTuple):
  """`observation`: the content of an observation message to append (not done), else None."""
  observation: str | None
  reward: float
  done: bool
  info: dict


def commutative_key(a: int, op: str, b: int) -> str:
  """"a op b" with the operands of + and * sorted: the key of a binary arithmetic problem."""
  if op in "+*":
    a, b = sorted((a, b))
  return f"{a}{op}{b}"


def split_of(problem_key: str) -> str:
  """The split a problem belongs to: a property of its canonical key alone, in every env."""
  return "eval" if problem_hash("split", problem_key) % EVAL_SHARE == 0 else "train"


def preview(value, limit: int = 40) -> str:
  """`repr(value)` cut to `limit` characters, for error messages about model output."""
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "...'"


def finish(correct: bool, error: str | None = None, **info) -> Step:
  return Step(None, 1.0 if correct else 0.0, True, {"correct": bool(correct), "error": error,
                                                    **info})


def assistant_messages(messages) -> tuple[list[dict], str | None]:
  """The assistant messages of a conversation, or an error when it is not a list of dicts
  ending with an assistant message."""
  if not isinstance(messages, (list, tuple)):
    return [], f"messages must be a list of dicts, got {type(messages).__name__}"
  turns = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      return [], f"message {i} is a {type(m).__name__}, not a dict"
    if m.get("role") == "assistant":
      turns.append(m)
  if not turns:
    return [], "no assistant message"
  if messages[-1] is not turns[-1]:
    return [], "the conversation must end with the assistant turn to score"
  return turns, None


def content_of(message: dict) -> tuple[str | None, str | None]:
  content = message.get("content")
  if not isinstance(content, str):
    return None, f"assistant content must be a str, got {type(content).__name__}"
  return content, None


def check_integer(text: str) -> str | None:
  """None when `text` (stripped) is an integer in canonical ASCII decimal form, else why not."""
  if not INTEGER.fullmatch(text.strip()):
    return f"expected an integer, got {preview(text)}"
  return None


def replay(env, task: Task, messages) -> Step:
  """Steps `env` through a finished conversation as a rollout would: after each assistant
  message either the episode continues and the next message is the observation the env returns,
  or it is done; returns the last Step. Raises ValueError where the conversation departs from
  what the env does (a check for worked solutions and recorded rollouts)."""
  prompt_len = len(task.messages)
  for k in range(prompt_len, len(messages)):
    if messages[k].get("role") != "assistant":
      continue
    step = env.step(task, messages[:k + 1])
    last = k + 1 == len(messages)
    if step.done != last:
      state = "done" if step.done else "not done"
      raise ValueError(f"{env.name} task {task.index}: the env is {state} after message {k} of "
                       f"{len(messages)}")
    if step.done:
      return step
    following = messages[k + 1]
    if following.get("role") != "observation" or following.get("content") != step.observation:
      raise ValueError(f"{env.name} task {task.index}: message {k + 1} is {following!r}, the env "
                       f"returned the observation {step.observation!r}")
  raise ValueError(f"{env.name} task {task.index}: no assistant message after the prompt")


class Env:
  """A verifiable environment; subclasses set `name`, `defaults`, and implement `_options`,
  `_problem`, `step` and `worked_solution` (single-turn ones via `SingleTurnEnv`)."""

  name = ""
  max_turns = 1
  defaults: dict = {}
  scoring_options: tuple = ()  # options that change the reward, not the problems (docstring)
  # True where `step` mostly waits on another process (the sandboxed code envs): callers may
  # then step several episodes at once from threads (rollouts, the built-in SFT set).
  concurrent_steps = False

  def __init__(self, **options):
    allowed = {**self.defaults, "seed": 0}
    unknown = sorted(set(options) - set(allowed))
    if unknown:
      raise ValueError(f"envs.{self.name}: unknown option(s) {unknown}; expected some of "
                       f"{sorted(allowed)}")
    merged = {**allowed, **options}
    seed = merged.pop("seed")
    self.require(isinstance(seed, int) and not isinstance(seed, bool), "seed",
                 f"must be an int, got {seed!r}")
    self.seed = seed
    self.options = self._options(merged)

  def __repr__(self):
    opts = ", ".join(f"{k}={v!r}" for k, v in sorted(self.options.items()))
    return f"{type(self).__name__}({opts}, seed={self.seed})"

  def require(self, ok: bool, option: str, message: str) -> None:
    if not ok:
      raise ValueError(f"envs.{self.name}: option {option!r} {message}")

  def int_option(self, options: dict, option: str, lo: int, hi: int) -> int:
    value = options[option]
    self.require(isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi,
                 option, f"must be an int in [{lo}, {hi}], got {value!r}")
    return value

  def choice_option(self, options: dict, option: str, choices: tuple) -> str:
    value = options[option]
    self.require(value in choices, option, f"must be one of {choices}, got {value!r}")
    return value

  def ops_option(self, options: dict, option: str, allowed: str) -> str:
    """A non-empty set of operator characters from `allowed`, as a str in `allowed`'s order
    (accepts "+-" or ("+", "-"))."""
    value = options[option]
    ok = isinstance(value, (str, list, tuple)) and all(isinstance(v, str) for v in value)
    chars = "".join(value) if ok else ""
    self.require(ok and chars and set(chars) <= set(allowed) and len(set(chars)) == len(chars),
                 option, f"must be distinct operators from {allowed!r}, got {value!r}")
    return "".join(c for c in allowed if c in chars)

  def _options(self, options: dict) -> dict:
    """Validates and normalizes the options (without seed)."""
    raise NotImplementedError

  def _problem(self, rng: np.random.Generator) -> tuple[str, tuple[dict, ...], Any, dict]:
    """Draws one problem: (canonical key, prompt messages, answer, info); the key is shared by
    the problem's twins (module docstring)."""
    raise NotImplementedError

  def task(self, index: int, split: str) -> Task:
    if not isinstance(index, (int, np.integer)) or isinstance(index, bool) or index < 0:
      raise ValueError(f"envs.{self.name}: task index must be an int >= 0, got {index!r}")
    if split not in SPLITS:
      raise ValueError(f"envs.{self.name}: split must be one of {SPLITS}, got {split!r}")
    index = int(index)
    options = tuple(sorted((k, v) for k, v in self.options.items()
                           if k not in self.scoring_options))
    for draw in range(MAX_DRAWS):
      rng = np.random.default_rng(problem_hash(self.name, options, self.seed, split, index, draw))
      key, messages, answer, info = self._problem(rng)
      if self.split_of_key(key) == split:
        return Task(self.name, index, split, messages, answer, info, key)
    raise ValueError(f"envs.{self.name}: no {split} problem in {MAX_DRAWS} draws with options "
                     f"{self.options}; the problem space is too small")

  def split_of_key(self, key: str) -> str:
    """This env's split of a problem key: `split_of`, shared by every env (never override)."""
    return split_of(key)

  def step(self, task: Task, messages) -> Step:
    raise NotImplementedError

  def difficulty(self, task: Task) -> str | None:
    """A short label of the task's difficulty bucket (e.g. "carries_1"), or None where the env
    has no notion of one; RL logs its reward per bucket."""
    del task
    return None

  def worked_solution(self, task: Task) -> list[dict]:
    raise NotImplementedError


class SingleTurnEnv(Env):
  """One assistant turn, scored by `_score(task, content) -> (correct, error)`; the worked
  solution is one thinking turn `_solution(task) -> (thinking, content)`."""

  def _score(self, task: Task, content: str) -> tuple[bool, str | None]:
    raise NotImplementedError

  def _solution(self, task: Task) -> tuple[str, str]:
    raise NotImplementedError

  def step(self, task: Task, messages) -> Step:
    turns, error = assistant_messages(messages)
    if error:
      return finish(False, error)
    content, error = content_of(turns[-1])
    if error:
      return finish(False, error)
    return finish(*self._score(task, content))

  def worked_solution(self, task: Task) -> list[dict]:
    thinking, content = self._solution(task)
    return [dict(m) for m in task.messages] + [
        {"role": "assistant", "thinking": thinking, "content": content}]
