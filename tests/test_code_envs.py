"""The sandboxed environments: code (function synthesis) and repo_repair (multi-turn tools):
worked solutions earn 1, wrong / hostile / malformed answers 0, the reward modes, the splits,
option errors, the tool flow, and a repo-repair episode played by the engine with sessions."""

import ast
import collections
import sys
import types

import numpy as np
import pytest

from glm5_jax.data import chat, tokenizers
from glm5_jax.posttrain import envs, sandbox
from glm5_jax.posttrain.envs import code, code_problems, repo_repair

ISO = sandbox.isolation()
pytestmark = pytest.mark.skipif(ISO.mode == "none",
                                reason=f"this OS cannot isolate a program: {ISO.reason}")
QUICK = {"wall_seconds": 2.0, "cpu_seconds": 2}


def answer(task, content, tool_calls=None):
  m = {"role": "assistant", "thinking": "", "content": content}
  if tool_calls is not None:
    m["tool_calls"] = tool_calls
  return list(task.messages) + [m]


def test_code_rewards():
  env = envs.make("code", sandbox=QUICK)
  for i in range(4):
    task = env.task(i, "eval")
    assert envs.replay(env, task, env.worked_solution(task)).reward == 1.0
  task = next(t for t in (env.task(i, "train") for i in range(50))
              if t.info["family"] == "clamp")
  fenced = "```python\n" + task.answer + "```"
  assert env.step(task, answer(task, fenced)).reward == 1.0
  partial = answer(task, "def f(x):\n    return x\n")  # right inside [lo, hi] only
  step = env.step(task, partial)
  assert step.reward == 0.0 and 0 < step.info["passed"] < step.info["tests"], step
  frac = envs.make("code", reward="fraction", sandbox=QUICK)
  step = frac.step(task, partial)
  assert step.reward == pytest.approx(step.info["passed"] / step.info["tests"])
  assert 0 < step.reward < 1
  assert not step.info["correct"]
  for bad, why in [("def f(x) return", "could not load"), ("", "empty"),
                   ("while True: pass", "timed out"), ("x = 1", "could not load"),
                   ("import sys\ndef f(x):\n    sys.stdout.write('y' * 10**6)\n", "printed")]:
    step = env.step(task, answer(task, bad))
    assert step.reward == 0.0 and why in step.info["error"], (bad, step)


def test_code_faked_results_score_zero():
  """A program that prints a result line claiming success gets nothing: the expected values
  never enter the sandbox."""
  env = envs.make("code", sandbox=QUICK)
  task = env.task(0, "train")
  n = len(task.info["args"])
  fake = ("import json\nprint('@@glm5-harness@@' + json.dumps({'outputs': ['1'] * %d}))\n"
          "import os\nos._exit(0)\n" % n)
  assert env.step(task, answer(task, fake)).reward == 0.0


def test_code_splits_options_and_determinism():
  env = envs.make("code")
  keys = {s: {code_problems.key(t.info["family"], t.info["params"])
              for t in (env.task(i, s) for i in range(150))} for s in ("train", "eval")}
  assert keys["train"] and keys["eval"] and not keys["train"] & keys["eval"]
  assert env.task(7, "train") == envs.make("code", sandbox=QUICK).task(7, "train")
  assert envs.make("code", families=["poly"]).task(0, "train").info["family"] == "poly"
  for options, field in [({"families": ["sort"]}, "families"), ({"reward": "half"}, "reward"),
                         ({"num_tests": 0}, "num_tests"),
                         ({"sandbox": {"wall_seconds": 0}}, "sandbox.wall_seconds"),
                         ({"sandbox": {"memory_bytes": -1}}, "sandbox.memory_bytes"),
                         ({"sandbox": {"allow_unsafe": 1}}, "allow_unsafe"),
                         ({"sandbox": {"disk": 1}}, "unknown field")]:
    with pytest.raises(ValueError, match=f"envs.code: option .*{field}"):
      envs.make("code", **options)


def test_repo_repair_flow():
  env = envs.make("repo_repair", sandbox=QUICK, max_turns=4)
  task = env.task(1, "train")
  module, fn = task.info["module"], task.info["function"]
  conversation = env.worked_solution(task)
  assert envs.replay(env, task, conversation).reward == 1.0
  assert "3/3 passed" in conversation[-2]["content"]
  # Saying done without a fix: the hidden tests fail on the buggy file.
  step = env.step(task, answer(task, "done"))
  assert step.done and step.reward == 0.0 and step.info["passed"] < step.info["tests"]
  # Tools: run_tests on the buggy repo shows the failure; errors are observations.
  step = env.step(task, answer(task, "", ["run_tests"]))
  assert not step.done and "FAILED" in step.observation, step
  for call, why in [({"name": "write_file", "arguments": {"path": f"test_{module}.py",
                                                          "content": "x"}}, "read-only"),
                    ({"name": "read_file", "arguments": {"path": "/etc/passwd"}}, "no such"),
                    ({"name": "rm", "arguments": {}}, "unknown tool"), ("ls", "unknown"),
                    ({"name": "read_file", "arguments": {}}, "takes path")]:
    step = env.step(task, answer(task, "", [call]))
    assert not step.done and step.observation.startswith("error: ") and why in step.observation
  # A write that breaks the file, then done: 0; the write is replayed from the conversation.
  broken = answer(task, "", [{"name": "write_file", "arguments": {"path": f"{module}.py",
                                                                  "content": "while True: pass"}}])
  broken += [{"role": "observation", "content": f"wrote {module}.py"},
             {"role": "assistant", "thinking": "", "content": "done"}]
  step = env.step(task, broken)
  assert step.reward == 0.0 and "timed out" in step.info["error"], step
  # max_turns: a 4th turn still calling a tool scores 0.
  long = list(conversation[:-1])
  long[-1:] = [long[-1], {"role": "assistant", "thinking": "", "content": "",
                          "tool_calls": ["run_tests"]}]
  step = env.step(task, long)
  assert step.done and step.reward == 0.0 and "max_turns" in step.info["error"]
  assert fn in task.info["files"][f"test_{module}.py"]


