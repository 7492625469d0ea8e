"""Synchronous vs asynchronous RL: wall-clock for the same trained samples, and idle fractions.

  python tools/bench_rl.py                         # echo env (long-tailed lengths), 2 workers
  python tools/bench_rl.py --steps=10 --rollout_workers=1 --config=configs/rl_tiny.py:env=echo,seq_len=128

Both runs start from one SFT run of the config (`<workdir>/sft`, trained once and reused) and
train `--steps` RL steps of `rl.prompts_per_step x rl.group_size` samples, evaluation off:
  sync   `posttrain.loop.rl_train` in this process: generate a step's samples, then train on
         them, in turn;
  async  experiments/rl.py --mode=async as a subprocess: one trainer process and
         `--rollout_workers` worker processes (glm5_jax/rl).
Printed side by side: wall-clock of each (process start and compilation included in both),
their ratio, the steady-state seconds per step (after the first step) and their ratio, the
overlap bound `(generation + training) / max(generation, training)` of the sync run's phases
(what full overlap on separate hardware could gain; computed, not run), and idle fractions:
  trainer idle   sync: generation time / total (the trainer waits for the rollouts); async:
                 time waiting for enough admissible groups / (waiting + training), from
                 `<run>/control/trainer.json`;
  worker idle    sync: training time / total (generation waits for the update); async: per
                 worker, time with no order or no policy / its whole time, from
                 `<run>/workers/<w>.json`.
and the response lengths (p50 / p90 / max) the async workers generated, and the version-gap
histogram of the async trainer. The anchor is AReaL's 2.77x end-to-end (Fu et al. 2025), which
runs trainer and rollouts on separate accelerators; on one small CPU machine the processes
share the cores, so the ratio here measures what overlapping removes (the synchronous
generation's long-tail bubble, where a few long responses keep the batch open) and not added
hardware. The last output line is all figures as JSON.
"""

import json
import os
import subprocess
import sys
import time

# The repository root, for `tools` when run as `python tools/X.py` (sys.path[0] is tools/).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position

from absl import app, flags, logging
import numpy as np
from ml_collections import config_flags

from configs import overrides
from glm5_jax.posttrain import sft
from glm5_jax.posttrain.loop import rl_train
from glm5_jax.rl.layout import read_json
from glm5_jax.train import console
from glm5_jax.train.stopping import EXIT_STOPPED_EARLY
from tools.async_rl_run import define_run_flags, run_async_rl
_CONFIG = overrides.define_config_file("config", "configs/rl_tiny.py:env=echo,seq_len=128", "RL config.")
_WORKDIR, _STEPS, _WORKERS = define_run_flags(workdir="/tmp/glm5_bench_rl",
                                              runs="the sync and async runs", steps=16,
                                              workers=2)


def _percentiles(lengths) -> dict:
  if not lengths:
    return {}
  x = np.asarray(lengths, np.float64)
  return {"p50": float(np.percentile(x, 50)), "p90": float(np.percentile(x, 90)),
          "max": float(x.max()), "mean": float(x.mean()), "n": int(x.size)}


def _steady_seconds_per_step(metrics_file: str) -> float:
  """Wall seconds per RL step after the first (compilation and process start excluded), from
  the `time` of the train records in metrics.jsonl."""
  with open(metrics_file) as f:
    times = [r["time"] for r in map(json.loads, f) if r.get("split") == "train"]
  return (times[-1] - times[0]) / max(len(times) - 1, 1)


def run_sync(config, workdir: str) -> dict:
  start = time.time()
  summary = rl_train(config, workdir)
  wall = time.time() - start
  with open(summary["metrics_file"]) as f:
    steps = [json.loads(line) for line in f if line.strip()]
  steps = [m for m in steps if "generate_seconds" in m]
  generate = sum(m["generate_seconds"] for m in steps)
  train = sum(m["train_seconds"] for m in steps)
  return {"wall_seconds": wall, "steps": summary["steps"], "generate_seconds": generate,
          "train_seconds": train, "trainer_idle_fraction": generate / wall,
          "worker_idle_fraction": train / wall,
          "steady_seconds_per_step": _steady_seconds_per_step(summary["metrics_file"]),
          # With trainer and rollouts on their own hardware and perfect overlap, a step takes
          # the longer of its two phases: the most asynchrony could gain (computed, not run).
          "overlap_bound": (generate + train) / max(generate, train)}


