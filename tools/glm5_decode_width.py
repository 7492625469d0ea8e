"""A decode model with GLM-5's per-token widths and few layers, and its per-token FLOPs split
into the work that is constant per token and the work that grows with the context.

Used by `tools/bench_long_context.py --decode_model=glm5`: the tiny model's decode step is a
fraction of a millisecond of constant work, so its 64K / 8K ratio says little about GLM-5's.

Real (configs/glm5_744b.py): hidden 6144; MLA with 64 heads, q_lora 2048, kv_lora 512, nope 192,
RoPE 64, value 256; the lightning indexer's 32 heads x 128 and top-k 2048; each layer's FFN
work per token, the MoE's shared expert + top-8 routed experts of width 2048.

Reduced, so the params fit a CPU machine's memory (fp32, ~2 GiB a layer):
  layers     `layers` of the 78 (the bench's `--decode_layers`, default 1: ~3.4 GiB peak):
             every layer's work is the same function of the context, so the ratio of two
             contexts' step times is a per-layer ratio (GLM-5's 3 dense-FFN layers have a
             little less constant work: the whole model's FLOPs ratio is 1.338x at 64K / 8K
             where one MoE layer's is 1.342x).
  vocab      2048 (GLM-5: 154880): the LM head is once per token, 1.3% (64K) to 1.7% (8K)
             of a 78-layer token's FLOPs (`lm_head_share`); its absence makes the measured
             ratio slightly *larger* than the real one (less constant work).
  FFN        `ffn="dense"` (default): the MoE's active work per token as one dense SwiGLU of
             width (shared + top-k) x 2048 = 18432: the same multiply-adds and weight bytes
             per token. `ffn="moe"`: the model's MoE with 8 routed experts, top-8 (the same
             active work on paper), but XLA:CPU runs `jax.lax.ragged_dot` as a dense product of
             every routed row with every expert, E x the routed work (one D layer at 8K rows:
             5.63 GFLOP of compiled matmuls against the dense form's 1.41), which on CPU
             inflates the constant work and flattens the ratio.
  MTP        off (the main model's decode step).
Compute, params and cache are float32, as configs/tiny.py runs on CPU; the FLOP count holds for
any dtype, the bytes take the value size (`value_bytes`).

Notation (docs/design.md): S cache rows (context), H heads, C kv latent, R RoPE dim, N nope
dim, V value dim, Q query latent, D hidden, J index heads, I index head dim, T top-k, F FFN.
"""

from configs import glm5_744b
from glm5_jax.config import ModelConfig

VOCAB = 2048
FFNS = ("dense", "moe")
MOE_EXPERTS = 8


def glm5_width_config(letter: str, layers: int, max_len: int, ffn: str = "dense",
                      scan: bool = True) -> ModelConfig:
  """GLM-5's widths with `layers` layers of attention kind `letter` ("D" or "M"), the
  reductions of the module docstring, `dsa_impl="xla"`, MTP off."""
  if ffn not in FFNS:
    raise ValueError(f"ffn must be one of {FFNS}, got {ffn!r}")
  cfg = glm5_744b.get_config().model
  active = (cfg.n_shared_experts + cfg.num_experts_per_tok) * cfg.moe_intermediate_size
  cfg.update(num_hidden_layers=layers, attention_pattern=letter, vocab_size=VOCAB,
             max_position_embeddings=max(max_len, cfg.max_position_embeddings),
             dsa_impl="xla", num_nextn_predict_layers=0, mtp_depths=0, scan_layers=scan,
             dtype="float32", cache_dtype="float32", first_k_dense_replace=0)
  if ffn == "dense":
    cfg.update(intermediate_size=active, mlp_pattern="F" * layers)
  else:
    cfg.update(n_routed_experts=MOE_EXPERTS, mlp_pattern="E" * layers)
  return ModelConfig.from_config(cfg)


def layer_work(cfg: ModelConfig, letter: str, context: int, value_bytes: int = 4,
               slots: int = 1) -> dict:
  """FLOPs (2 x multiply-adds) and bytes read of one decode token in one layer of GLM-5
  (`cfg`'s widths, the real MoE's active work whatever `cfg`'s FFN), at a query that sees
  `context` cache rows, with params and cache of `value_bytes` each, in a step of `slots`
  tokens (one a slot) that read the weights once between them.

  Returns `{"flops": {"constant", "context"}, "bytes": {"constant", "context"}}`: "context" is
  the work that depends on S: D, the indexer's scores of every row (S x J x I multiply-adds
  plus the head weighting S x J; reads S x I) and the sparse attention over min(T, S) rows
  (reads those rows' C + R); M, the dense absorbed attention over S rows (reads S x (C + R)).
  Everything else (projections, indexer projections, FFN) is "constant": every weight it reads
  is one multiply-add. Norms, RoPE, softmax and top-k (elementwise or selection work) are not
  counted, nor the new row's cache write.
  """
  d, h, q, c = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
  n, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  attn = (d * q + q * h * (n + r) + d * (c + r)  # q_a, q_b, kv_a
          + h * n * c + h * c * v + h * v * d)  # absorb W_kb into q, W_vb after, o_proj
  experts = cfg.n_shared_experts + cfg.num_experts_per_tok
  ffn = 3 * d * experts * cfg.moe_intermediate_size + d * cfg.n_routed_experts  # + router
  per_row = h * (2 * c + r)  # q.k over C + R, p.v over C
  if letter == "D":
    j, i, t = cfg.index_n_heads, cfg.index_head_dim, min(cfg.index_topk, context)
    constant = attn + q * j * i + d * i + d * j + ffn  # + the indexer's w_q, w_k, head weights
    context_macs = context * (j * i + j) + t * per_row
    context_values = context * i + t * (c + r)
  elif letter == "M":
    constant, context_macs, context_values = attn + ffn, context * per_row, context * (c + r)
  else:
    raise ValueError(f"layer_work counts D and M layers, got {letter!r}")
  return {"flops": {"constant": 2 * constant, "context": 2 * context_macs},
          "bytes": {"constant": value_bytes * constant / slots,
                    "context": value_bytes * context_values}}


def lm_head_share(cfg: ModelConfig, letter: str, context: int, layers: int = 78,
                  vocab: int = 154880) -> float:
  """The LM head's share of a GLM-5 token's FLOPs (`layers` layers of `letter`, vocab
  `vocab`): what the reduced vocab leaves out."""
  head = 2 * cfg.hidden_size * vocab
  split = layer_work(cfg, letter, context)["flops"]
  return head / (head + layers * (split["constant"] + split["context"]))
