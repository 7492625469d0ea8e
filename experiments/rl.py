"""Reasoning RL (GRPO with IcePop) or on-policy distillation, synchronous, from an SFT run.

  python experiments/rl.py                  # SFT on addition, then RL on it (docs/posttrain.md)
  python experiments/rl.py --config=configs/rl_tiny.py --workdir=/tmp/glm5_rl \
      --config.rl.init_from=/tmp/glm5_sft   # RL from an existing SFT (or any training) run
  python experiments/rl.py --config.rl.loss=distill --config.rl.group_size=1 \
      --config.rl.teacher=/tmp/glm5_rl/rl --config.rl.init_from=/tmp/glm5_rl/sft \
      --workdir=/tmp/glm5_distill          # on-policy distillation from a teacher run

Agentic RL (configs/rl_agentic.py: the model's code runs in the sandbox): `:task=code`
(function synthesis), `:task=repo_repair` (multi-turn tool use on a generated repository) or
`:task=mixture` (a weighted task mixture, `rl.env="mixture"` with `rl.tasks`; per-task metrics
and held-out accuracy):

  python experiments/rl.py --config=configs/rl_agentic.py:task=mixture --workdir=/tmp/glm5_mix

With `rl.init_from` empty it first trains the config's `sft` section (configs/sft_tiny.py: the
tiny GLM-5 on the built-in worked solutions of `rl.env`) into `<workdir>/sft`, unless that run
already finished, then runs RL from it into `<workdir>/rl`: each step samples
`rl.group_size` completions of `rl.prompts_per_step` train tasks through the inference engine,
scores them with the environment, and takes one GRPO step (`glm5_jax.posttrain.loop`). Held-out
accuracy (greedy, `rl.eval_tasks` eval-split tasks) is measured before RL, every
`rl.eval_every_steps` steps and at the end; the summary prints it before and after. Re-running
with the same --workdir resumes exactly (orbax checkpoints in `<workdir>/rl/checkpoints`).

Asynchronous mode (`--mode=async`, glm5_jax/rl): the same SFT first, then one trainer process
and `--rollout_workers` rollout worker processes, sharing only `<workdir>/rl` (orders, rollout
files, published policy versions, checkpoints; glm5_jax/rl/layout.py):

  python experiments/rl.py --mode=async                      # trainer + 2 workers
  python experiments/rl.py --mode=async --rollout_workers=3 --config.rl.max_staleness=2
  # long-tail hand-off: w2 finishes the groups that run past 24 tokens on w0 / w1
  python experiments/rl.py --mode=async --rollout_workers=3 --config=configs/rl_long_tail.py \
      --config.rl.long_tail.worker_share=0.34

With `--config.rl.rollout_via=gateway` (calculator env) each worker plays its episodes with an
agent program through the `openai` client against its own OpenAI-compatible server, and
trains on the TITO gateway's records (docs/async_rl.md).

The launcher (this command) restarts a worker that dies; after the trainer dies, rerunning the
command resumes it from its checkpoint. On a pod each slice runs its role instead, with the
same config flags and workdir (a local path or gs://):

  python experiments/rl.py --mode=async --role=trainer --rollout_workers=4 --workdir=gs://b/run
  python experiments/rl.py --mode=async --role=worker --worker=w2 --workdir=gs://b/run

(the SFT run must exist first: `--config.rl.init_from`, or run the launcher once; with
`rl.long_tail.worker_share` > 0 every role needs the run's --rollout_workers, which says which
workers are long-tail). The trainer
may run as several JAX processes (a multi-host slice; `jax.distributed.initialize()` as in
experiments/train.py, held-out evaluation off: `--config.rl.eval_every_steps=0`); a rollout
worker is one JAX process (a single-host slice, its mesh over that host's devices). The
workers' output goes to `<workdir>/rl/logs/<worker>.log`.

The staged pipeline (configs/rl_staged.py; glm5_jax/posttrain/pipeline.py): SFT, reasoning RL
-> agentic RL -> general RL, each from the previous stage's checkpoint, then on-policy
distillation from the best earlier checkpoint of each task; prints the forgetting / recovery
table (every task's held-out accuracy after each stage):

  python experiments/rl.py --config=configs/rl_staged.py --workdir=/tmp/glm5_staged

Stopping: SIGTERM (to this command; in async mode it is forwarded to the trainer and the
workers, which also die with it) stops the current stage after its current step, whose
checkpoint is committed: the SFT (RL then does not start: it never runs on a partial SFT model)
or RL. Rerunning the same command resumes the stage where it stopped.

Exit status: 0 done; 75 stopped early (SIGTERM), rerun to resume; 1 failed (the last line on
stderr is the root cause).
"""

import json
import os
import sys
import time

from absl import app, flags, logging
import jax

from configs import overrides
from glm5_jax.config import require
from glm5_jax.posttrain import pipeline, sft
from glm5_jax.posttrain.loop import rl_train
from glm5_jax.posttrain.rl_config_checks import validate_rl_experiment
from glm5_jax.rl import async_trainer, launcher, long_tail, worker
from glm5_jax.rl.layout import RunDirs, read_json, write_json
from glm5_jax.train import console, multiprocess
from glm5_jax.train.stopping import EXIT_STOPPED_EARLY, StopSignal

