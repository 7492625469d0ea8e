"""The length curriculum: one stage of the context extension 4K -> 32K -> 128K -> 200K, each
stage a training run that starts from the previous stage's checkpoint (`train.init_from`).

  python experiments/train.py --config=configs/long_context.py:model=glm5,stage=4k \
      --workdir=/ckpt/ctx_4k
  python experiments/train.py --config=configs/long_context.py:model=glm5,stage=32k,context=8,\
init_from=/ckpt/ctx_4k --workdir=/ckpt/ctx_32k
  ... stage=128k (init_from the 32k run), stage=200k (init_from the 128k run)
  # the tiny model's CPU stage, context axis over 4 simulated devices (tests/test_long_context_stages.py)
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python experiments/train.py \
      --config=configs/long_context.py:stage=16k,context=4,steps=2,init_from=/tmp/tiny_4k ...

What changes per stage, and where it comes from (docs/reference.md "Length curriculum"):
  - `data.seq_len`: the stage's length (`STAGES`; GLM-5's last is its 202,752 positions).
  - the mixture: packed text documents (over-long ones split into `seq_len` chunks, shorter ones
    packed first-fit, `glm5_jax.data.packing`) plus synthetic long-context retrieval at the
    stage's length (the needle tasks of the retrieval suite, half to all of `seq_len` long).
    The report gives no per-stage mixture: this one is the project's choice.
  - rows per step: a fixed token budget per step (`TOKENS_PER_STEP`) over the stage's rows;
    the report gives none.
  - RoPE: unchanged across stages (GLM-5: base 1e6, no YaRN, 202,752 positions, the released
    config; the report states no per-stage base). `model.max_position_embeddings` is the last
    stage's length from the first stage on, so every stage has the same model config and a
    stage longer than it is refused (`validate_config`: data.seq_len).
  - `mesh.shape.context`: the context-parallel axis (`context=`), `mesh.context_layout`
    (`layout=`, "striped" balances the causal work); the stage's length must split over it.

`arg` (configs.common.parse_arg): `model` ("tiny" or "glm5"), `stage` (a `STAGES` name),
`init_from` (the previous stage's workdir; "" for the first stage; a later stage without it is
refused unless `from_scratch=True`, so a forgotten flag never trains a long stage from random
init), `context` (default 1),
`layout` ("contiguous"), `steps` (default 1000), `eval_every` (default 0: the retrieval suite,
`experiments/eval.py`, scores a finished stage at its length).
"""

import ml_collections

from configs import tiny
from configs.common import parse_arg
from glm5_jax import data, optim
from glm5_jax.config import model_config
from glm5_jax.sharding import mesh_config
from glm5_jax.train import config as train_defaults

# Stage name -> tokens per sequence. "16k" is the tiny model's CPU stage (no GLM-5 stage).
STAGES = {"4k": 4096, "16k": 16384, "32k": 32768, "128k": 131072, "200k": 202752}
GLM5_STAGES = ("4k", "32k", "128k", "200k")
LONGEST = STAGES["200k"]
# Tokens per optimizer step, kept across stages (rows = tokens // seq_len).
TOKENS_PER_STEP = {"tiny": 32768, "glm5": 4 * 1024 * 1024}
RETRIEVAL_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")


def stage_sources(seq_len: int) -> dict:
  """Packed text plus the needle tasks at the stage's length (half to all of `seq_len`
  tokens). Weights count drawn documents / examples (`glm5_jax.data`); the token shares they
  give were not measured. A needle example trains on its answer tokens only."""
  sources = {"python_stdlib": data.source_config("python_stdlib", weight=0.8)}
  options = {"niah_multivalue": dict(num_values=3), "niah_multiquery": dict(num_queries=2)}
  for task in RETRIEVAL_TASKS:
    sources[task] = data.source_config("synthetic", task=task, weight=0.05,
                                       min_length=seq_len // 2, max_length=seq_len,
                                       value_digits=2, **options.get(task, {}))
  return sources


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, model="tiny", stage="4k", init_from="", context=1, layout="contiguous",
                  steps=1000, eval_every=0, from_scratch=False)
  if arg.stage not in STAGES:
    raise ValueError(f"configs/long_context.py: stage={arg.stage!r}; known: {sorted(STAGES)}")
  if arg.model not in TOKENS_PER_STEP:
    raise ValueError(f"configs/long_context.py: model={arg.model!r}; known: "
                     f"{sorted(TOKENS_PER_STEP)}")
  first = "4k"  # the first stage of both curricula (GLM5_STAGES; the tiny model's 4k -> 16k)
  if arg.stage != first and not arg.init_from and not arg.from_scratch:
    raise ValueError(f"configs/long_context.py: stage={arg.stage} continues the previous stage: "
                     "pass init_from=<that stage's workdir>, or from_scratch=True to train it "
                     "from random init")
  seq_len = STAGES[arg.stage]
  config = ml_collections.ConfigDict()
  config.seed = 0
  if arg.model == "glm5":
    config.model = model_config()  # max_position_embeddings 202752, RoPE base 1e6
  else:
    config.model = tiny.get_config().model
    config.model.max_position_embeddings = LONGEST
  # The sparse stage on the gather path: "dense_mask" builds [H, L, L] logits (4 GiB per tiny
  # layer at 16K). On TPU pass --config.model.dsa_impl=pallas.
  config.model.dsa_impl = "xla"
  config.data = data.data_config(seq_len=seq_len,
                                 batch_size=max(1, TOKENS_PER_STEP[arg.model] // seq_len),
                                 sources=stage_sources(seq_len))
  config.optim = optim.optim_config(learning_rate=1e-3 if arg.model == "tiny" else 2e-4,
                                    warmup_steps=min(50, arg.steps // 10))
  # Every stage continues a trained DSA model: top-k on from its first step.
  config.train = train_defaults.train_config(steps=arg.steps, dsa_stage="sparse",
                                             dsa_dense_steps=0, init_from=arg.init_from)
  config.ckpt = train_defaults.ckpt_config(every_steps=max(1, min(200, arg.steps)))
  config.eval = train_defaults.eval_config(every_steps=arg.eval_every, batches=1)
  config.mesh = mesh_config(context=arg.context)
  config.mesh.context_layout = arg.layout
  return config
