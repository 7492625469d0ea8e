"""Long-tail hand-off on / off: trainer idle time and step time of asynchronous RL on a
long-tailed task mixture, same seed, budget and worker processes.

  python tools/bench_long_tail.py                   # configs/rl_long_tail.py, 3 workers
  python tools/bench_long_tail.py --steps=8 --rollout_workers=4 --share=0.25
  python tools/bench_long_tail.py --share=0.67 --repeats=2   # off, on, on, off

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

Compiles are kept out of the measured steps: every worker warms its engine up before its
first batch (`rl.worker_warmup`, --warmup), and all processes share one persistent
compilation cache, `<workdir>/jax_cache` (--compile_cache), filled before the first run by
warming an engine of the same shapes here, so a worker's warm-up loads its programs instead
of compiling them. Each worker's compile counts (`compiles.in_batches`: during generation
batches) are printed. --repeats=n runs n pairs of arms, alternating their order (off on, on off, ...), and
prints each run and the mean over runs of each arm. The steady-state rows take only the steps
that began after every worker's warm-up ended (its `warm_at`): a worker still warming up holds
back the groups handed to it, which is start-up, not the hand-off.
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
import jax
import numpy as np

from configs import rl_long_tail
from glm5_jax.api import init_params
from glm5_jax.config import ModelConfig
from glm5_jax.infer.compile_count import count_compiles
from glm5_jax.posttrain import rollout, sft
from glm5_jax.rl import worker
from glm5_jax.rl.layout import read_json
from glm5_jax.train import console
from glm5_jax.train.stopping import EXIT_STOPPED_EARLY
from tools.async_rl_run import REPO, define_run_flags, run_async_rl

CONFIG = os.path.join(REPO, "configs", "rl_long_tail.py")
_WORKDIR, _STEPS, _WORKERS = define_run_flags(workdir="/tmp/glm5_bench_long_tail",
                                              runs="the two runs", steps=12, workers=3)
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 120, "SFT steps (configs/rl_long_tail.py).")
_SHARE = flags.DEFINE_float("share", 0.34, "rl.long_tail.worker_share of the 'on' run.")
_AFTER = flags.DEFINE_integer("after_tokens", 24, "rl.long_tail.after_tokens of the 'on' run.")
_WARMUP = flags.DEFINE_bool("warmup", True, "rl.worker_warmup in both runs: workers compile "
                            "their engine's programs before their first batch.")
_CACHE = flags.DEFINE_bool("compile_cache", True, "One persistent compilation cache for every "
                           "process, <workdir>/jax_cache, filled before the first run.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Pairs of runs, their order alternating.")


def _stats(x) -> dict:
  x = np.asarray(x, np.float64)
  return {"total": float(x.sum()), "mean": float(x.mean()) if x.size else float("nan"),
          "mean_after_first": float(x[1:].mean()) if x.size > 1 else float("nan"),
          "p90": float(np.percentile(x, 90)) if x.size else float("nan")}


def use_compile_cache(path: str) -> None:
  """Every program of this process and of the runs it starts (they inherit the environment)
  is written to and read from `path`, however short its compile."""
  for name, value in (("jax_compilation_cache_dir", path),
                      ("jax_persistent_cache_min_compile_time_secs", 0.0),
                      ("jax_persistent_cache_min_entry_size_bytes", 0)):
    os.environ[name.upper()] = str(value)
    jax.config.update(name, value)


def fill_cache(config) -> dict:
  """Compiles the rollout workers' engine programs here (random params of the shapes, dtypes
  and shardings a worker restores a policy into), so that their warm-up loads them from the
  persistent cache."""
  start = time.time()
  abstract = worker.abstract_worker_params(config, ModelConfig.from_config(config.model))
  params = jax.tree.map(lambda p, a: jax.device_put(p.astype(a.dtype), a.sharding),
                        init_params(config.model, jax.random.PRNGKey(0)), abstract)
  with count_compiles() as compiles:
    rollout.rollout_engine(config, params, config.rl.worker_groups * config.rl.group_size
                           ).warmup()
  return {"programs": compiles.count, "cache_hits": compiles.cache_hits,
          "seconds": time.time() - start}


def run(share: float, init_from: str, name: str) -> dict:
  workdir = os.path.join(_WORKDIR.value, name)
  subprocess.run(["rm", "-rf", workdir], check=True)
  wall, dirs = run_async_rl(name, workdir, _WORKERS.value, [
      f"--config={CONFIG}:steps={_STEPS.value},sft_steps={_SFT_STEPS.value}",
      f"--config.rl.init_from={init_from}", f"--config.rl.long_tail.worker_share={share}",
      f"--config.rl.long_tail.after_tokens={_AFTER.value}",
      f"--config.rl.worker_warmup={_WARMUP.value}"])
  with open(dirs.root / "metrics.jsonl") as f:
    steps = [r for r in map(json.loads, f) if "trainer/step_seconds" in r]
  summary = read_json(dirs.root / "summary.json")
  workers = [read_json(dirs.worker_stats(f"w{w}")) for w in range(_WORKERS.value)]
  # Steady state: the steps that began (the previous publish) after the last worker's warm-up
  # ended; before it, a regular worker may hand off to a long-tail worker still warming up.
  warm = max(w.get("warm_at", 0.0) for w in workers)
  steady = [r for r in steps if r["time"] - r["trainer/step_seconds"] >= warm]
  out = {"wall_seconds": wall, "steps": len(steps),
         "idle_seconds": _stats([r["trainer/idle_seconds"] for r in steps]),
         "step_seconds": _stats([r["trainer/step_seconds"] for r in steps]),
         "train_seconds": _stats([r["train_seconds"] for r in steps]),
         "steady": {"steps": len(steady), **{
             key: float(np.sum([r[metric] for r in steady]))
             for key, metric in (("idle_seconds", "trainer/idle_seconds"),
                                 ("step_seconds", "trainer/step_seconds"),
                                 ("train_seconds", "train_seconds"))}},
         "groups_handed_off": int(sum(r["long_tail/groups_handed_off"] for r in steps)),
         "staleness_histogram": summary["staleness"]["histogram"],
         "rejected": summary["rejected"], "reward": float(np.mean([r["reward"] for r in steps])),
         "workers": {}}
  lengths = []
  for w, stats in enumerate(workers):
    whole = stats["busy_seconds"] + stats["idle_seconds"] + stats["load_seconds"]
    out["workers"][f"w{w}"] = {"role": stats.get("role"), "samples": stats["samples"],
                               "idle_fraction": stats["idle_seconds"] / max(whole, 1e-9),
                               "handed_off": stats["handed_off"],
                               "continued": stats["continued"],
                               "compiles": stats["compiles"],
                               "warmup_seconds": stats.get("warmup_seconds", 0.0)}
    lengths += stats["response_lengths"]
  x = np.asarray(lengths, np.float64)
  out["response_length"] = {"p50": float(np.percentile(x, 50)),
                            "p90": float(np.percentile(x, 90)), "max": float(x.max())}
  return out


def main(argv):
  del argv
  console.quiet_library_info()
  config = rl_long_tail.get_config(f"steps={_STEPS.value},sft_steps={_SFT_STEPS.value}")
  if _CACHE.value:
    use_compile_cache(os.path.join(_WORKDIR.value, "jax_cache"))
  if sft.ensure_sft_start(config, _WORKDIR.value).get("stopped"):
    sys.exit(EXIT_STOPPED_EARLY)  # SIGTERM during the SFT: never benchmark a partial model
  filled = fill_cache(config) if _CACHE.value and _WARMUP.value else None
  if filled:
    logging.info("compilation cache: %d engine programs (%d already cached) in %.0f s",
                 filled["programs"], filled["cache_hits"], filled["seconds"])
  arms = {"off": 0.0, "on": _SHARE.value}
  runs = []  # (arm, run name, figures)
  for r in range(_REPEATS.value):
    for arm in ("off", "on") if r % 2 == 0 else ("on", "off"):
      name = arm if r == 0 else f"{arm}{r + 1}"
      logging.info("%s: %d steps, %d workers, long_tail.worker_share=%s", name, _STEPS.value,
                   _WORKERS.value, arms[arm])
      runs.append((arm, name, run(arms[arm], config.rl.init_from, name)))
      print(json.dumps({name: runs[-1][2]}), flush=True)  # each run as it ends
  samples = _STEPS.value * config.rl.prompts_per_step * config.rl.group_size
  print(f"\n== long-tail hand-off off vs on: {_STEPS.value} steps x "
        f"{config.rl.prompts_per_step * config.rl.group_size} samples = {samples} each, "
        f"{_WORKERS.value} worker processes, share {_SHARE.value}, after_tokens "
        f"{_AFTER.value}, warm-up {_WARMUP.value}, compilation cache {_CACHE.value} ==")
  rows = [("trainer idle, total s", lambda r: r["idle_seconds"]["total"]),
          ("trainer idle, s/step after the 1st", lambda r: r["idle_seconds"]["mean_after_first"]),
          ("step time, s/step after the 1st", lambda r: r["step_seconds"]["mean_after_first"]),
          ("step time, p90 s", lambda r: r["step_seconds"]["p90"]),
          ("train time, s/step", lambda r: r["train_seconds"]["mean"]),
          ("wall time, s", lambda r: r["wall_seconds"])]
  names = [name for _, name, _ in runs]
  print(f"{'':38s}" + "".join(f"{n:>9s}" for n in names)
        + f"{'off':>9s}{'on':>9s}{'off/on':>9s}")
  for label, get in rows:
    mean = {arm: np.mean([get(f) for a, _, f in runs if a == arm]) for arm in arms}
    print(f"{label:38s}" + "".join(f"{get(f):9.2f}" for _, _, f in runs)
          + f"{mean['off']:9.2f}{mean['on']:9.2f}{mean['off'] / max(mean['on'], 1e-9):9.2f}")
  # Steady state: each run's steps with every worker warm; an arm's figure is per step over
  # all its runs' such steps.
  for label, key in (("steps with every worker warm", None),
                     ("  trainer idle, s/step", "idle_seconds"),
                     ("  step time, s/step", "step_seconds"),
                     ("  train time, s/step", "train_seconds")):
    get = lambda s, key=key: s["steps"] if key is None else s[key] / max(s["steps"], 1)
    pooled = {arm: {k: sum(f["steady"][k] for a, _, f in runs if a == arm)
                    for k in runs[0][2]["steady"]} for arm in arms}
    a, b = get(pooled["off"]), get(pooled["on"])
    print(f"{label:38s}" + "".join(f"{get(f['steady']):9.2f}" for _, _, f in runs)
          + f"{a:9.2f}{b:9.2f}{a / max(b, 1e-9):9.2f}")
  for _, name, r in runs:
    print(f"{name}: groups handed off {r['groups_handed_off']}, version gaps "
          f"{r['staleness_histogram']}, rejected {r['rejected']}, train reward "
          f"{r['reward']:.3f}, response length p50/p90/max {r['response_length']['p50']:.0f}/"
          f"{r['response_length']['p90']:.0f}/{r['response_length']['max']:.0f}; workers "
          + ", ".join(f"{n} ({w['role']}) idle {w['idle_fraction']:.2f}, compiles "
                      f"{w['compiles']['total']} ({w['compiles']['cache_hits']} cached, "
                      f"{w['compiles']['in_batches']} in batches)"
                      for n, w in r["workers"].items()))
  print(json.dumps({"cache_fill": filled, "runs": {name: f for _, name, f in runs}}))


if __name__ == "__main__":
  app.run(main)
