"""What each sweep run kind does (train / eval / swa_search); see glm5_jax.sweeps.spec.

Each job returns its JSON-able result; the runner adds bookkeeping and writes it.
"""

import json
import os

from absl import logging

from glm5_jax.eval.evaluate import evaluate_run, search_swa_pattern
from glm5_jax.sweeps.spec import apply_overrides, load_config
from glm5_jax.train.loop import train


class RunInterrupted(RuntimeError):
  """A run stopped before it finished (SIGTERM, preemption); it is not recorded as finished,
  and the next attempt resumes it."""


def read_metrics(workdir: str) -> tuple[list[dict], list[dict]]:
  """(train records, eval records) of `<workdir>/metrics.jsonl`, one per step (the last written
  wins, so steps re-run after a resume appear once), in step order.

  A last line that is not JSON (torn: the writer died mid-line) is skipped with a warning; the
  training loop's writer cuts such a line when it resumes.

  Raises:
    ValueError: any other line is not JSON (the message names the file and line).
  """
  path = os.path.join(workdir, "metrics.jsonl")
  by_split = {"train": {}, "eval": {}}
  if os.path.exists(path):
    with open(path) as f:
      lines = [(number, line) for number, line in enumerate(f, start=1) if line.strip()]
    for number, line in lines:
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        if number == lines[-1][0]:
          logging.warning("%s:%d: skipping a torn last line (%s)", path, number, e)
          break
        raise ValueError(f"{path}:{number}: not a JSON record ({e}); only the last line may be "
                         "torn by a crash") from e
      if record.get("split") in by_split:
        by_split[record["split"]][record["step"]] = record
  return tuple([r for _, r in sorted(by_split[s].items())] for s in ("train", "eval"))


def train_job(name: str, spec: dict, suite, workdir: str) -> dict:
  """Trains `spec["config"]` + `spec["overrides"]` in `workdir` (resuming if it has a
  checkpoint), then evaluates the final checkpoint on `suite` when `spec["evaluate"]`.

  Raises:
    RunInterrupted: training stopped before `config.train.steps` (SIGTERM, preemption); its
      checkpoint stays for the next attempt to resume.
  """
  config = load_config(spec["config"], f"sweep.runs.{name}.config")
  apply_overrides(config, spec["overrides"], f"sweep.runs.{name}.overrides")
  summary = train(config, workdir)
  if summary["steps"] < config.train.steps:
    raise RunInterrupted(f"sweep.runs.{name}: training stopped at step {summary['steps']} of "
                         f"{config.train.steps}; its checkpoint resumes on the next attempt")
  train_records, eval_records = read_metrics(workdir)
  final_eval = {k: v for k, v in (eval_records[-1] if eval_records else {}).items()
                if k not in ("split", "time")}
  result = dict(
      workdir=workdir, config=spec["config"], steps=summary["steps"],
      attention_pattern=config.model.attention_pattern, optimizer=config.optim.name,
      dsa_stage=config.train.dsa_stage, init_from=config.train.init_from,
      loss_curve=[[r["step"], r["lm_loss"], r["loss"]] for r in train_records],
      eval_curve=[[r["step"], r.get("lm_loss"), r.get("python_stdlib/loss")]
                  for r in eval_records],
      last_train_lm_loss=train_records[-1]["lm_loss"] if train_records else None,
      heldout_lm_loss=final_eval.get("lm_loss"),
      text_loss=final_eval.get("python_stdlib/loss"), final_eval=final_eval,
      tokens_per_sec=summary.get("tokens_per_sec"))
  if spec["evaluate"]:
    result["suite"] = evaluate_run(workdir, suite, train_length=config.data.seq_len)
    result["score"] = result["suite"]["score"]
  return result


def eval_job(spec: dict, suite) -> dict:
  """The suite on `spec["checkpoint"]` converted to `spec["model"]` overrides."""
  results = evaluate_run(spec["checkpoint"], suite, model_overrides=spec["model"])
  return dict(checkpoint=spec["checkpoint"], attention_pattern=results["meta"][
      "attention_pattern"], suite=results, score=results["score"])


def search_job(spec: dict, suite) -> dict:
  """The SWA layer search on `spec["checkpoint"]`; the result's `pattern` is the best one."""
  result = search_swa_pattern(
      spec["checkpoint"], suite, length=spec["length"] or None,
      num_convert=None if spec["num_convert"] < 0 else spec["num_convert"],
      beam_width=spec["beam_width"], layers_per_step=spec["layers_per_step"],
      letter=spec["letter"], model_overrides=spec["model"])
  return result
