"""Verifiable environments: rewards on right / wrong / malformed answers, determinism, disjoint
splits, worked solutions, the calculator's multi-turn flow, and the built-in SFT set."""

import json
import os
import random
import re

import numpy as np
import pytest

from glm5_jax import data
from glm5_jax.data import chat, tokenizers
from glm5_jax.posttrain import envs, sft_data
from glm5_jax.posttrain.envs import arith, base

# Option sets every generic test runs on: the defaults plus the non-default corners.
OPTION_SETS = [
    ("addition", {}), ("addition", {"digits": 1, "operations": "+-"}),
    ("addition", {"digits": 5, "operations": "-"}),
    ("countdown", {}), ("countdown", {"count": 5, "max_number": 25, "operations": "+*"}),
    ("countdown", {"count": 2, "operations": "*/"}),
    ("strings", {}), ("strings", {"op": "sort", "min_len": 1, "max_len": 12}),
    ("calculator", {}), ("calculator", {"digits": 1, "operations": "-", "max_turns": 2}),
    ("echo", {}), ("echo", {"min_len": 1, "max_len": 80, "alpha": 0.5, "partial": True}),
]
# Envs that run the model's code in the sandbox (tests/test_code_envs.py covers them; each step
# starts a process, so the generic tests below give them fewer steps), and the rest, whose
# worked solutions fit the tiny model's 256 tokens.
SANDBOXED = ("code", "repo_repair")
PLAIN = tuple(n for n in envs.NAMES if n not in SANDBOXED)
IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in opts.items()) or 'default'}"
       for name, opts in OPTION_SETS]


def assistant(content, thinking="...", tool_calls=None):
  m = {"role": "assistant", "thinking": thinking, "content": content}
  if tool_calls is not None:
    m["tool_calls"] = tool_calls
  return m


def answer_step(env, task, content, **kw):
  return env.step(task, list(task.messages) + [assistant(content, **kw)])


def assert_malformed(step):
  assert step.done and step.reward == 0.0 and step.info["correct"] is False
  assert isinstance(step.info["error"], str) and step.info["error"], step


# ---------------------------------------------------------------------------------------------
# Construction, determinism, splits

def test_make_names_and_option_errors():
  assert envs.NAMES == ("addition", "countdown", "strings", "calculator", "echo", "code",
                        "repo_repair")
  with pytest.raises(ValueError, match="unknown environment 'chess'"):
    envs.make("chess")
  bad = [("addition", {"digits": 0}, "digits"), ("addition", {"digits": True}, "digits"),
         ("addition", {"operations": "*"}, "operations"),
         ("addition", {"operations": "++"}, "operations"),
         ("addition", {"bits": 3}, "bits"), ("addition", {"seed": "x"}, "seed"),
         ("countdown", {"operations": "-/"}, "operations"),
         ("countdown", {"count": 7}, "count"), ("countdown", {"max_number": 1}, "max_number"),
         ("strings", {"op": "upper"}, "op"), ("strings", {"min_len": 5, "max_len": 4}, "max_len"),
         ("calculator", {"max_turns": 1}, "max_turns"),
         ("calculator", {"operations": "/"}, "operations")]
  for name, options, option in bad:
    with pytest.raises(ValueError, match=f"envs.{name}: .*{option}"):
      envs.make(name, **options)
  env = envs.make("addition", operations=("-", "+"))
  assert env.options == {"digits": 2, "operations": "+-", "reward": "outcome"}
  with pytest.raises(ValueError, match="split"):
    env.task(0, "test")
  with pytest.raises(ValueError, match="index"):
    env.task(-1, "train")


@pytest.mark.parametrize("name,options", OPTION_SETS, ids=IDS)
def test_tasks_are_deterministic(name, options):
  a, b = envs.make(name, **options), envs.make(name, **options)
  for split in base.SPLITS:
    tasks = [a.task(i, split) for i in range(20)]
    assert tasks == [b.task(i, split) for i in reversed(range(20))][::-1]
    assert all(t.env == name and t.split == split for t in tasks)
    # Indices give different problems (countdown count=2 */ has only 6 eval problems).
    assert len({problem(t) for t in tasks}) >= 5
  other = envs.make(name, seed=1, **options)
  assert [a.task(i, "train") for i in range(20)] != [other.task(i, "train") for i in range(20)]