def test_repo_repair_splits_and_bugs_fail_visible_tests():
  env = envs.make("repo_repair")
  tasks = {s: [env.task(i, s) for i in range(40)] for s in ("train", "eval")}
  fns = {s: {(t.info["function"], t.info["fixed"]) for t in ts} for s, ts in tasks.items()}
  assert not fns["train"] & fns["eval"]
  for t in tasks["train"][:10]:
    buggy = t.info["files"][f"{t.info['module']}.py"]
    assert buggy != t.info["fixed"]


def defined_names(source: str) -> set:
  """Every name `source` defines: functions, their arguments, assigned variables."""
  out = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.FunctionDef):
      out.add(node.name)
    elif isinstance(node, ast.arg):
      out.add(node.arg)
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
      out.add(node.id)
  return out


def test_repo_repair_bugs_keep_every_name_and_fail_in_the_function(monkeypatch):
  """No generated bug renames or removes a name (`def running_min(` -> `def running_max(` made
  the visible test die on an ImportError): the buggy module defines the same names as the fix,
  and its visible tests (run here in-process, as the sandbox runner does) fail on a wrong value
  or an error raised inside the function, never a NameError/ImportError."""
  env = envs.make("repo_repair")
  failures = collections.Counter()
  for split in ("train", "eval"):
    for i in range(300):
      t = env.task(i, split)
      module = t.info["module"]
      buggy = t.info["files"][f"{module}.py"]
      assert defined_names(buggy) == defined_names(t.info["fixed"]), (split, i, buggy)
      mod = types.ModuleType(module)
      exec(compile(buggy, f"{module}.py", "exec"), mod.__dict__)  # pylint: disable=exec-used
      monkeypatch.setitem(sys.modules, module, mod)
      scope = {}
      exec(t.info["files"][f"test_{module}.py"], scope)  # pylint: disable=exec-used
      kinds = []
      for name in sorted(n for n in scope if n.startswith("test_")):
        try:
          scope[name]()
        except Exception as e:  # pylint: disable=broad-except  (classified below)
          kinds.append(type(e))
      assert kinds, (split, i, "the bug passes its visible tests", buggy)
      assert not any(issubclass(k, (NameError, ImportError)) for k in kinds), (split, i, buggy)
      failures.update(k.__name__ for k in kinds)
  assert failures["AssertionError"] > sum(failures.values()) / 2, failures


def test_repo_repair_worked_solution_round_trips_the_chat_format():
  """The tool calls (dict with arguments, and the bare run_tests) survive render -> parse."""
  tok = tokenizers.ByteTokenizer()
  env = envs.make("repo_repair", sandbox=QUICK)
  task = env.task(0, "eval")
  conversation = env.worked_solution(task)
  rebuilt, step = list(task.messages), None
  for k in range(len(task.messages), len(conversation)):
    if conversation[k]["role"] == "observation":
      rebuilt.append({"role": "observation", "content": step.observation})
      continue
    prompt = chat.render_prompt(rebuilt, tok)
    ids = chat.render(conversation[:k + 2] if k + 1 < len(conversation) else
                      conversation[:k + 1], tok).ids[len(prompt):]
    r = chat.parse_response(ids, tok)
    rebuilt.append({"role": "assistant", "thinking": r.thinking, "content": r.content,
                    "tool_calls": r.tool_calls})
    step = env.step(task, rebuilt)
  assert step.done and step.reward == 1.0
  assert len(chat.render(conversation, tok).ids) < 768


@pytest.mark.slow
def test_repo_repair_episode_through_the_engine_with_sessions():
  """A repo-repair episode in `generate_samples`: the model's turns become tool calls the env
  runs in the sandbox, and later turns continue the held session (prefix cache reused)."""
  from tests.test_sessions import rollout_setup  # pylint: disable=import-outside-toplevel
  from glm5_jax.posttrain import rollout  # pylint: disable=import-outside-toplevel
  config, params = rollout_setup()
  config.data.seq_len = 512

  class AlwaysRunTests(repo_repair.RepoRepair):
    """Whatever the (random) model writes, its turns count as run_tests calls until the last,
    so every episode is multi-turn and each observation is a real sandbox test run."""
    def step(self, task, messages):
      last = messages[-1]
      turns = sum(m.get("role") == "assistant" for m in messages)
      if turns < self.max_turns:
        messages = messages[:-1] + [{**last, "tool_calls": ["run_tests"]}]
      return super().step(task, messages)

  env = AlwaysRunTests(max_turns=3, sandbox=QUICK)
  tasks = [env.task(i, "train") for i in range(2)]
  stats = {}
  samples = rollout.generate_samples(config, params, env, tasks, seed=0, group_size=2,
                                     stats=stats)
  played = [s for s in samples if s.turns == 3]
  assert played, [(s.turns, s.info) for s in samples]
  for s in played:
    assert "passed" in s.messages[2]["content"], s.messages[2]
    assert s.reward == 0.0 and np.all(s.loss_mask[:len(s.tokens)] >= 0)
  assert stats["session_hits"] >= sum(s.turns - 1 for s in played) > 0, stats


def test_strip_fence():
  assert code.strip_fence("```python\ndef f(): pass\n```") == "def f(): pass"
  assert code.strip_fence("def f(): pass") == "def f(): pass"
