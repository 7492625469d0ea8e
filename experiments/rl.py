"""Reasoning RL (GRPO with IcePop) or on-policy distillation, synchronous, from an SFT run.

  python experiments/rl.py                  # SFT on addition, then RL on it: ~10 min on 2 CPUs
  python experiments/rl.py --config=configs/rl_tiny.py --workdir=/tmp/glm5_rl \
      --config.rl.init_from=/tmp/glm5_sft   # RL from an existing SFT (or any training) run
  python experiments/rl.py --config.rl.loss=distill --config.rl.group_size=1 \
      --config.rl.teacher=/tmp/glm5_rl/rl --config.rl.init_from=/tmp/glm5_rl/sft \
      --workdir=/tmp/glm5_distill          # on-policy distillation from a teacher run

With `rl.init_from` empty it first trains the config's `sft` section (configs/sft_tiny.py: the
tiny GLM-5 on the built-in worked solutions of `rl.env`) into `<workdir>/sft`, unless that run
already finished, then runs RL from it into `<workdir>/rl`: each step samples
`rl.group_size` completions of `rl.prompts_per_step` train tasks through the inference engine,
scores them with the environment, and takes one GRPO step (`glm5_jax.posttrain.loop`). Held-out
accuracy (greedy, `rl.eval_tasks` eval-split tasks) is measured before RL, every
`rl.eval_every_steps` steps and at the end; the summary prints it before and after. Re-running
with the same --workdir resumes exactly (orbax checkpoints in `<workdir>/rl/checkpoints`).

Exit status: 0 done; 1 failed (the last line on stderr is the root cause).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
import jax  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from glm5_jax.config import require  # noqa: E402
from glm5_jax.posttrain import sft  # noqa: E402
from glm5_jax.posttrain.loop import rl_train  # noqa: E402
from glm5_jax.train import console  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/rl_tiny.py", "RL config.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/glm5_rl", "The SFT run (when rl.init_from is "
                               "empty) goes to <workdir>/sft, RL to <workdir>/rl; resumed.")


def run(config, workdir: str) -> dict:
  """SFT (if needed) then RL; returns both summaries and their wall times."""
  out = {}
  if not config.rl.init_from:
    require("sft" in config, "rl.init_from", "is empty and the config has no `sft` section to "
            "train first; name a checkpoint workdir")
    sft_dir = os.path.join(workdir, "sft")
    start = time.time()
    if sft.finished(config.sft, sft_dir):
      logging.info("SFT in %s already finished: RL starts from it", sft_dir)
    else:
      logging.info("SFT (%d steps) into %s", config.sft.train.steps, sft_dir)
      out["sft"] = sft.run_sft(config.sft, sft_dir)
    out["sft_seconds"] = time.time() - start
    config.rl.init_from = sft_dir
  start = time.time()
  out["rl"] = rl_train(config, os.path.join(workdir, "rl"))
  out["rl_seconds"] = time.time() - start
  return out


def main(argv):
  del argv
  console.quiet_library_info()
  logging.info("devices: %s", jax.devices())
  start = time.time()
  try:
    out = run(_CONFIG.value, _WORKDIR.value)
  except Exception as e:  # pylint: disable=broad-except
    console.exit_on_failure(e, "RL")
  rl = out["rl"]
  print("\n== RL summary ==")
  if "sft" in out:
    print(f"SFT: {out['sft']['steps']} steps, loss {out['sft']['first_loss']:.3f} -> "
          f"{out['sft']['last_loss']:.3f}, {out['sft_seconds']:.0f} s")
  print(f"RL: {rl['steps']} of {rl['total_steps']} steps, {out['rl_seconds']:.0f} s")
  c = _CONFIG.value.rl
  for step, metrics in sorted(rl["eval"].items()):
    sampled = (f", sampled {metrics['sampled_accuracy']:.3f} (T={c.temperature:g}), "
               f"pass@{c.eval_samples} {metrics['pass_at_k']:.3f}"
               if "sampled_accuracy" in metrics else "")
    print(f"held-out accuracy at RL step {step} ({c.eval_tasks} eval tasks): greedy "
          f"{metrics['accuracy']:.3f}{sampled}")
  if rl["first_eval"] is not None:
    print(f"held-out greedy accuracy: {rl['first_eval']:.3f} before RL -> "
          f"{rl['last_eval']:.3f} after")
  if rl["first_sampled_eval"] is not None:
    print(f"held-out sampled accuracy: {rl['first_sampled_eval']:.3f} before RL -> "
          f"{rl['last_sampled_eval']:.3f} after")
  print(f"wall time: {time.time() - start:.0f} s; metrics: {rl['metrics_file']}")
  print(json.dumps({k: rl[k] for k in ("first_eval", "last_eval", "first_sampled_eval",
                                       "last_sampled_eval", "steps")}
                   | {"seconds": time.time() - start}))


if __name__ == "__main__":
  app.run(main)