def run_async(config, workdir: str, steps: int, workers: int) -> dict:
  overrides = {"rl.steps": steps, "rl.eval_every_steps": 0, "rl.init_from": config.rl.init_from}
  # The same config file and overrides as this process's, then the bench's own.
  wall, dirs = run_async_rl("async", workdir, workers, [
      f"--config={config_flags.get_config_filename(flags.FLAGS['config'])}",
      *[a for a in sys.argv[1:] if a.startswith("--config.")],
      *[f"--config.{k}={v}" for k, v in overrides.items()]])
  trainer = read_json(dirs.trainer_stats)
  busy, idle = trainer["busy_seconds"], trainer["idle_seconds"]
  summary = read_json(dirs.root / "summary.json")
  out = {"wall_seconds": wall, "steps": summary["steps"],
         "steady_seconds_per_step": _steady_seconds_per_step(str(dirs.root / "metrics.jsonl")),
         "trainer_idle_fraction": idle / max(busy + idle, 1e-9),
         "staleness_histogram": summary["staleness"]["histogram"],
         "rejected": summary["rejected"], "versions_published": summary["versions_published"],
         "workers": {}}
  lengths = []
  for w in range(workers):
    stats = read_json(dirs.worker_stats(f"w{w}"))
    whole = stats["busy_seconds"] + stats["idle_seconds"] + stats["load_seconds"]
    out["workers"][f"w{w}"] = {"idle_fraction": stats["idle_seconds"] / max(whole, 1e-9),
                               "samples": stats["samples"], "batches": stats["batches"],
                               "versions_loaded": len(stats["versions_loaded"])}
    lengths += stats["response_lengths"]
  out["worker_idle_fraction"] = float(np.mean([v["idle_fraction"]
                                               for v in out["workers"].values()]))
  out["response_length"] = _percentiles(lengths)
  return out


def main(argv):
  del argv
  console.quiet_library_info()
  config = _CONFIG.value
  config.rl.steps = _STEPS.value
  config.rl.eval_every_steps = 0
  workdir = _WORKDIR.value
  if sft.ensure_sft_start(config, workdir).get("stopped"):
    sys.exit(EXIT_STOPPED_EARLY)  # SIGTERM during the SFT: never benchmark a partial model
  for mode in ("sync", "async"):
    subprocess.run(["rm", "-rf", os.path.join(workdir, mode)], check=True)
  samples = _STEPS.value * config.rl.prompts_per_step * config.rl.group_size
  logging.info("sync: %d steps (%d samples) from %s", _STEPS.value, samples, config.rl.init_from)
  sync = run_sync(config, os.path.join(workdir, "sync", "rl"))
  logging.info("async: the same, %d workers", _WORKERS.value)
  asyn = run_async(config, os.path.join(workdir, "async"), _STEPS.value, _WORKERS.value)
  ratio = sync["wall_seconds"] / asyn["wall_seconds"]
  print(f"\n== sync vs async RL: {config.rl.env}, {_STEPS.value} steps x "
        f"{config.rl.prompts_per_step * config.rl.group_size} samples = {samples} trained "
        "samples each ==")
  print(f"wall-clock   sync {sync['wall_seconds']:.1f} s   async {asyn['wall_seconds']:.1f} s   "
        f"sync/async {ratio:.2f}x   (AReaL: 2.77x on separate accelerators)")
  print(f"steady state (s per step after the first)   sync "
        f"{sync['steady_seconds_per_step']:.2f}   async {asyn['steady_seconds_per_step']:.2f}   "
        f"sync/async {sync['steady_seconds_per_step'] / asyn['steady_seconds_per_step']:.2f}x")
  print(f"overlap bound (sync generation + training) / max of the two: "
        f"{sync['overlap_bound']:.2f}x, the most asynchrony gains when trainer and rollouts "
        "have their own hardware (computed from the sync phases, not run)")
  print(f"trainer idle sync {sync['trainer_idle_fraction']:.3f}   async "
        f"{asyn['trainer_idle_fraction']:.3f}")
  print(f"worker idle  sync {sync['worker_idle_fraction']:.3f}   async "
        f"{asyn['worker_idle_fraction']:.3f} (mean of "
        + ", ".join(f"{w} {v['idle_fraction']:.3f}" for w, v in asyn["workers"].items()) + ")")
  lengths = asyn["response_length"]
  if lengths:
    print(f"response length (async samples): p50 {lengths['p50']:.0f}  p90 {lengths['p90']:.0f}  "
          f"max {lengths['max']:.0f}  mean {lengths['mean']:.1f}")
  print(f"async version gaps: {asyn['staleness_histogram']}; rejected {asyn['rejected']}; "
        f"versions published {asyn['versions_published']}")
  print(json.dumps({"sync": sync, "async": asyn, "ratio": ratio, "samples": samples}))


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
