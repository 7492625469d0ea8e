"""The staged post-training pipeline: reasoning RL -> agentic RL -> general RL, each stage from
the previous one's checkpoint, then on-policy cross-stage distillation from the earlier
stages' best checkpoints (a teacher per task) into the final student (GLM-5's post-training
order, docs/reference.md section 4). The config: `glm5_jax.posttrain.pipeline_config`.

  <workdir>/sft                 the SFT run (when a stage starts from "sft" and rl.init_from
                                is empty; `sft.ensure_sft_start`)
  <workdir>/stages/<name>       each stage's RL run (`loop.rl_train`: orbax, exact resume)
  <workdir>/stages/distill      the distillation's RL run
  <workdir>/pipeline.json       the table so far: held-out greedy accuracy of every task of the
                                pipeline after each stage (and of the start checkpoint), the
                                stages' wall times and the chosen teachers

The distillation is `loop.rl_train` with `rl.loss="distill"` on the mixture of
`distill.tasks`, group size as configured (GLM-5: 1): each sampled response's per-token
advantage is `stopgrad(logp_teacher - logp_rollout)` under the teacher of the sample's own task
(`rl_update.score`), the advantage form GLM-5 describes, whose policy gradient is that of the
per-token reverse KL(student || teacher) on the student's samples.

Stopping and resume: SIGTERM stops the running stage after its step (its checkpoint committed)
and the pipeline returns `stopped` = that stage; a rerun skips the stages pipeline.json records
as done and resumes the stopped one from its checkpoint.
"""

import json
import os
import time

from absl import logging
import ml_collections

from glm5_jax.data import make_tokenizer
from glm5_jax.eval.checkpoints import load_run
from glm5_jax.files import write_atomic
from glm5_jax.posttrain import loop, rl_run, sft, tasks as tasks_lib
from glm5_jax.posttrain.pipeline_config import (BEST, DISTILL, PREVIOUS, START, base_config,
                                                pipeline_envs, stage_names, stage_rl_config,
                                                task_options, validate_pipeline)

STATE_FILE = "pipeline.json"


def run_pipeline(config, workdir: str, *, stop_after_steps: int | None = None) -> dict:
  """Runs (or resumes) the pipeline of `config` in `workdir`.

  Args:
    stop_after_steps: each stage run by this call stops after this many of its steps, as
      SIGTERM would (tests).
  Returns:
    pipeline.json's contents: `rows` ({checkpoint name: {env: greedy accuracy}} for START, each
    stage and DISTILL), `seconds` (each stage's wall time, its evaluation included),
    `workdirs`, `teachers` ({env: checkpoint name}), `envs`, `env_options` ({env: the
    options its stage trains and every row evaluates it with}), `eval_tasks`; and `stopped` (the
    stage stopped early, or None).
  """
  validate_pipeline(config)  # before the SFT, which may take hours
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  state = _read_state(workdir) or {"rows": {}, "seconds": {}, "workdirs": {}, "teachers": {}}
  state.update(envs=pipeline_envs(config), env_options=task_options(config),
               eval_tasks=config.pipeline.eval_tasks, stopped=None)
  tokenizer = make_tokenizer(config.data.tokenizer)
  if START not in state["rows"]:
    start = time.time()
    base = base_config(config)
    out = sft.ensure_sft_start(base, workdir)
    if out.get("stopped"):
      return _stopped(workdir, state, "sft")
    state["workdirs"][START] = base.rl.init_from
    state["rows"][START] = evaluate_all(config, base.rl.init_from, tokenizer)
    state["seconds"][START] = time.time() - start
    _write_state(workdir, state)
  names = stage_names(config)
  for i, name in enumerate(names):
    if name in state["rows"]:
      continue
    init_from = _start_workdir(config.stages[name].start, state, names[:i])
    if not _run_stage(config, name, stage_rl_config(config, name, init_from), workdir, state,
                      tokenizer, stop_after_steps):
      return _stopped(workdir, state, name)
  if DISTILL not in state["rows"]:
    state["teachers"] = choose_teachers(config, state["rows"])
    teachers = {env: state["workdirs"][name] for env, name in state["teachers"].items()}
    init_from = _start_workdir(config.distill.start, state, names)
    rl_config = stage_rl_config(config, DISTILL, init_from, teachers)
    logging.info("distillation from %s: teachers %s", init_from, state["teachers"])
    if not _run_stage(config, DISTILL, rl_config, workdir, state, tokenizer, stop_after_steps):
      return _stopped(workdir, state, DISTILL)
  return state