def problem(task):
  return tuple(m["content"] for m in task.messages)


@pytest.mark.parametrize("name,options", OPTION_SETS, ids=IDS)
def test_train_and_eval_never_share_a_problem(name, options):
  train = {problem(envs.make(name, seed=s, **options).task(i, "train"))
           for s in range(2) for i in range(300)}
  evals = {problem(envs.make(name, seed=s, **options).task(i, "eval"))
           for s in range(2) for i in range(100)}
  assert not train & evals
  assert len(evals) > 1


def twin_class(task):
  """The problems that are one fact written another way, spelled out independently of the envs'
  canonical keys."""
  info = task.info
  if task.env == "addition":
    a, b, op = info["a"], info["b"], info["op"]
    return (op, *sorted((a, b))) if op == "+" else (op, a, b)
  if task.env == "calculator":
    a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", info["expression"]).groups()
    return (op, *sorted((int(a), int(b)))) if op in "+*" else (op, int(a), int(b))
  if task.env == "strings":
    text = info["text"]
    return ("reverse", frozenset((text, text[::-1]))) if info["op"] == "reverse" else (
        "sort", "".join(sorted(text)))
  if task.env == "countdown":
    return tuple(info["numbers"]), info["target"]
  return info["text"]  # echo: only the text itself


@pytest.mark.parametrize("name,options", [
    ("addition", {"digits": 1}), ("calculator", {"digits": 1, "operations": "+*"}),
    ("strings", {"min_len": 2, "max_len": 3}), ("strings", {"op": "sort", "max_len": 4}),
    ("countdown", {"count": 2, "max_number": 6}), ("echo", {"min_len": 1, "max_len": 2})])
def test_no_eval_task_has_its_twin_in_train(name, options):
  """Small problem spaces, where twins are common (with one-digit addition hashed by its prompt,
  361 of 400 eval tasks had their swapped twin in train)."""
  env = envs.make(name, **options)
  train = {twin_class(env.task(i, "train")) for i in range(400)}
  evals = {twin_class(env.task(i, "eval")) for i in range(100)}
  assert not train & evals
  assert len(evals) > 1


def test_split_covers_a_small_problem_space():
  """1-digit addition has 100 problems: the splits partition them (about 1 in 5 held out)."""
  env = envs.make("addition", digits=1)
  train = {problem(env.task(i, "train")) for i in range(2000)}
  evals = {problem(env.task(i, "eval")) for i in range(500)}
  assert not train & evals and len(train | evals) == 100
  assert 5 <= len(evals) <= 40


@pytest.mark.parametrize("name,options", OPTION_SETS, ids=IDS)
def test_worked_solutions_earn_reward_one(name, options):
  env = envs.make(name, **options)
  for split in base.SPLITS:
    for i in range(150):
      task = env.task(i, split)
      conversation = env.worked_solution(task)
      assert conversation[:len(task.messages)] == list(task.messages)
      for m in conversation[len(task.messages):]:
        assert m["role"] in ("assistant", "observation")
        if m["role"] == "assistant":
          assert isinstance(m["thinking"], str) and 0 < len(m["thinking"]) < 120
      step = envs.replay(env, task, conversation)
      assert step.reward == 1.0 and step.info["correct"] and step.info["error"] is None, (
          task, conversation, step)
      # The answer is read from content: the same turn with the answer only in thinking fails.
      last = dict(conversation[-1], thinking=conversation[-1]["content"], content="")
      assert env.step(task, conversation[:-1] + [last]).reward == 0.0