_CONFIG = overrides.define_config_file("config", "configs/rl_tiny.py", "RL config.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/glm5_rl", "The SFT run (when rl.init_from is "
                               "empty) goes to <workdir>/sft, RL to <workdir>/rl; resumed.")
_MODE = flags.DEFINE_enum("mode", "sync", ["sync", "async"], "sync: generate and train in turn "
                          "in this process; async: a trainer and rollout worker processes.")
_WORKERS = flags.DEFINE_integer("rollout_workers", 2, "async: rollout worker processes (names "
                                "w0, w1, ...).")
_ROLE = flags.DEFINE_enum("role", "launcher", ["launcher", "trainer", "worker"], "async: "
                          "launcher starts the others on this machine; trainer / worker run "
                          "one role (one per slice on a pod).")
_WORKER = flags.DEFINE_string("worker", "", "async --role=worker: this worker's name (w<i>).")


def run(config, workdir: str) -> dict:
  """SFT (if needed) then synchronous RL; returns both summaries and their wall times, and
  `stopped` (the stage SIGTERM stopped, or None). A staged pipeline config (configs/
  rl_staged.py) runs `pipeline.run_pipeline` instead: its state, `stopped` included."""
  if "pipeline" in config:
    if not jax.config.jax_compilation_cache_dir:
      # Every stage builds its own trainer and engine, the same programs: compiled once.
      jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "jax_cache"))
    return pipeline.run_pipeline(config, workdir)
  validate_rl_experiment(config)  # before the SFT, which may take hours
  out = sft.ensure_sft_start(config, workdir)
  if out.get("stopped"):
    return out
  start = time.time()
  out["rl"] = rl_train(config, os.path.join(workdir, "rl"))
  out["rl_seconds"] = time.time() - start
  out["stopped"] = "RL" if out["rl"]["stopped_early"] else None
  return out


def run_async(config, workdir: str, argv: list[str]) -> dict:
  """SFT (if needed) in this process, then the trainer and the workers as subprocesses
  (`launcher.launch`); returns the summaries (the trainer's is read from its summary file)."""
  async_trainer.validate_async_experiment(config)
  # Long-tail workers out of --rollout_workers (a ConfigError before the SFT runs).
  long_tail.split_workers(async_trainer.worker_names(_WORKERS.value),
                          config.rl.long_tail.worker_share)
  out = sft.ensure_sft_start(config, workdir)
  if out.get("stopped"):
    return out
  root = os.path.join(workdir, "rl")
  command = launcher.python_command(os.path.abspath(__file__), [
      *argv[1:], f"--workdir={workdir}", f"--config.rl.init_from={config.rl.init_from}"])
  start = time.time()
  out["launch"] = launcher.launch(command, root, async_trainer.worker_names(_WORKERS.value))
  out["rl_seconds"] = time.time() - start
  code = out["launch"]["trainer_returncode"]
  if out["launch"]["stopped"] or code == EXIT_STOPPED_EARLY:
    out["stopped"] = "RL"
    logging.warning("async RL stopped early (trainer exit status %s); rerun the same command "
                    "to resume", code)
    return out
  if code != 0:
    raise RuntimeError(f"the trainer {launcher.describe_exit(code)}; rerun the same command "
                       "to resume")
  out["stopped"] = None
  dirs = RunDirs.at(root)
  out["rl"] = read_json(dirs.root / SUMMARY)
  out["workers"] = {w: read_json(dirs.worker_stats(w))
                    for w in async_trainer.worker_names(_WORKERS.value)}
  return out


SUMMARY = "summary.json"


def run_role(config, workdir: str) -> bool:
  """One process of an asynchronous run: the trainer (writes <workdir>/rl/summary.json when
  it finished) or a worker. Returns whether SIGTERM stopped it early."""
  root = os.path.join(workdir, "rl")
  if _ROLE.value == "trainer":
    summary = async_trainer.run_async_trainer(config, root,
                                              async_trainer.worker_names(_WORKERS.value))
    summary["eval"] = {str(k): v for k, v in summary["eval"].items()}
    if jax.process_index() == 0 and not summary["stopped_early"]:
      write_json(RunDirs.at(root).root / SUMMARY, summary)
    return summary["stopped_early"]
  require(bool(_WORKER.value), "--worker", "--role=worker needs this worker's name (w<i>)")
  return worker.run_worker(config, root, _WORKER.value,
                           workers=async_trainer.worker_names(_WORKERS.value))["stopped_early"]


def join_processes() -> None:
  """Under a multi-process launcher: joins the other processes (before anything touches the
  backend), for the trainer role only. A worker's engine is single-process; the launcher
  starts every process on this machine itself."""
  if not multiprocess.launched_multiprocess():
    return
  role = _ROLE.value if _MODE.value == "async" else "sync"
  require(role == "trainer", "--role", f"{role} was launched as one of several JAX processes; "
          "only --mode=async --role=trainer runs on several (a rollout worker is one JAX "
          "process: a single-host slice, its mesh over that host's devices)")
  multiprocess.initialize_distributed()


