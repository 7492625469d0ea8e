"""Repo repair, multi-turn: a small generated repository with a failing test; fix it with tools.

  user         "The tests in test_textops.py fail. Fix the code (test files are read-only).
                Files: README.md, test_textops.py, textops.py. Tools: read_file(path),
                write_file(path, content), run_tests(). Say "done" when the tests pass."
  assistant    tool call read_file(path="textops.py")          observation: the buggy source
  assistant    tool call write_file(path="textops.py", content=...)   observation "wrote ..."
  assistant    tool call run_tests                             observation "3/3 passed ..."
  assistant    "done"                                          reward: the hidden tests

The repository: one module holding a function from `code_problems` (renamed, e.g.
`reverse_words`) with one generated bug (an off-by-one constant, a swapped operator or
max/min, ...; kept only if a visible test catches it), its visible test file (3 asserts), and
a README. Tools are GLM tool calls (`{"name", "arguments"}`; `run_tests` takes none and may be
the bare text "run_tests"), one per turn, executed on the repository as the conversation
left it (the initial files plus every earlier write_file, replayed; the env keeps no state).
`run_tests` runs the visible tests in the sandbox (`glm5_jax.posttrain.sandbox`); a malformed
call, an unknown tool, a missing file or a write to a test file gets an observation starting
"error: " and the episode continues.

Episode: a turn with a tool call continues unless it is turn `max_turns` (reward 0); a turn
without one ends it: the function is run in the sandbox on `num_tests` hidden inputs
(`code_run`, compared outside) on the final repository. Option `reward`: "all" (1 when all
pass) or "fraction". Options: `max_turns` (2..16, default 6), `num_tests` (1..64, default 8),
`reward`, `max_file_chars` (a write's limit, default 4000), `sandbox` (as the code env's).
"""

import re

import numpy as np

from glm5_jax.posttrain.envs import base, code_problems, code_run
from glm5_jax.posttrain import sandbox
from glm5_jax.seeds import problem_hash

NAMES = {"digit_sum": "digit_sum", "poly": "poly", "clamp": "clamp", "running": "running",
         "caesar": "shift_letters", "words": "reverse_words", "fizz": "fizz",
         "count": "count_letter"}
MODULES = ("textops", "numtools", "helpers", "core")
VISIBLE = 3
MAX_OBSERVATION = 600
RUNNER = """import traceback
import {tests} as t
names = sorted(n for n in dir(t) if n.startswith("test_"))
ok = 0
for n in names:
    try:
        getattr(t, n)()
        ok += 1
        print(n, "PASSED")
    except BaseException as e:
        print(n, "FAILED:", type(e).__name__, str(e)[:80])
print(f"{{ok}}/{{len(names)}} passed")
"""
NUMBER = re.compile(r"(?<![\w.])(\d+)")
# (pattern, replacement), applied at the first match. The guards keep a swap off identifiers:
# `max(` alone would turn `def running_max(` into `def running_min(`, a renamed function (the
# visible test then dies on an ImportError instead of showing a wrong value).
SWAPS = tuple((re.compile(pattern), new) for pattern, new in (
    (r"(?<![\w.])max\(", "min("), (r"(?<![\w.])min\(", "max("),  # builtin calls only
    (r" \+ ", " - "), (r" - ", " + "), (r"\[::-1\]", ""),
    (r" == 0(?![\w.])", " != 0"), (r"\breturn ", "return 1 + ")))


def mutations(source: str) -> list[str]:
  """Candidate buggy versions of `source` (each differs in one place; none renames a name)."""
  out = []
  for m in NUMBER.finditer(source):
    out.append(source[:m.start()] + str(int(m.group()) + 1) + source[m.end():])
  for pattern, new in SWAPS:
    m = pattern.search(source)
    if m:
      out.append(source[:m.start()] + new + source[m.end():])
  return out


def _compile(source: str, name: str):
  scope = {}
  exec(compile(source, "<repo>", "exec"), scope)  # pylint: disable=exec-used  (our own code)
  return scope[name]


def _fails(source: str, name: str, args_list, expected) -> bool:
  try:
    f = _compile(source, name)
    return any(repr(f(*a)) != e for a, e in zip(args_list, expected))
  except Exception:  # pylint: disable=broad-except  (a bug that raises is a bug too)
    return True


