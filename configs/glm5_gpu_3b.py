"""A GLM-5-shaped model of 3.0B parameters, 1.9B active, for one H100 / H200 (device_suite).

GLM-5's attention exactly (docs/reference.md section 1): 64 MLA heads of N 192 + R 64 (K = V =
256), kv latent C 512, q latent 1536 (GLM-5: 2048), a DSA lightning indexer of 32 heads x 128
on every layer, top-k 2048, so the sparse stage runs the DSA ops at GLM-5's kernel shapes; a
smaller MoE body (32 routed experts of 512, 4 per token, one shared; the first layer dense),
12 layers, one MTP layer, GLM-5's vocabulary (`tools/param_count.py`: 3,023,595,136 params,
2.83B without MTP, 1,858,090,336 active). Scanned layers, the DSA sparse stage from step 0 (a
throughput config: the indexer is untrained, so the selection is not a useful one, but every op
of the sparse step runs), 8 x 4,096 = 32K tokens per step. The step wastes no FLOPs it can
avoid (issue 41 item 4):
  - `remat_policy="save_attn_lse"` (glm5_jax.layers.remat): the backward reruns the layer's
    projections and FFN / MoE but keeps the sparse attention's output and log-sum-exp, the
    selection, so the indexer top-k and the sparse MLA forward run once per step (~2.4 GB
    per layer kept at 8 x 4,096); the indexer KL's target comes from the sparse MLA backward
    kernel (glm5_jax.attention.dsa_kl_fused: no forward sweep; train steps report no
    `indexer_kl`, eval steps do);
  - `train.ce_chunk=512`: the LM head fused with the loss, 512 positions x 8 rows at a time
    (a 2.5 GB fp32 logits chunk instead of `[32768, 154880]`, 20 GB), bf16 backward matmuls;
    `train.ce_grad_in_forward`: its gradients formed in the forward from each chunk's logits,
    so the backward recomputes none (3 head matmuls, not 4; dW `[D, Y]` bf16, 0.63 GB, and
    the heads' dh, 0.27 GB, held to the backward: glm5_jax.train.fused_ce);
  - `optim.ns_dtype="bfloat16"`: Muon's Newton-Schulz matmuls in bf16 (momentum stays fp32).

  python tools/param_count.py --config=configs/glm5_gpu_3b.py
  python tools/bench_train.py --config=configs/glm5_gpu_3b.py:dsa_impl=pallas   (GPU)
  python tools/bench_train.py --config=configs/glm5_gpu_3b.py:dsa_impl=xla

The routed experts run as a grouped matmul (`model.moe_matmul`, `glm5_jax.grouped_matmul`): on
one GPU "auto" is our Pallas Triton gmm / tgmm; `ragged_dot` would run dense over all 32 experts
there (32x the experts' FLOPs: docs/performance.md, "The GPU train step's matmul FLOPs").

`arg` (configs.common.parse_arg): `dsa_impl=` "pallas" (default: the GPU kernels on GPU) |
"xla" | "dense_mask"; `seq_len=` (default 4096); `batch=` rows per step (default 8: 32K tokens);
`moe_matmul=` "auto" (default) | "ragged_dot" | "triton_gmm" (A/B of the experts' matmul).
"""

import ml_collections

from configs.common import parse_arg
from glm5_jax import data, optim
from glm5_jax.config import model_config
from glm5_jax.sharding import mesh_config
from glm5_jax.train import config as train_defaults


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, dsa_impl="pallas", seq_len=4096, batch=8, moe_matmul="auto")
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.model = model_config(
      hidden_size=2048,
      intermediate_size=6144,
      num_hidden_layers=12,
      q_lora_rank=1536,
      n_routed_experts=32,
      num_experts_per_tok=4,
      moe_intermediate_size=512,
      first_k_dense_replace=1,
      mtp_depths=1,
      max_position_embeddings=65536,
      attention_pattern="D",
      dsa_impl=arg.dsa_impl,
      moe_matmul=arg.moe_matmul,
      scan_layers=True,
      remat_policy="save_attn_lse",
  )
  config.data = data.data_config(seq_len=arg.seq_len, batch_size=arg.batch)
  config.optim = optim.optim_config(learning_rate=3e-4, warmup_steps=100, ns_dtype="bfloat16")
  config.train = train_defaults.train_config(steps=1000, ce_chunk=512, ce_grad_in_forward=True)
  config.ckpt = train_defaults.ckpt_config(every_steps=500)
  config.eval = train_defaults.eval_config(every_steps=0, batches=1)
  config.mesh = mesh_config()
  return config
