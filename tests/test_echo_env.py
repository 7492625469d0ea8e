"""The echo environment: deterministic heavy-tailed lengths, exact and partial rewards, worked
solutions that fit the RL response budget."""

import numpy as np
import pytest

from glm5_jax.data import chat, tokenizers
from glm5_jax.posttrain import envs, sft_data
from glm5_jax.posttrain.envs import echo


def reply(env, task, content):
  return env.step(task, list(task.messages) + [
      {"role": "assistant", "thinking": "", "content": content}])


def lengths(env, n=1000, split="train"):
  return np.array([env.task(i, split).info["length"] for i in range(n)])


def test_deterministic_and_seeded():
  a, b = envs.make("echo"), envs.make("echo")
  tasks = [a.task(i, "train") for i in range(50)]
  assert tasks == [b.task(i, "train") for i in range(50)]
  assert tasks != [envs.make("echo", seed=1).task(i, "train") for i in range(50)]
  for t in tasks:
    assert t.messages == ({"role": "user", "content": f"copy: {t.answer}"},)
    assert t.answer == t.info["text"] and len(t.answer) == t.info["length"]
    assert set(t.answer) <= set(echo.ALPHABET)


def test_lengths_are_heavy_tailed_and_bounded():
  """Defaults: median 3, p90 12 (the docstring's figures) over 1000 tasks, range [2, 32]; a
  uniform length law on [2, 32] would give p90/p50 ~ 1.7."""
  n = lengths(envs.make("echo"))
  p50, p90 = np.percentile(n, 50), np.percentile(n, 90)
  assert n.min() >= 2 and n.max() <= 32 and n.max() >= 24, (n.min(), n.max())
  assert p90 / p50 >= 3.0, (p50, p90)
  assert 2.5 <= p50 <= 4.5 and 10 <= p90 <= 15, (p50, p90)
  # A smaller alpha has a heavier tail; the law follows the inverse CDF in the docstring.
  heavier = lengths(envs.make("echo", alpha=0.5, max_len=64), n=500)
  assert np.percentile(heavier, 90) / np.percentile(heavier, 50) > p90 / p50
  assert echo.pareto_length(0.0, 2, 32, 1.0) == 2
  assert echo.pareto_length(0.5, 2, 32, 1.0) == 3  # 2 / (1 - 0.5 * 15/16) = 3.76
  assert echo.pareto_length(0.9, 2, 32, 1.0) == 12  # 2 / 0.15625 = 12.8
  assert echo.pareto_length(0.999999, 2, 32, 1.0) == 31  # floor keeps max_len rare
  assert echo.pareto_length(0.7, 5, 5, 1.0) == 5


def test_train_and_eval_disjoint():
  env = envs.make("echo")
  train = {env.task(i, "train").answer for i in range(500)}
  evals = {env.task(i, "eval").answer for i in range(200)}
  assert not train & evals and len(evals) > 50


def test_rewards_exact():
  env = envs.make("echo")
  task = next(t for t in (env.task(i, "train") for i in range(50)) if len(t.answer) >= 4)
  text = task.answer
  assert reply(env, task, text).reward == 1.0
  assert reply(env, task, f"  {text}\n").info == {"correct": True, "error": None}
  for wrong in (text[:-1], text + "a", text.upper(), text[::-1] if text[::-1] != text else "z",
                " ".join(text), "x" * 10_000):
    step = reply(env, task, wrong)
    assert step.done and step.reward == 0.0 and step.info == {"correct": False, "error": None}
  for malformed in ("", "  \n"):
    step = reply(env, task, malformed)
    assert step.reward == 0.0 and step.info["error"] == "empty answer"
  assert env.step(task, list(task.messages)).info["error"] == "no assistant message"


def test_rewards_partial():
  env = envs.make("echo", partial=True)
  task = envs.Task("echo", 0, "train", ({"role": "user", "content": "copy: abcdefgh"},),
                   "abcdefgh", {"text": "abcdefgh", "length": 8})
  assert reply(env, task, "abcdefgh").reward == 1.0
  assert reply(env, task, "abcdxxxx").reward == pytest.approx(0.5 * 4 / 8)
  assert reply(env, task, "abcd").reward == pytest.approx(0.5 * 4 / 8)
  assert reply(env, task, "abcdefghabcdefgh").reward == pytest.approx(0.5 * 8 / 16)
  step = reply(env, task, "zbcdefgh")
  assert step.reward == 0.0 and step.info == {"correct": False, "error": None}
  assert reply(env, task, "abcdefgx").info["correct"] is False


def test_option_errors():
  for options, option in (({"alpha": 0}, "alpha"), ({"alpha": True}, "alpha"),
                          ({"alpha": "1"}, "alpha"), ({"min_len": 0}, "min_len"),
                          ({"min_len": 9, "max_len": 8}, "max_len"), ({"max_len": 999}, "max_len"),
                          ({"partial": 1}, "partial"), ({"length": 3}, "length")):
    with pytest.raises(ValueError, match=f"envs.echo: .*{option}"):
      envs.make("echo", **options)


def test_sft_solutions_valid_and_fit_the_rl_budget():
  """Every worked solution earns 1 through the chat format, and with the defaults the response
  (thinking + content + stop tokens) fits configs/rl_tiny.py's max_new_tokens=48."""
  tok = tokenizers.ByteTokenizer()
  env = envs.make("echo", max_len=32)
  longest = 0
  for i in range(200):
    task = env.task(i, "train")
    conversation = env.worked_solution(task)
    assert envs.replay(env, task, conversation).reward == 1.0
    prompt = chat.render_prompt(list(task.messages), tok)
    response = chat.render(conversation, tok).ids[len(prompt):]
    parsed = chat.parse_response(response, tok)
    assert parsed.content == task.answer and parsed.stop == "<eos>"
    longest = max(longest, len(response))
  worst = env.worked_solution(envs.Task("echo", 0, "train", (
      {"role": "user", "content": "copy: " + "a" * 32},), "a" * 32, {}))
  worst_len = len(chat.render(worst, tok).ids) - len(chat.render_prompt(worst[:1], tok))
  assert longest <= worst_len <= 48, (longest, worst_len)
  lines = sft_data.builtin_lines(["echo"], 20, seed=0)
  assert len(lines) == 20