def _run_stage(config, name, rl_config, workdir, state, tokenizer, stop_after_steps) -> bool:
  """Runs one stage to its end and records its row; False when it stopped early."""
  stage_dir = os.path.join(workdir, "stages", name)
  start = time.time()
  logging.info("pipeline stage %s: %d RL steps from %s into %s", name, rl_config.rl.steps,
               rl_config.rl.init_from, stage_dir)
  summary = loop.rl_train(rl_config, stage_dir, stop_after_steps=stop_after_steps)
  # A resumed stage's time adds to the time its earlier calls spent.
  state["seconds"][name] = state["seconds"].get(name, 0.0) + time.time() - start
  if summary["stopped_early"]:
    _write_state(workdir, state)
    return False
  t0 = time.time()
  state["workdirs"][name] = stage_dir
  state["rows"][name] = evaluate_all(config, stage_dir, tokenizer)
  state["seconds"][name] += time.time() - t0
  _write_state(workdir, state)
  logging.info("pipeline stage %s done: %s", name, state["rows"][name])
  return True


def _start_workdir(start: str, state: dict, earlier: list[str]) -> str:
  """The checkpoint workdir a stage starts from (validated by `validate_pipeline`)."""
  if start == PREVIOUS:
    return state["workdirs"][earlier[-1]]
  if start == START or start in earlier:
    return state["workdirs"][start]
  return start


def choose_teachers(config, rows: dict) -> dict:
  """{env: checkpoint name} of each distillation task: its `teacher`, or for "best" the
  checkpoint (START or a stage) with the highest held-out accuracy on that env in `rows`, the
  later one on a tie (it has trained longer)."""
  order = [START, *stage_names(config)]
  out = {}
  for env, task in config.distill.tasks.items():
    if task.teacher != BEST:
      out[env] = task.teacher
      continue
    out[env] = max(reversed(order), key=lambda name: rows[name][env])
  return out


def eval_rl_config(config):
  """The RL config `evaluate_all` evaluates with: greedy, on the mixture of every task of the
  pipeline, each built with the options of the stage that trains it (`task_options`)."""
  c = base_config(config)
  options = task_options(config)
  c.rl.env = tasks_lib.MIXTURE
  c.rl.env_options = ml_collections.ConfigDict()
  c.rl.tasks = ml_collections.ConfigDict(
      {env: tasks_lib.task_config(weight=1.0, **options.get(env, {}))
       for env in pipeline_envs(config)})
  c.rl.eval_samples = 0
  return c


def evaluate_all(config, workdir: str, tokenizer) -> dict:
  """{env: greedy held-out accuracy} of `workdir`'s latest params on the first
  `pipeline.eval_tasks` eval tasks of every environment of the pipeline (`eval_rl_config`)."""
  c = eval_rl_config(config)
  env = tasks_lib.make_env(c.rl)
  run = load_run(workdir, target_model=c.model)
  metrics = rl_run.evaluate(c, run.params, env, tokenizer, num_tasks=config.pipeline.eval_tasks)
  return {name: metrics[f"{name}/accuracy"] for name in pipeline_envs(config)}


def format_table(state: dict) -> str:
  """The forgetting / recovery table (markdown): a row per checkpoint, a column per task."""
  envs = state["envs"]
  lines = ["| after | " + " | ".join(envs) + " | wall time |",
           "|---|" + "---|" * (len(envs) + 1)]
  for name, row in state["rows"].items():
    lines.append(f"| {name} | " + " | ".join(f"{row[e]:.3f}" for e in envs)
                 + f" | {state['seconds'].get(name, 0.0):.0f} s |")
  options = {e: o for e, o in state.get("env_options", {}).items() if o}
  if options:
    lines.append("")
    lines.append("options: " + ", ".join(f"{e} {o}" for e, o in options.items()))
  if state.get("teachers"):
    lines.append("")
    lines.append("teachers: " + ", ".join(f"{e} <- {n}" for e, n in state["teachers"].items()))
  return "\n".join(lines)


def _read_state(workdir: str) -> dict | None:
  try:
    with open(os.path.join(workdir, STATE_FILE)) as f:
      return json.load(f)
  except FileNotFoundError:
    return None


def _write_state(workdir: str, state: dict) -> None:
  write_atomic(os.path.join(workdir, STATE_FILE), json.dumps(state, indent=1))


def _stopped(workdir: str, state: dict, name: str) -> dict:
  state["stopped"] = name
  _write_state(workdir, state)
  logging.warning("pipeline stage %s stopped early; rerun the same command to resume it", name)
  return state
