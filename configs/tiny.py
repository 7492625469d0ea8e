"""GLM-5's architecture scaled down for CPU: MoE + MLA + DSA (top-k < sequence) + shared MTP.

The default training run (experiments/train.py with no flags) trains this model with Muon
Split on the built-in data mix for about 5 minutes on 2 CPU cores.

  python experiments/train.py --config=configs/tiny.py --workdir=/tmp/tiny
  python experiments/train.py --config=configs/tiny.py:attention=G      (GQA baseline)
  python tools/param_count.py --config=configs/tiny.py

`arg` (configs.common.parse_arg): `attention=<pattern>` (default "D"); a bare pattern works too.
"""

import ml_collections

from configs.common import parse_arg
from glm5_jax import data, optim
from glm5_jax.config import model_config
from glm5_jax.sharding import mesh_config
from glm5_jax.train import config as train_defaults

SEQ_LEN = 256


def tiny_data_sources() -> dict:
  """The default mix sized for a 5-minute CPU run: stdlib text plus short retrieval examples,
  several to a row, so each step carries enough answer tokens for the tiny model to learn.

  Weights count drawn examples, so a 256-token text chunk outweighs a 64-token example: about
  a quarter of the tokens are text, a third `copy` and the rest retrieval. `copy` (a string
  repeated) is the curriculum: every target needs the look-back-and-copy (induction) circuit
  that retrieval also needs, and a retrieval example gives only a few answer tokens. MQAR uses
  one-letter keys and one-digit values with eight queries an example; the needle tasks use
  2-digit values. The long-context suite (`experiments/eval.py`) evaluates all of them at full
  lengths.
  """
  synthetic = lambda task, weight, low, high, **options: data.source_config(
      "synthetic", task=task, weight=weight, min_length=low, max_length=high, **options)
  return dict(
      python_stdlib=data.source_config("python_stdlib", weight=0.1),
      copy=synthetic("copy", 0.5, 32, 96),
      mqar=synthetic("mqar", 0.3, 48, 96, key_chars=1, value_digits=1, num_queries=8),
      niah_single=synthetic("niah_single", 0.025, 96, 160, value_digits=2),
      niah_multikey=synthetic("niah_multikey", 0.025, 184, 256, value_digits=2),
      niah_multivalue=synthetic("niah_multivalue", 0.025, 168, 256, value_digits=2),
      niah_multiquery=synthetic("niah_multiquery", 0.025, 128, 200, value_digits=2),
  )


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, attention="D")
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.model = model_config(
      vocab_size=384,
      hidden_size=64,
      intermediate_size=128,
      num_hidden_layers=4,
      num_attention_heads=4,
      num_key_value_heads=2,
      gqa_head_dim=16,
      # MLA sized for retrieval at this width (measured, docs/ablations.md "Retrieval at tiny
      # scale"): latents of 32/16 and 2 RoPE frequencies (rope dim 4) left the tiny model unable
      # to form the induction circuit every retrieval task needs within the default run.
      q_lora_rank=64,
      kv_lora_rank=64,
      qk_nope_head_dim=12,
      qk_rope_head_dim=8,
      v_head_dim=16,
      index_topk=16,  # < SEQ_LEN, so sparsity is real
      index_n_heads=4,
      index_head_dim=16,  # GLM-5's split: the first half (qk_rope_head_dim) carries RoPE
      n_routed_experts=8,
      num_experts_per_tok=2,
      n_shared_experts=1,
      moe_intermediate_size=32,
      first_k_dense_replace=1,
      rope_theta=10_000.0,
      max_position_embeddings=4096,
      attention_pattern=arg.attention,
      dtype="float32",
      cache_dtype="float32",  # decode equals the full forward to fp32 rounding
  )
  config.data = data.data_config(seq_len=SEQ_LEN, batch_size=8, sources=tiny_data_sources())
  config.optim = optim.optim_config(learning_rate=1e-2, warmup_steps=50)
  # DSA on from scratch: dense attention for the first half while the indexers learn what it
  # attends to, then top-k (an untrained indexer never selects the keys retrieval needs).
  config.train = train_defaults.train_config(steps=600, dsa_dense_steps=300)
  config.ckpt = train_defaults.ckpt_config(every_steps=200)
  config.eval = train_defaults.eval_config(every_steps=200, batches=8)
  config.mesh = mesh_config()
  return config
