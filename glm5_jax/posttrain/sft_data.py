"""The built-in SFT set: worked solutions of the environments, written as jsonl.

One line per conversation, `{"messages": [...]}` in the chat format of `glm5_jax.data.chat`
(the `chat_jsonl` data source reads the field "messages"). Conversations come from the TRAIN
split only (task indices 0..num_per_env-1 of each env, made with `seed`), interleaved env by
env so any prefix of the file mixes the environments. Every conversation is replayed through
its env before writing and must earn reward 1.

Deterministic and idempotent: the same arguments give the same bytes; an existing identical file
is left untouched (mtime included), anything else is replaced atomically (temp file + rename),
so a reader never sees a half-written file.
"""

import concurrent.futures
import json
import os

from glm5_jax.files import write_atomic
from glm5_jax.posttrain import envs

STEP_THREADS = 8  # concurrent sandbox runs while checking worked solutions (code envs)


def builtin_lines(env_names, num_per_env: int, *, seed: int,
                  env_options: dict | None = None) -> list[str]:
  """The jsonl lines `write_builtin` writes (without newlines)."""
  if isinstance(env_names, str) or not env_names:
    raise ValueError(f"sft_data: env_names must be a non-empty list of names from {envs.NAMES}, "
                     f"got {env_names!r}")
  env_names = list(env_names)
  if len(set(env_names)) != len(env_names):
    raise ValueError(f"sft_data: env_names has duplicates: {env_names}")
  if not isinstance(num_per_env, int) or isinstance(num_per_env, bool) or num_per_env < 1:
    raise ValueError(f"sft_data: num_per_env must be an int >= 1, got {num_per_env!r}")
  env_options = dict(env_options or {})
  stray = sorted(set(env_options) - set(env_names))
  if stray:
    raise ValueError(f"sft_data: env_options names environments not in env_names: {stray}")
  made = [envs.make(name, seed=seed, **env_options.get(name, {})) for name in env_names]

  def line(env, index):
    task = env.task(index, "train")
    messages = env.worked_solution(task)
    step = envs.replay(env, task, messages)
    if step.reward != 1.0:
      raise RuntimeError(f"sft_data: the worked solution of {env!r} task {index} scores "
                         f"{step.reward} ({step.info})")
    return json.dumps({"messages": messages}, ensure_ascii=False)

  jobs = [(env, index) for index in range(num_per_env) for env in made]
  if not any(env.concurrent_steps for env in made):
    return [line(env, index) for env, index in jobs]
  # Envs that score in a sandbox process wait on it: overlap those runs (order is kept).
  with concurrent.futures.ThreadPoolExecutor(STEP_THREADS) as pool:
    return list(pool.map(lambda job: line(*job), jobs))


def write_builtin(path: str, env_names, num_per_env: int, *, seed: int,
                  env_options: dict | None = None) -> int:
  """Writes the worked solutions of `num_per_env` train tasks of each env to `path` (jsonl).

  Args:
    path: the output file; its directory is created if needed.
    env_names: environment names (`envs.NAMES`), each at most once.
    num_per_env: conversations per environment.
    seed: the envs' `seed` option (which tasks).
    env_options: optional {env name: {option: value}} for `envs.make` (e.g. addition digits).
  Returns:
    The number of conversations in the file.
  """
  lines = builtin_lines(env_names, num_per_env, seed=seed, env_options=env_options)
  data = ("\n".join(lines) + "\n").encode("utf-8")
  if os.path.isfile(path):
    with open(path, "rb") as f:
      if f.read() == data:
        return len(lines)
  write_atomic(path, data)
  return len(lines)