def main(argv):
  del argv
  console.quiet_library_info()
  console.announce_slow_compiles()
  start = time.time()
  # One SIGTERM flag for every stage: a signal between the SFT and RL (or while RL is built)
  # stops RL at its first step instead of being lost (glm5_jax.train.stopping).
  with StopSignal():
    try:
      join_processes()
      logging.info("devices: %s", jax.devices())
      if _MODE.value == "async" and _ROLE.value != "launcher":
        if run_role(_CONFIG.value, _WORKDIR.value):
          sys.exit(EXIT_STOPPED_EARLY)
        return
      if _MODE.value == "async":
        require("pipeline" not in _CONFIG.value, "pipeline", "the staged pipeline runs "
                "synchronously (--mode=sync)")
        out = run_async(_CONFIG.value, _WORKDIR.value, sys.argv)
      else:
        out = run(_CONFIG.value, _WORKDIR.value)
    except Exception as e:  # pylint: disable=broad-except
      console.exit_on_failure(e, "RL")
  if out["stopped"]:
    print(f"\n{out['stopped']} stopped early (SIGTERM): its checkpoint is committed; rerun the "
          "same command to resume" + ("; RL starts after the SFT finishes"
                                      if out["stopped"] == "SFT" else ""))
    sys.exit(EXIT_STOPPED_EARLY)
  if "pipeline" in _CONFIG.value:
    print("\n== staged pipeline: held-out greedy accuracy "
          f"({out['eval_tasks']} eval tasks per task) ==")
    print(pipeline.format_table(out))
    print(f"wall time: {time.time() - start:.0f} s")
    return
  print_summary(out, _CONFIG.value, start)


def print_summary(out: dict, config, start: float) -> None:
  rl = out["rl"]
  print("\n== RL summary ==")
  if "sft" in out:
    print(f"SFT: {out['sft']['steps']} steps, loss {out['sft']['first_loss']:.3f} -> "
          f"{out['sft']['last_loss']:.3f}, {out['sft_seconds']:.0f} s")
  print(f"RL: {rl['steps']} of {rl['total_steps']} steps, {out['rl_seconds']:.0f} s")
  c = config.rl
  for step, metrics in sorted(rl["eval"].items(), key=lambda kv: int(kv[0])):
    sampled = (f", sampled {metrics['sampled_accuracy']:.3f} (T={c.temperature:g}), "
               f"pass@{c.eval_samples} {metrics['pass_at_k']:.3f}"
               if "sampled_accuracy" in metrics else "")
    print(f"held-out accuracy at RL step {step} ({c.eval_tasks} eval tasks): greedy "
          f"{metrics['accuracy']:.3f}{sampled}")
    per_task = sorted(k.split("/")[0] for k in metrics if k.endswith("/accuracy"))
    if per_task:  # a task mixture: each task's greedy accuracy, and the mean above
      print("  per task: " + ", ".join(f"{n} {metrics[n + '/accuracy']:.3f}" for n in per_task))
  if rl["first_eval"] is not None:
    print(f"held-out greedy accuracy: {rl['first_eval']:.3f} before RL -> "
          f"{rl['last_eval']:.3f} after")
  if rl["first_sampled_eval"] is not None:
    print(f"held-out sampled accuracy: {rl['first_sampled_eval']:.3f} before RL -> "
          f"{rl['last_sampled_eval']:.3f} after")
  if "staleness" in rl:  # the asynchronous trainer's summary
    hist = {int(k): v for k, v in rl["staleness"]["histogram"].items()}
    print(f"policy versions published: {rl['versions_published']}; orders issued: "
          f"{rl['orders']}; groups rejected as stale: {rl['rejected']} (re-queued "
          f"{rl['requeued']}), quarantined files: {rl['quarantined']}")
    print("staleness (version gap of each sample seen: count): "
          + ", ".join(f"{g}: {c}" for g, c in sorted(hist.items())))
    print(f"trainer idle fraction: {rl['idle_fraction']:.3f}; worker restarts: "
          f"{out['launch']['worker_restarts'] or 'none'}")
    for name, w in out["workers"].items():
      if w is None:
        continue
      whole = max(w["busy_seconds"] + w["idle_seconds"] + w["load_seconds"], 1e-9)
      print(f"worker {name} ({w.get('role', 'regular')}): {w['samples']} samples in "
            f"{w['batches']} batches, {len(w['versions_loaded'])} policy versions loaded, idle "
            f"fraction {w['idle_seconds'] / whole:.3f}, prefix-cache hit rate "
            f"{w['prefix'].get('hit_rate', 0.0):.3f}, groups handed off "
            f"{w.get('handed_off', 0)}, continued {w.get('continued', 0)}")
  print(f"wall time: {time.time() - start:.0f} s; metrics: {rl['metrics_file']}")
  print(json.dumps({k: rl[k] for k in ("first_eval", "last_eval", "first_sampled_eval",
                                       "last_sampled_eval", "steps")}
                   | {"seconds": time.time() - start}))


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
