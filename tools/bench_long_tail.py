"""Long-tail hand-off on / off: trainer idle time and step time of asynchronous RL on a
long-tailed task mixture, same seed, budget and worker processes.

  python tools/bench_long_tail.py                   # configs/rl_long_tail.py, 3 workers
  python tools/bench_long_tail.py --steps=8 --rollout_workers=4 --share=0.25

One SFT run (`<workdir>/sft`, trained once and reused), then two runs of
`experiments/rl.py --mode=async` from it, each `--steps` RL steps with `--rollout_workers`
worker processes and the config's seed:
  off   `rl.long_tail.worker_share=0`: every worker takes orders; a generation batch ends when
        its longest sample does;
  on    `rl.long_tail.worker_share=--share`: that share of the workers only finish the groups
        the others hand off (glm5_jax/rl/long_tail.py) after `rl.long_tail.after_tokens`.
Printed side by side, from each run's metrics.jsonl (`trainer/idle_seconds`: waiting for
admissible groups; `trainer/step_seconds`: from the previous step's end to this step's
publish) and its workers' counters: total and per-step idle and step time (mean over the steps
after the first, whose time includes process start and compilation, and over all), wall
time, groups handed off, version gaps, worker idle fractions and the response lengths
generated; then off / on ratios. Both runs share the machine's cores with nothing else of
theirs (they run one after the other). The last line is all figures as JSON.
"""

import json
import os
import subprocess
import sys

# The repository root, for `tools` when run as `python tools/X.py` (sys.path[0] is tools/).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position

from absl import app, flags, logging
import numpy as np

from configs import rl_long_tail
from glm5_jax.posttrain import sft
from glm5_jax.rl.layout import read_json
from glm5_jax.train import console
from glm5_jax.train.stopping import EXIT_STOPPED_EARLY
from tools.async_rl_run import REPO, run_async_rl

CONFIG = os.path.join(REPO, "configs", "rl_long_tail.py")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/glm5_bench_long_tail", "SFT (reused) and the "
                               "two runs go under it; the runs are started afresh.")
_STEPS = flags.DEFINE_integer("steps", 12, "RL steps of each run.")
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 120, "SFT steps (configs/rl_long_tail.py).")
_WORKERS = flags.DEFINE_integer("rollout_workers", 3, "Rollout worker processes of each run.")
_SHARE = flags.DEFINE_float("share", 0.34, "rl.long_tail.worker_share of the 'on' run.")
_AFTER = flags.DEFINE_integer("after_tokens", 24, "rl.long_tail.after_tokens of the 'on' run.")


def _stats(x) -> dict:
  x = np.asarray(x, np.float64)
  return {"total": float(x.sum()), "mean": float(x.mean()) if x.size else float("nan"),
          "mean_after_first": float(x[1:].mean()) if x.size > 1 else float("nan"),
          "p90": float(np.percentile(x, 90)) if x.size else float("nan")}


def run(arm: str, share: float, init_from: str) -> dict:
  workdir = os.path.join(_WORKDIR.value, arm)
  subprocess.run(["rm", "-rf", workdir], check=True)
  wall, dirs = run_async_rl(arm, workdir, _WORKERS.value, [
      f"--config={CONFIG}:steps={_STEPS.value},sft_steps={_SFT_STEPS.value}",
      f"--config.rl.init_from={init_from}", f"--config.rl.long_tail.worker_share={share}",
      f"--config.rl.long_tail.after_tokens={_AFTER.value}"])
  with open(dirs.root / "metrics.jsonl") as f:
    steps = [r for r in map(json.loads, f) if "trainer/step_seconds" in r]
  summary = read_json(dirs.root / "summary.json")
  out = {"wall_seconds": wall, "steps": len(steps),
         "idle_seconds": _stats([r["trainer/idle_seconds"] for r in steps]),
         "step_seconds": _stats([r["trainer/step_seconds"] for r in steps]),
         "train_seconds": _stats([r["train_seconds"] for r in steps]),
         "groups_handed_off": int(sum(r["long_tail/groups_handed_off"] for r in steps)),
         "staleness_histogram": summary["staleness"]["histogram"],
         "rejected": summary["rejected"], "reward": float(np.mean([r["reward"] for r in steps])),
         "workers": {}}
  lengths = []
  for w in range(_WORKERS.value):
    stats = read_json(dirs.worker_stats(f"w{w}"))
    whole = stats["busy_seconds"] + stats["idle_seconds"] + stats["load_seconds"]
    out["workers"][f"w{w}"] = {"role": stats.get("role"), "samples": stats["samples"],
                               "idle_fraction": stats["idle_seconds"] / max(whole, 1e-9),
                               "handed_off": stats["handed_off"],
                               "continued": stats["continued"]}
    lengths += stats["response_lengths"]
  x = np.asarray(lengths, np.float64)
  out["response_length"] = {"p50": float(np.percentile(x, 50)),
                            "p90": float(np.percentile(x, 90)), "max": float(x.max())}
  return out


def main(argv):
  del argv
  console.quiet_library_info()
  config = rl_long_tail.get_config(f"steps={_STEPS.value},sft_steps={_SFT_STEPS.value}")
  if sft.ensure_sft_start(config, _WORKDIR.value).get("stopped"):
    sys.exit(EXIT_STOPPED_EARLY)  # SIGTERM during the SFT: never benchmark a partial model
  results = {}
  for arm, share in (("off", 0.0), ("on", _SHARE.value)):
    logging.info("%s: %d steps, %d workers, long_tail.worker_share=%s", arm, _STEPS.value,
                 _WORKERS.value, share)
    results[arm] = run(arm, share, config.rl.init_from)
  off, on = results["off"], results["on"]
  samples = _STEPS.value * config.rl.prompts_per_step * config.rl.group_size
  print(f"\n== long-tail hand-off off vs on: {_STEPS.value} steps x "
        f"{config.rl.prompts_per_step * config.rl.group_size} samples = {samples} each, "
        f"{_WORKERS.value} worker processes, share {_SHARE.value}, after_tokens "
        f"{_AFTER.value} ==")
  rows = [("trainer idle, total s", lambda r: r["idle_seconds"]["total"]),
          ("trainer idle, s/step after the 1st", lambda r: r["idle_seconds"]["mean_after_first"]),
          ("step time, s/step after the 1st", lambda r: r["step_seconds"]["mean_after_first"]),
          ("step time, p90 s", lambda r: r["step_seconds"]["p90"]),
          ("train time, s/step", lambda r: r["train_seconds"]["mean"]),
          ("wall time, s", lambda r: r["wall_seconds"])]
  print(f"{'':38s}{'off':>10s}{'on':>10s}{'off/on':>10s}")
  for label, get in rows:
    a, b = get(off), get(on)
    print(f"{label:38s}{a:10.2f}{b:10.2f}{a / max(b, 1e-9):10.2f}")
  for arm, r in results.items():
    print(f"{arm}: groups handed off {r['groups_handed_off']}, version gaps "
          f"{r['staleness_histogram']}, rejected {r['rejected']}, train reward "
          f"{r['reward']:.3f}, response length p50/p90/max {r['response_length']['p50']:.0f}/"
          f"{r['response_length']['p90']:.0f}/{r['response_length']['max']:.0f}; workers "
          + ", ".join(f"{n} ({w['role']}) idle {w['idle_fraction']:.2f}"
                      for n, w in r["workers"].items()))
  print(json.dumps(results))


if __name__ == "__main__":
  app.run(main)