def test_worked_solution_examples():
  """The thinking formats the docstrings promise."""
  add = envs.make("addition", operations="+-")
  task = base.Task("addition", 0, "train", ({"role": "user", "content": "58+67="},), "125",
                   {"a": 58, "b": 67, "op": "+"})
  assert add.worked_solution(task)[-1] == {"role": "assistant", "content": "125",
                                           "thinking": "58+67: 8+7=15, 5+6+1=12, carry 1"}
  task = base.Task("addition", 0, "train", ({"role": "user", "content": "72-45="},), "27",
                   {"a": 72, "b": 45, "op": "-"})
  assert add.worked_solution(task)[-1]["thinking"] == "72-45: 12-5=7 b1, 6-4=2"
  task = base.Task("addition", 0, "train", ({"role": "user", "content": "1000-999="},), "1",
                   {"a": 1000, "b": 999, "op": "-"})
  assert add.worked_solution(task)[-1]["thinking"] == (
      "1000-999: 10-9=1 b1, 9-9=0 b1, 9-9=0 b1, 0-0=0")


# ---------------------------------------------------------------------------------------------
# Rewards: right, wrong, malformed

def task_with_answer(env, answer_ok):
  return next(t for t in (env.task(i, "train") for i in range(500)) if answer_ok(t))


def test_addition_rewards():
  env = envs.make("addition", digits=2, operations="+-")
  task = env.task(0, "train")
  n = int(task.answer)
  assert answer_step(env, task, task.answer).reward == 1.0
  assert answer_step(env, task, f"  {task.answer}\n").reward == 1.0
  for wrong in (str(n + 1), str(-n) if n else "1", "0" + task.answer, "1" + task.answer,
                "9" * 100_000):
    step = answer_step(env, task, wrong)
    assert step.done and step.reward == 0.0 and step.info == {"correct": False, "error": None,
                                                               "reasoning_ok": False}
  arabic = "".join(chr(0x660 + int(d)) for d in task.answer)  # int() would accept these digits
  for malformed in ("", "   ", "abc", arabic, f"+{n}", f"{n}.0", f"{n} is the answer",
                    f"{n // 10} {n % 10}", "x" * 100_000, "\x00", "\ud800", "🙂"):
    assert_malformed(answer_step(env, task, malformed))
  assert answer_step(env, task, "x" * 100_000).info["error"].endswith("...'")  # cut preview


def test_countdown_rewards():
  env = envs.make("countdown")
  task = base.Task("countdown", 0, "train", ({"role": "user", "content": "Make 17 from 3 4 5"},),
                   "3*4+5", {"numbers": [3, 4, 5], "target": 17, "steps": []})
  for right in ("3*4+5", " 5+4*3 ", "(4*3)+(5)", "5 + 3 * 4"):
    assert answer_step(env, task, right).reward == 1.0, right
  task12 = base.Task("countdown", 0, "train", task.messages, "3*4",
                     {"numbers": [3, 4, 5], "target": 12, "steps": []})
  assert answer_step(env, task12, "3*4").reward == 1.0  # a subset of the numbers is allowed
  for wrong in ("3+4+5", "3*5+4", "5"):
    step = answer_step(env, task, wrong)
    assert step.reward == 0.0 and step.info == {"correct": False, "error": None}, wrong
  malformed = {
      "": "empty", "3*3+5": "more often", "17": "more often", "12+5": "more often",
      "__import__('os').system('true')": "not allowed", "abs(17)": "not allowed",
      "x+5": "not allowed", "(3).real": "not allowed", "3**4": "Pow", "5//4*3": "FloorDiv",
      "-3+4*5": "UnaryOp", "5/3+4": "inexact", "3*4+5,": "not allowed", "3*(4+5": "well-formed",
      "3 4 5": "well-formed", "1_7": "not allowed", "٣*٤+٥": "not allowed",
      "(" * 40 + "3" + ")" * 40: "longer", "9" * 10_000: "longer", "0x11": "not allowed",
      "03*4+5": "well-formed",
  }
  for text, why in malformed.items():
    step = answer_step(env, task, text)
    assert_malformed(step)
    assert why in step.info["error"], (text, step.info)
  zero = base.Task("countdown", 0, "train", task.messages, "", {"numbers": [3, 3, 4],
                                                                 "target": 4, "steps": []})
  assert "division by zero" in answer_step(env, zero, "4/(3-3)").info["error"]
  only_plus = envs.make("countdown", operations="+")
  assert "not allowed" in answer_step(only_plus, task, "3*4+5").info["error"]


