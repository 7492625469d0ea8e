"""Scoring model-written code: run a function on hidden inputs in the sandbox, compare outside.

The harness imports the program's module, calls `f` on each hidden input and prints one line,
`MARK {"outputs": [repr of each result, or "raised <Error>"]}`; the caller compares those reprs
with the reference's. The expected values never enter the sandbox, so a program that prints a
fake result line (it runs in the same interpreter as the harness and can read it) gains
nothing it could not get by computing the right outputs: by solving the problem.

`sandbox_option(env, value)` validates an env's `sandbox` option: a dict of
`glm5_jax.posttrain.sandbox.Limits` fields plus `allow_unsafe` (bool).
"""

import dataclasses
import json

from glm5_jax.posttrain import sandbox

MARK = "@@glm5-harness@@"
HARNESS = """import json, sys
sys.setrecursionlimit(2000)
CASES = json.loads({cases!r})
try:
    from {module} import {function} as f
except BaseException as e:
    print("\\n{mark}" + json.dumps({{"error": (type(e).__name__ + ": " + str(e))[:200]}}))
    raise SystemExit(0)
out = []
for args in CASES:
    try:
        out.append(repr(f(*args)))
    except BaseException as e:
        out.append("raised " + type(e).__name__)
print("\\n{mark}" + json.dumps({{"outputs": out}}))
"""
LIMIT_FIELDS = tuple(f.name for f in dataclasses.fields(sandbox.Limits))


def sandbox_option(env, value) -> dict:
  """{"limits": Limits, "allow_unsafe": bool} from an env's `sandbox` option (ValueError naming
  `envs.<name>: option 'sandbox'` and the field)."""
  env.require(isinstance(value, dict), "sandbox", f"must be a dict, got {value!r}")
  value = dict(value)
  allow_unsafe = value.pop("allow_unsafe", False)
  env.require(isinstance(allow_unsafe, bool), "sandbox",
              f"field allow_unsafe must be a bool, got {allow_unsafe!r}")
  unknown = sorted(set(value) - set(LIMIT_FIELDS))
  env.require(not unknown, "sandbox", f"has unknown field(s) {unknown}; expected some of "
              f"{list(LIMIT_FIELDS) + ['allow_unsafe']}")
  limits = sandbox.Limits(**value)
  try:
    limits.check(f"envs.{env.name}.sandbox")
  except ValueError as e:
    raise ValueError(f"envs.{env.name}: option 'sandbox': {e}") from None
  return {"limits": limits, "allow_unsafe": allow_unsafe}


def run_function(files: dict, module: str, function: str, args_list, box: dict,
                 ) -> tuple[list | None, str | None, sandbox.Result]:
  """Runs `module.function(*args)` for each args in the sandbox with `files`.

  Returns (outputs, error, result): outputs the reprs (or "raised X") per case, None when the
  run produced no result line (error says why: timeout, crash, import failure, ...)."""
  harness = HARNESS.format(cases=json.dumps([list(a) for a in args_list]), module=module,
                           function=function, mark=MARK)
  result = sandbox.run_python({**files, "_harness.py": harness}, "_harness.py",
                              limits=box["limits"], allow_unsafe=box["allow_unsafe"])
  if result.killed_by:  # a result line printed before a limit ended the run does not count
    return None, sandbox.stop_reason(result, box["limits"]), result
  lines = [ln for ln in result.output.splitlines() if ln.startswith(MARK)]
  if not lines:
    return None, f"no result (exit {result.exit_code}): {result.output[-200:]!r}", result
  try:
    parsed = json.loads(lines[-1][len(MARK):])
  except ValueError:
    return None, "unreadable result line", result
  if not isinstance(parsed, dict):
    return None, "unreadable result line", result
  if "error" in parsed:
    return None, f"could not load {function}: {str(parsed['error'])[:200]}", result
  outputs = parsed.get("outputs")
  if not isinstance(outputs, list) or len(outputs) != len(args_list):
    return None, "malformed result line", result
  return outputs, None, result


def passed(outputs, expected_reprs) -> list[bool]:
  return [o == e for o, e in zip(outputs, expected_reprs)]