def calls_of(message: dict) -> tuple[list, str | None]:
  calls = message.get("tool_calls") or []
  if not isinstance(calls, (list, tuple)):
    return [], f"tool_calls must be a list, got {type(calls).__name__}"
  return list(calls), None


def parse_call(call) -> tuple[str, dict] | str:
  """(tool name, arguments), or an error text."""
  if isinstance(call, str):
    name = call.strip()
    return (name, {}) if name == "run_tests" else f"error: unknown tool call {base.preview(call)}"
  if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(
      call.get("arguments"), dict):
    return f"error: malformed tool call {base.preview(call)}"
  return call["name"], call["arguments"]


class RepoRepair(base.Env):
  name = "repo_repair"
  concurrent_steps = True  # tool calls and the final tests wait on sandbox processes
  defaults = {"max_turns": 6, "num_tests": 8, "reward": "all", "max_file_chars": 4000,
              "sandbox": {}}

  def _options(self, options):
    self.require(options["reward"] in ("all", "fraction"), "reward",
                 f"must be 'all' or 'fraction', got {options['reward']!r}")
    self.box = code_run.sandbox_option(self, options["sandbox"])
    return {"max_turns": self.int_option(options, "max_turns", 2, 16),
            "num_tests": self.int_option(options, "num_tests", 1, 64),
            "reward": options["reward"],
            "max_file_chars": self.int_option(options, "max_file_chars", 1, 100_000)}

  @property
  def max_turns(self):
    return self.options["max_turns"]

  def _problem(self, rng):
    while True:  # a few families' draws have no bug a visible test catches: draw again
      family, params = code_problems.draw(rng)
      key = code_problems.key(family, params)
      fn = NAMES[family] + (f"_{params['op']}" if family == "running" else "")
      fixed = code_problems.solution(family, params).replace("def f(", f"def {fn}(")
      case_rng = np.random.default_rng(problem_hash(self.name, "cases", key))
      args = code_problems.cases(family, params, case_rng, VISIBLE + self.options["num_tests"])
      reference = _compile(fixed, fn)
      expected = [repr(reference(*a)) for a in args]
      bugs = [b for b in mutations(fixed) if _fails(b, fn, args[:VISIBLE], expected[:VISIBLE])]
      if bugs:
        break
    module = MODULES[int(rng.integers(len(MODULES)))]
    buggy = bugs[int(rng.integers(len(bugs)))]
    tests = f"from {module} import {fn}\n" + "".join(
        f"\n\ndef test_{i}():\n    assert {fn}({', '.join(map(repr, a))}) == {e}\n"
        for i, (a, e) in enumerate(zip(args[:VISIBLE], expected[:VISIBLE])))
    files = {f"{module}.py": buggy, f"test_{module}.py": tests,
             "README.md": f"# {module}\n\n`{fn}`: {code_problems.describe(family, params)[1]}.\n"}
    prompt = (f"The tests in test_{module}.py fail. Fix the code (test files are read-only). "
              f"Files: {', '.join(sorted(files))}. Tools: read_file(path), write_file(path, "
              "content), run_tests(). Say \"done\" when the tests pass.")
    info = {"files": files, "module": module, "function": fn, "fixed": fixed,
            "hidden_args": args[VISIBLE:], "hidden_expected": expected[VISIBLE:]}
    # The key is the function's, not the bug's: a held-out function is never repaired in train.
    return key, ({"role": "user", "content": prompt},), fixed, info

  # ---- tools -----------------------------------------------------------------------------------

  def files_after(self, task, turns) -> dict:
    """The repository after the write_file calls of `turns` (the successful ones)."""
    files = dict(task.info["files"])
    for m in turns:
      calls, _ = calls_of(m)
      if len(calls) == 1:
        parsed = parse_call(calls[0])
        if not isinstance(parsed, str) and parsed[0] == "write_file":
          observation, ok = self.write(files, parsed[1])
          del observation, ok
    return files

  def write(self, files: dict, args: dict) -> tuple[str, bool]:
    """Applies a write_file call to `files` (in place); (observation, well-formed)."""
    path, content = args.get("path"), args.get("content")
    if set(args) != {"path", "content"} or not isinstance(path, str) or not isinstance(
        content, str):
      return "error: write_file takes path and content", False
    if path.split("/")[-1].startswith("test_"):
      return f"error: {path} is a test file (read-only)", False
    if path not in files:
      return f"error: no such file {base.preview(path)} (write_file edits existing files)", False
    if len(content) > self.options["max_file_chars"]:
      return f"error: content longer than {self.options['max_file_chars']} characters", False
    files[path] = content
    return f"wrote {path}", True

  def run_tests(self, task, files: dict) -> str:
    runner = RUNNER.format(tests=f"test_{task.info['module']}")
    try:
      result = sandbox.run_python({**files, "_run_tests.py": runner}, "_run_tests.py",
                                  limits=self.box["limits"],
                                  allow_unsafe=self.box["allow_unsafe"])
    except ValueError as e:  # a file path the sandbox refuses (never from write_file)
      return f"error: {e}"
    text = result.output
    if result.timed_out:
      text += "\n(timed out)"
    elif result.killed_by in ("memory_bytes", "cpu_seconds"):
      text += f"\n(stopped: {sandbox.stop_reason(result, self.box['limits'])})"
    text = text.strip() or f"(no output, exit {result.exit_code})"
    return text if len(text) <= MAX_OBSERVATION else "..." + text[-MAX_OBSERVATION:]

  def tool(self, task, files: dict, call) -> tuple[str, bool]:
    parsed = parse_call(call)
    if isinstance(parsed, str):
      return parsed, False
    name, args = parsed
    if name == "read_file":
      path = args.get("path")
      if set(args) != {"path"} or not isinstance(path, str):
        return "error: read_file takes path", False
      if path not in files:
        return f"error: no such file {base.preview(path)}; files: {', '.join(sorted(files))}", False
      return files[path], True
    if name == "write_file":
      return self.write(files, args)
    if name == "run_tests":
      return (self.run_tests(task, files), True) if not args else (
          "error: run_tests takes no arguments", False)
    return f"error: unknown tool {base.preview(name)}", False

  # ---- episode ---------------------------------------------------------------------------------

  def step(self, task, messages):
    turns, error = base.assistant_messages(messages)
    if error:
      return base.finish(False, error)
    calls, error = calls_of(turns[-1])
    if error:
      return base.finish(False, error)
    files = self.files_after(task, turns[:-1])
    if calls:
      if len(turns) >= self.max_turns:
        return base.finish(False, f"still calling tools at max_turns={self.max_turns}")
      if len(calls) > 1:
        observation, ok = f"error: one tool call per turn, got {len(calls)}", False
      else:
        observation, ok = self.tool(task, files, calls[0])
      return base.Step(observation, 0.0, False,
                       {"correct": False, "error": None if ok else observation})
    _, error = base.content_of(turns[-1])  # the closing message ("done") must be text
    if error:
      return base.finish(False, error)
    info = task.info
    outputs, error, _ = code_run.run_function(files, info["module"], info["function"],
                                              info["hidden_args"], self.box)
    if error:
      return base.finish(False, error, passed=0, tests=len(info["hidden_args"]))
    ok = code_run.passed(outputs, info["hidden_expected"])
    n = len(ok)
    reward = sum(ok) / n if self.options["reward"] == "fraction" else float(all(ok))
    return base.Step(None, reward, True, {"correct": all(ok), "error": None,
                                          "passed": sum(ok), "tests": n})

  def worked_solution(self, task):
    module_file = f"{task.info['module']}.py"
    messages = [dict(m) for m in task.messages]
    fixed_files = {**task.info["files"], module_file: task.info["fixed"]}
    plan = [("find the bug", {"name": "read_file", "arguments": {"path": module_file}},
             task.info["files"][module_file]),
            ("fix it", {"name": "write_file",
                        "arguments": {"path": module_file, "content": task.info["fixed"]}},
             f"wrote {module_file}"),
            ("check", "run_tests", self.run_tests(task, fixed_files))]
    for thinking, call, observation in plan:
      messages += [{"role": "assistant", "thinking": thinking, "content": "",
                    "tool_calls": [call]},
                   {"role": "observation", "content": observation}]
    messages.append({"role": "assistant", "thinking": "tests pass", "content": "done"})
    return messages
