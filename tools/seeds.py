"""An RL experiment over SFT seeds x RL seeds, in parallel, with 95% intervals (glm5_jax/sweeps/seeds.py).

  # the default RL recipe, 3 SFT starts x 2 RL seeds, 2 runs at a time (docs/posttrain.md)
  python tools/seeds.py --root=/tmp/glm5_seeds/default --sft_seeds=0,1,2 --rl_seeds=0,1 \
      --parallel=2
  # the null-reward control of the same recipe from the same starts (same seeds, same SFT)
  python tools/seeds.py --root=/tmp/glm5_seeds/null --sft_seeds=0,1,2 --rl_seeds=0,1 \
      -- --config.rl.null_reward_control=true
  # the staged pipeline (SFT, three RL stages, distillation) over 3 SFT starts: each checkpoint's
  # accuracy per task and what each stage changed, paired (glm5_jax/sweeps/pipeline_seeds.py)
  python tools/seeds.py --root=/tmp/glm5_seeds/staged --sft_seeds=0,1,2 --rl_seeds=0 \
      -- --config=configs/rl_staged.py
  # any experiments/rl.py flags after `--`, asynchronous mode included
  python tools/seeds.py --root=/tmp/glm5_seeds/async --sft_seeds=0,1,2 --rl_seeds=0 \
      -- --mode=async --rollout_workers=2
  # ... and compared with the synchronous study run by run (same starts, same seeds)
  python tools/seeds.py --root=/tmp/glm5_seeds/async --sft_seeds=0,1,2 --rl_seeds=0 \
      --compare_to=/tmp/glm5_seeds/default -- --mode=async --rollout_workers=2

Each run is `experiments/rl.py <flags after --> --workdir=<root>/sft<s>_rl<r>
--config.sft.seed=<s> --config.rl.seed=<r>`; the RL seeds of one SFT seed share its SFT run.
Rerunning the command skips finished runs and resumes the others. Writes `<root>/seeds.json`
(every run's row and the summary) and `<root>/seeds.md` (the tables), and prints the tables:
held-out greedy accuracy, sampled accuracy and pass@k before and after RL, and their change,
as mean ± the 95% Student t half-width over the runs, the smallest change, and whether the
change's interval excludes 0 ("effect"). With `--compare_to=<another study's root>` (its
seeds.json) it also prints, and writes to `<root>/comparison.md`, the two studies run by run:
each change and the paired difference of the changes with its 95% t interval, and each metric's
curve over the RL steps (equal RL steps are equal trained samples: both train `rl.batch_groups`
groups a step).
"""

import os
import sys

# The repository root, for `glm5_jax` when run as `python tools/X.py` (sys.path[0] is tools/).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position

from absl import app, flags

from glm5_jax.files import write_atomic
from glm5_jax.sweeps import seeds
from glm5_jax.train import console

_ROOT = flags.DEFINE_string("root", "/tmp/glm5_seeds", "The study's directory (one workdir per "
                            "run, seeds.json, seeds.md); resumed.")
_SFT_SEEDS = flags.DEFINE_list("sft_seeds", ["0", "1", "2"], "SFT seeds (config.sft.seed).")
_RL_SEEDS = flags.DEFINE_list("rl_seeds", ["0", "1"], "RL seeds (config.rl.seed) per SFT seed.")
_PARALLEL = flags.DEFINE_integer("parallel", 2, "Runs at a time (one process each).")
_COMPARE_TO = flags.DEFINE_string("compare_to", "", "Another finished study's root (its "
                                  "seeds.json): compare this one with it run by run.")


def _ints(name: str, values) -> list[int]:
  try:
    return [int(v) for v in values]
  except ValueError:
    raise app.UsageError(f"--{name}: expected comma-separated integers, got {values}") from None


def main(argv):
  console.quiet_library_info()
  if _PARALLEL.value < 1:
    raise app.UsageError(f"--parallel: must be >= 1, got {_PARALLEL.value}")
  out = seeds.run_study(os.path.abspath(_ROOT.value), _ints("sft_seeds", _SFT_SEEDS.value),
                        _ints("rl_seeds", _RL_SEEDS.value), list(argv[1:]),
                        parallel=_PARALLEL.value)
  print(f"\n== seeds study: {len(out['rows'])} runs, {out['seconds']:.0f} s, "
        f"experiments/rl.py {' '.join(out['rl_args'])} ==\n")
  print(seeds.markdown(out["rows"], out["summary"]))
  print(f"(written to {out['root']}/seeds.json and seeds.md)")
  if _COMPARE_TO.value:
    base_root = os.path.abspath(_COMPARE_TO.value)
    table = seeds.comparison_markdown(
        seeds.compare(seeds.read_study(base_root)["rows"], out["rows"]),
        base_label=os.path.basename(base_root), label=os.path.basename(out["root"]))
    write_atomic(os.path.join(out["root"], "comparison.md"), table)
    print(f"\n== {out['root']} against {base_root}, run by run ==\n\n{table}"
          f"(written to {out['root']}/comparison.md)")


if __name__ == "__main__":
  app.run(main)
