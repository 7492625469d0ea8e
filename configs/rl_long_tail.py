"""Asynchronous RL on a long-tailed task mixture: the long-tail hand-off's benchmark
(tools/bench_long_tail.py; docs/async_rl.md, Long-tail hand-off).

  python experiments/rl.py --mode=async --rollout_workers=3 --config=configs/rl_long_tail.py \
      --config.rl.long_tail.worker_share=0.34      # 2 regular workers + 1 long-tail worker

The mixture: 3 of 4 tasks copy a short string (echo, truncated-Pareto lengths 2..32, median 3:
answers of a few tokens, some long), 1 of 4 reverses a 24..32-letter string (strings; its
worked solution spells every letter out before the answer: ~90 tokens). The SFT run first
trains both (the strings SFT data keeps the env's default 3..8 letters). A regular worker hands
a group off once one of its unfinished samples has generated `rl.long_tail.after_tokens` = 24
tokens; `rl.long_tail.worker_share` is 0 (off) unless set.

`arg`: `steps` (RL steps, default 12), `sft_steps` (default 120).
"""

import ml_collections

from configs import rl_tiny
from configs.common import parse_arg
from glm5_jax.posttrain.config import long_tail_config
from glm5_jax.posttrain.tasks import MIXTURE, task_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, steps=12, sft_steps=120)
  # 160 positions: a 32-letter prompt (~50 tokens) and a 96-token turn.
  # The plain GRPO recipe: this config measures the hand-off, and dynamic sampling (the
  # default recipe's) cannot hand a group off mid-way.
  config = rl_tiny.get_config(f"env=echo,steps={arg.steps},sft_steps={arg.sft_steps},"
                              "seq_len=160,recipe=plain")
  config.sft.sft.envs = "echo,strings"
  rl = config.rl
  rl.env = MIXTURE
  rl.tasks.echo = task_config(weight=3.0)
  rl.tasks.strings = task_config(weight=1.0, min_len=24, max_len=32)
  # 8 groups of 4 per step: CPU-sized (rl_tiny trains 32 x 8).
  rl.update(prompts_per_step=8, group_size=4, max_new_tokens=96, worker_groups=4,
            max_staleness=1, eval_every_steps=0, eval_tasks=0, eval_samples=0)
  rl.long_tail = long_tail_config(worker_share=0.0, after_tokens=24)
  return config
