"""GLM-5's staged post-training on the tiny model: SFT, then reasoning RL (addition) ->
agentic RL (the calculator tool, 5 digits) -> general RL (reversal of 12-16 letters), each
stage from the previous stage's checkpoint, then on-policy distillation of all three tasks into
the final student, each task against the best earlier checkpoint on it
(glm5_jax/posttrain/pipeline.py).

  python experiments/rl.py --config=configs/rl_staged.py --workdir=/tmp/glm5_staged
  python experiments/rl.py --config=configs/rl_staged.py:stage_steps=1,distill_steps=1,sft_steps=4
      --workdir=/tmp/glm5_staged_smoke                       # one step per stage
  python experiments/rl.py --config=configs/rl_staged.py \
      --config.stages.agentic.rl.steps=40 --config.distill.tasks.strings.teacher=general ...

The summary prints the forgetting / recovery table: every task's held-out greedy accuracy after
the SFT, after each stage and after the distillation. Rerunning the same command resumes
(finished stages are skipped, a stopped one resumes from its checkpoint).

`arg` (configs.common.parse_arg): `stage_steps` (RL steps of each stage, default 30),
`distill_steps` (default 20), `sft_steps` (default 800), `num_per_env` (SFT conversations of
each task, default 4000), `eval_tasks` (held-out tasks per task per table row, default 128),
`prompts` (prompts per RL step, default 32: x 8 samples, configs/rl_tiny.py's 256).

The defaults are the measured run of docs/posttrain.md ("Staged pipeline"). Each stage's task
is sized so that the SFT leaves room for its RL (STAGE_OPTIONS: the stage's rl.env_options,
which every table row's evaluation and the distillation of that task also use): addition of 2
digits, the calculator on 5-digit operands, reversal of 12-16 letters. After the 800-step SFT
(worked solutions of 2-digit addition, 5-digit calculator, 3-16-letter strings) their held-out
greedy accuracies are 92% / 93% / 95% (128 tasks each), and sampled (T=1) rewards below 1 with
mixed groups for GRPO. With the default options the calculator (3 digits) was at 100% greedy and
1.000 sampled after the SFT and strings (3-8 letters) at 99%: no room. Longer than the SFT saw
(6-7-digit calculator, 17+ letters) scores 0 greedy and 0 sampled: no signal either. Fewer SFT
steps do not make room: 350 steps gave 5-23% with rewards flat at ~0.05 (the tiny model learns
these tasks in a phase change).
"""

import ml_collections

from configs import sft_tiny
from configs.common import parse_arg
from glm5_jax import optim
from glm5_jax.posttrain.config import rl_config
from glm5_jax.posttrain.pipeline_config import (distill_config, distill_task, pipeline_section,
                                                stage_config)
from glm5_jax.posttrain.rl_config_checks import rl_data_config
from glm5_jax.sharding import mesh_config
from glm5_jax.train import config as train_defaults

ENVS = ("addition", "calculator", "strings")
SEQ_LEN = 192
# The SFT's worked solutions (sft.env_options) and the stages' tasks (each stage's
# rl.env_options: its RL, every table row's evaluation of the task and its distillation).
SFT_OPTIONS = {"calculator": {"digits": 5}, "strings": {"min_len": 3, "max_len": 16}}
STAGE_OPTIONS = {"addition": {}, "calculator": {"digits": 5},
                 "strings": {"min_len": 12, "max_len": 16}}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, stage_steps=30, distill_steps=20, sft_steps=800, eval_tasks=128,
                  prompts=32, num_per_env=4000)
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.sft = sft_tiny.get_config(f"envs={'+'.join(ENVS)},steps={arg.sft_steps},"
                                   f"num_per_env={arg.num_per_env}")
  # A 5-digit calculator episode (system, question, tool call, observation, answer) is up to
  # 174 tokens (byte tokenizer): SFT and RL rows of 192; a turn up to 64 new tokens (a
  # 16-letter reversal's worked answer is 63).
  config.sft.data.seq_len = SEQ_LEN
  config.sft.sft.env_options = ml_collections.ConfigDict(SFT_OPTIONS)
  config.model = config.sft.model
  config.data = rl_data_config(seq_len=SEQ_LEN)
  config.rl = rl_config(group_size=8, prompts_per_step=arg.prompts, max_new_tokens=64,
                        temperature=1.0, steps=arg.stage_steps, eval_every_steps=0,
                        eval_tasks=arg.eval_tasks, eval_samples=0)
  config.optim = optim.optim_config(learning_rate=1e-3, warmup_steps=5)
  config.train = train_defaults.train_config(steps=arg.stage_steps)
  config.ckpt = train_defaults.ckpt_config(every_steps=10, keep=2)
  config.mesh = mesh_config()
  config.pipeline = pipeline_section(("reasoning", "agentic", "general"), arg.eval_tasks)
  config.stages = ml_collections.ConfigDict()
  config.stages.reasoning = stage_config("sft", env="addition", steps=arg.stage_steps,
                                        env_options=STAGE_OPTIONS["addition"])
  config.stages.agentic = stage_config("previous", env="calculator", steps=arg.stage_steps,
                                        env_options=STAGE_OPTIONS["calculator"])
  config.stages.general = stage_config("previous", env="strings", steps=arg.stage_steps,
                                        env_options=STAGE_OPTIONS["strings"])
  # Group size 1 (GLM-5): the advantage is the teacher's per-token gap, not a group baseline;
  # as many samples per step as a stage (prompts x 8).
  config.distill = distill_config(
      {env: distill_task(weight=1.0, teacher="best") for env in ENVS}, start="previous",
      steps=arg.distill_steps, group_size=1, prompts_per_step=arg.prompts * 8)
  return config