def test_strings_rewards():
  for op, text, answer in (("reverse", "abcde", "edcba"), ("sort", "dbcab", "abbcd")):
    env = envs.make("strings", op=op)
    task = base.Task("strings", 0, "train", ({"role": "user", "content": f"{op}: {text}"},),
                     answer, {"op": op, "text": text})
    assert answer_step(env, task, answer).reward == 1.0
    assert answer_step(env, task, f" {answer}\n").reward == 1.0
    for wrong in (text if text != answer else "x", answer.upper(), " ".join(answer),
                  answer + answer, "é" + answer[1:], "\ud800", "x" * 100_000):
      step = answer_step(env, task, wrong)
      assert step.reward == 0.0 and step.info == {"correct": False, "error": None}, wrong
    for malformed in ("", " \n"):
      assert_malformed(answer_step(env, task, malformed))


@pytest.mark.parametrize("name", envs.NAMES)
def test_malformed_conversations_never_raise(name):
  env = envs.make(name)
  task = env.task(3, "eval")
  prompt = list(task.messages)
  for messages in (None, "text", 7, [], prompt, prompt + ["not a dict"], prompt + [None],
                   prompt + [assistant(None)], prompt + [assistant(7)],
                   prompt + [{"role": "assistant"}], prompt + [assistant(b"68")],
                   env.worked_solution(task) + [{"role": "observation", "content": "1"}]):
    step = env.step(task, messages)
    assert_malformed(step)


@pytest.mark.parametrize("name", envs.NAMES)
def test_random_garbage_never_raises(name):
  env = envs.make(name)
  task = env.task(0, "train")
  rng = random.Random(0)
  alphabets = ("0123456789+-*/() ", "calc()0123456789+-*x", "".join(map(chr, range(32, 127))),
               "".join(map(chr, range(0x300, 0x3ff))))
  for i in range(12 if name in SANDBOXED else 300):
    chars = alphabets[i % len(alphabets)]
    text = "".join(rng.choice(chars) for _ in range(rng.randrange(0, 80)))
    calls = [text] if name == "calculator" and i % 2 else None
    step = answer_step(env, task, text, tool_calls=calls)
    assert step.reward in (0.0, 1.0) and isinstance(step.info["correct"], bool)
    assert step.info["correct"] == (step.reward == 1.0)


# ---------------------------------------------------------------------------------------------
# Calculator: multi-turn tool use

def test_calculator_flow():
  env = envs.make("calculator")
  assert env.max_turns == 3
  task = env.task(0, "train")
  expr, result = task.info["expression"], task.answer
  prompt = list(task.messages)
  call = assistant("", tool_calls=[f"calc({expr})"])
  step = env.step(task, prompt + [call])
  assert step == envs.Step(result, 0.0, False, {"correct": False, "error": None, "tool_calls": 1})
  conversation = prompt + [call, {"role": "observation", "content": result}]
  step = env.step(task, conversation + [assistant(f" {result} ")])
  assert step.done and step.reward == 1.0 and step.info["tool_calls"] == 1
  step = env.step(task, conversation + [assistant(str(int(result) + 1))])
  assert step.done and step.reward == 0.0 and step.info["error"] is None
  assert_malformed(env.step(task, conversation + [assistant("the answer")]))
  # A right answer without any call earns nothing: this env rewards tool use.
  step = env.step(task, prompt + [assistant(result)])
  assert_malformed(step)
  assert step.info["answer_correct"] is True and "calc" in step.info["error"]
  # replay checks a recorded conversation against the env.
  solution = env.worked_solution(task)
  assert envs.replay(env, task, solution).reward == 1.0
  with pytest.raises(ValueError, match="returned the observation"):
    envs.replay(env, task, solution[:-2] + [{"role": "observation", "content": "7"}] +
                solution[-1:])
  with pytest.raises(ValueError, match="not done after message"):
    envs.replay(env, task, solution[:-2])
  # Content in a call turn is ignored; surrounding whitespace in the call is fine.
  step = env.step(task, prompt + [assistant("thinking aloud", tool_calls=[f" calc( {expr} ) "])])
  assert step.observation == result and not step.done


def test_calculator_malformed_calls_get_error_observations():
  env = envs.make("calculator", max_turns=4)
  task = env.task(1, "train")
  prompt = list(task.messages)
  for call, why in (("calc(2+)", "well-formed"), ("sqrt(4)", "expected calc"),
                    ("calc(__import__('os').system('true'))", "not allowed"),
                    ("calc(2**100000)", "Pow"), ("calc(8/2)", "not allowed"),
                    ("calc(" + "9" * 1000 + ")", "longer"), ("", "expected calc"),
                    ("calc(1)(2)", "well-formed"), (None, "must be text"),
                    ("calc(٣)", "not allowed")):
    step = env.step(task, prompt + [assistant("", tool_calls=[call])])
    assert not step.done and step.reward == 0.0 and step.observation.startswith("error: ")
    assert why in step.observation and step.info["error"] == step.observation, (call, step)
  assert_malformed(env.step(task, prompt + [assistant("", tool_calls="calc(1+1)")]))
  step = env.step(task, prompt + [assistant("", tool_calls=["calc(1+1)", "calc(2+2)"])])
  assert not step.done and "one tool call per turn" in step.observation
  step = env.step(task, prompt + [assistant("", tool_calls=["calc(-2*(3+4))"])])
  assert step.observation == "-14"
  # A malformed call does not count as tool use; a later good one does.
  bad = [assistant("", tool_calls=["calc(2+)"]), {"role": "observation", "content": "error: x"}]
  assert_malformed(env.step(task, prompt + bad + [assistant(task.answer)]))
  good = [assistant("", tool_calls=[f"calc({task.info['expression']})"]),
          {"role": "observation", "content": task.answer}]
  assert env.step(task, prompt + bad + good + [assistant(task.answer)]).reward == 1.0


@pytest.mark.parametrize("max_turns", [2, 3, 5])
def test_calculator_max_turns(max_turns):
  env = envs.make("calculator", max_turns=max_turns)
  task = env.task(2, "eval")
  conversation = list(task.messages)
  call = f"calc({task.info['expression']})"
  for turn in range(1, max_turns + 1):
    conversation.append(assistant("", tool_calls=[call]))
    step = env.step(task, conversation)
    if turn < max_turns:
      assert not step.done and step.observation == task.answer
      conversation.append({"role": "observation", "content": step.observation})
  assert_malformed(step)
  assert "max_turns" in step.info["error"]
  # The last allowed turn may still answer.
  conversation[-1] = assistant(task.answer)
  assert env.step(task, conversation).reward == 1.0


def test_arith_evaluate():
  assert arith.evaluate("(3+4)*5", operations="+*") == (35, [3, 4, 5])
  assert arith.evaluate("12/3/2", operations="/") == (2, [12, 3, 2])
  assert arith.evaluate("-2*-3", operations="*", allow_unary=True) == (6, [2, 3])
  for text in ("True", "1.5", "'a'", "[1]", "1 if 1 else 2", "a", "1<2", "1;2", "2+", None):
    with pytest.raises(arith.ArithError):
      arith.evaluate(text, operations="+-*/")


# ---------------------------------------------------------------------------------------------
# The built-in SFT set

def test_write_builtin(tmp_path):
  path = str(tmp_path / "sub" / "sft.jsonl")
  n = sft_data.write_builtin(path, PLAIN, 6, seed=3, env_options={"addition": {"digits": 3}})
  total = 6 * len(PLAIN)
  assert n == total
  lines = open(path, encoding="utf-8").read().splitlines()
  assert len(lines) == total and os.listdir(tmp_path / "sub") == ["sft.jsonl"]
  made = {name: envs.make(name, seed=3, **({"digits": 3} if name == "addition" else {}))
          for name in PLAIN}
  for i, line in enumerate(lines):
    record = json.loads(line)
    assert list(record) == ["messages"]
    name, index = PLAIN[i % len(PLAIN)], i // len(PLAIN)  # interleaved env by env
    task = made[name].task(index, "train")
    assert record["messages"] == made[name].worked_solution(task)
    assert envs.replay(made[name], task, record["messages"]).reward == 1.0
  assert len(made["addition"].task(0, "train").info["a"].__str__()) == 3  # env_options applied
  # Idempotent: an identical file is not rewritten; a different one is replaced.
  os.utime(path, (1, 1))
  assert sft_data.write_builtin(path, PLAIN, 6, seed=3,
                                env_options={"addition": {"digits": 3}}) == total
  assert os.stat(path).st_mtime == 1
  sft_data.write_builtin(path, ["strings"], 2, seed=3)
  assert len(open(path).read().splitlines()) == 2 and os.stat(path).st_mtime != 1
  other = str(tmp_path / "other.jsonl")
  sft_data.write_builtin(other, ["strings"], 2, seed=3)
  assert open(other, "rb").read() == open(path, "rb").read()
  sft_data.write_builtin(other, ["strings"], 2, seed=4)
  assert open(other, "rb").read() != open(path, "rb").read()
  for bad in (dict(env_names="addition"), dict(env_names=[]),
              dict(env_names=["addition", "addition"]), dict(num_per_env=0),
              dict(env_options={"countdown": {}})):
    args = {"env_names": ["addition"], "num_per_env": 1, **bad}
    with pytest.raises(ValueError, match="sft_data"):
      sft_data.write_builtin(str(tmp_path / "bad.jsonl"), seed=0, **args)


# ---------------------------------------------------------------------------------------------
# Through the chat format: rendering, the rollout path, the SFT data source

TINY_SEQ_LEN = 256  # configs/tiny.py: every built-in conversation must fit whole


@pytest.mark.parametrize("name,options", OPTION_SETS, ids=IDS)
def test_worked_solutions_render_and_round_trip(name, options):
  """Each assistant turn of a worked solution, rendered after its prompt and parsed back as the
  rollout does (`render_prompt` + generated ids -> `parse_response`), gives the env the same
  reward 1; every thinking mode renders it."""
  tok = tokenizers.ByteTokenizer()
  env = envs.make(name, **options)
  lengths = []
  for i in range(40):
    task = env.task(i, "train")
    conversation = env.worked_solution(task)
    full = chat.render(conversation, tok)
    lengths.append(len(full.ids))
    for mode in chat.THINKING_MODES:
      assert len(chat.render(conversation, tok, thinking_mode=mode).ids) == len(full.ids)
    rebuilt = list(task.messages)
    for k in range(len(task.messages), len(conversation)):
      if conversation[k]["role"] == "observation":
        rebuilt.append(conversation[k])  # the tool's reply, as the env gave it
        continue
      prompt = chat.render_prompt(rebuilt, tok)
      turn = chat.render(rebuilt + [conversation[k]], tok)
      np.testing.assert_array_equal(turn.ids[:len(prompt)], prompt)
      generated = turn.ids[len(prompt):] if k + 1 == len(conversation) else (
          chat.render(conversation[:k + 2], tok).ids[len(prompt):])  # ends at <|observation|>
      response = chat.parse_response(generated, tok)
      assert response.stop in ("<eos>", "<|observation|>"), response
      rebuilt.append({"role": "assistant", "thinking": response.thinking,
                      "content": response.content, "tool_calls": response.tool_calls})
      step = env.step(task, rebuilt)
    assert step.done and step.reward == 1.0, (conversation, rebuilt, step)
  if not options:  # whole, with room to spare for longer generations in RL
    assert max(lengths) <= TINY_SEQ_LEN - 64, max(lengths)


def test_builtin_set_through_the_chat_jsonl_source(tmp_path):
  """The SFT file feeds `chat_jsonl` whole: no conversation is cut at the tiny seq_len."""
  path = str(tmp_path / "sft.jsonl")
  sft_data.write_builtin(path, PLAIN, 8, seed=0)  # (the sandboxed envs need seq_len 512, 768)
  source = data.source_config("chat_jsonl", glob=path, holdout_fraction=0.0,
                              overlong="error")
  cfg = data.data_config(seq_len=TINY_SEQ_LEN, batch_size=4, prefetch=0,
                         sources=dict(sft=source))
  iterator = data.make_train_iterator(cfg)
  batch = next(iterator)
  iterator.close()
  assert batch["loss_mask"].sum() > 0 and batch["tokens"].shape == (4, TINY_SEQ_LEN)
