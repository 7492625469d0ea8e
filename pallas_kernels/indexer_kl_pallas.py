"""The sparse stage's indexer KL gradient as Pallas TPU kernels, over every key with the selection
as per-key counts (the form of `sparse_mla_dense_expanded_pallas`, whose backward gives the
target this needs).

The indexer KL of a query (docs/reference.md section 3) is `KL(p || softmax(I))` over its T
selected slots. Its jnp reference is `jax.vjp` of `dsa_kl_fused.indexer_kl_at_selection`: the
scores at the slots (`indexer_scores_at`, "dense": every key's scores of a query block as one
XLA product, then the slots picked), the KL per query block, rematerialized in the backward. On
the 744B step that pass and its backward cost ~1.1 s of the TPU compiler's estimate a step
(docs/scaling.md); its fp32 `[Lb, J, S]` products go through HBM several times. Written over
every key with `c_s`, how many slots selected key s, the same gradient needs no gather:

  z_s    = sum_j w_j relu(scale q_j . k_s)         (the index score of key s)
  lse    = log sum_s c_s e^{z_s},  n = sum_s c_s t_s
  dz_s   = g c_s (e^{z_s - lse} - t_s / n)          (0 for a query with n = 0)
  dq_j   = sum_s dz_s w_j [q_j . k_s > 0] scale k_s,  dk_s = sum_{l, j} (same) q_j,
  dw_j   = sum_s dz_s relu(scale q_j . k_s)

with g the KL's cotangent and t_s the attention's head-mean probability of ONE copy of key s
(`t` here, `target_BLS`: a slot's target is its key's entry, and a key selected twice counts
twice through c_s, as the index contract's duplicates do). Three kernels, each a block's
`[Lb, Sb]` scores in VMEM, J `[Lb, I] x [I, Sb]` MXU products a step:

  stats  grid (B, L / Lb, S / Sb), key blocks innermost: online lse and n per query.
  dq     grid (B, L / Lb, S / Sb): dz from lse and n; dq and dw accumulated over key blocks.
  dk     grid (B, S / Sb, L / Lb), query blocks innermost: dk accumulated over query blocks.

With `causal` (queries and keys the same positions) a key block wholly after a query block is
skipped and its DMA too (`blocking.KernelBlocks`), as the attention kernels do. Each kernel gives
its `pl.CostEstimate` (the FLOPs of the blocks it computes, the bytes it moves).

Backends: TPU (Mosaic) compiled; interpret mode only when asked for (`interpret=True`, the CPU
tests). TPU block rules: Sb a multiple of 128, Lb of 8; the sequence axes are padded to whole
blocks (padded keys have count 0, padded queries cotangent 0). Layout as
`lightning_indexer_pallas`: q `[B, J, L, I]`, so each head's `[Lb, I]` is a clean tile.

Notation (docs/design.md): B batch, L queries, S keys, J index heads, I index head dim, T top-k
slots; Lb queries and Sb keys of a block.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.blocking import MASKED_LOGIT, KernelBlocks, op_selection, pad_axis, round_up
from pallas_kernels.sparse_mla_dense import key_counts

_NT = (((1,), (1,)), ((), ()))  # [m, k] x [n, k] -> [m, n]
_NN = (((1,), (0,)), ((), ()))  # [m, k] x [k, n] -> [m, n]
_TN = (((0,), (0,)), ((), ()))  # [k, m] x [k, n] -> [m, n]
# 128 queries x 512 keys a step: the J = 32 heads' fp32 scores (8 MiB), the double-buffered
# counts and target blocks and the accumulators fit; over Mosaic's default 16 MiB scoped limit.
BLOCK_Q, BLOCK_K = 128, 512
VMEM_LIMIT_BYTES = 40 << 20
_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                               vmem_limit_bytes=VMEM_LIMIT_BYTES)


def _scores(q_ref, k_SI, w_LJ, scores_ref, scale):
  """z, fp32 `[Lb, Sb]`; each head's scaled logits kept in `scores_ref` `[J, Lb, Sb]`."""
  z = None
  for h in range(q_ref.shape[0]):
    s = jax.lax.dot_general(q_ref[h], k_SI, _NT, preferred_element_type=jnp.float32) * scale
    scores_ref[h] = s
    term = w_LJ[:, h:h + 1] * jnp.maximum(s, 0.0)
    z = term if z is None else z + term
  return z


def _stats_kernel(counts_ref, target_ref, q_ref, k_ref, w_ref, lse_ref, mass_ref, m_acc, l_acc,
                  n_acc, scores_ref, *, scale, blocks, num_key_blocks):
  i, j = pl.program_id(1), pl.program_id(2)

  @pl.when(j == 0)
  def _():
    m_acc[...] = jnp.full(m_acc.shape, MASKED_LOGIT, jnp.float32)
    l_acc[...] = jnp.zeros(l_acc.shape, jnp.float32)
    n_acc[...] = jnp.zeros(n_acc.shape, jnp.float32)

  @pl.when(blocks.visible(i, j))
  def _():
    counts = counts_ref[...]
    z = _scores(q_ref, k_ref[...], w_ref[...].astype(jnp.float32), scores_ref, scale)
    z = jnp.where(counts > 0, z, MASKED_LOGIT)
    m_new = jnp.maximum(m_acc[...], jnp.max(z, axis=1, keepdims=True))
    l_acc[...] = l_acc[...] * jnp.exp(m_acc[...] - m_new) + jnp.sum(
        counts * jnp.exp(z - m_new), axis=1, keepdims=True)
    m_acc[...] = m_new
    n_acc[...] += jnp.sum(counts * target_ref[...], axis=1, keepdims=True)

  @pl.when(j == num_key_blocks - 1)
  def _():
    total = l_acc[...]
    lse_ref[...] = jnp.where(total > 0, m_acc[...] + jnp.log(jnp.where(total > 0, total, 1.0)),
                             0.0)
    mass_ref[...] = n_acc[...]


def _score_grads(counts_ref, target_ref, q_ref, k_SI, w_LJ, lse_ref, a_ref, b_ref, scores_ref,
                 scale):
  """dz, fp32 `[Lb, Sb]`: `counts (a e^{z - lse} - b target)`, a = g and b = g / n per query
  (both 0 where n = 0)."""
  counts = counts_ref[...]
  z = _scores(q_ref, k_SI, w_LJ, scores_ref, scale)
  softmax = jnp.exp(jnp.where(counts > 0, z, MASKED_LOGIT) - lse_ref[...])
  return counts * (a_ref[...] * softmax - b_ref[...] * target_ref[...])


def _head_score_grad(dz, scores_ref, w_LJ, h, scale):
  """`dz w_h [s_h > 0] scale`, fp32 `[Lb, Sb]`: the gradient at head h's logits (before scale)."""
  return jnp.where(scores_ref[h] > 0, dz * (w_LJ[:, h:h + 1] * scale), 0.0)


def _dq_kernel(counts_ref, target_ref, q_ref, k_ref, w_ref, lse_ref, a_ref, b_ref, dq_ref, dw_ref,
               dq_acc, dw_acc, scores_ref, *, scale, blocks, num_key_blocks):
  i, j = pl.program_id(1), pl.program_id(2)

  @pl.when(j == 0)
  def _():
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)
    dw_acc[...] = jnp.zeros(dw_acc.shape, jnp.float32)

  @pl.when(blocks.visible(i, j))
  def _():
    k_SI, w_LJ = k_ref[...], w_ref[...].astype(jnp.float32)
    dz = _score_grads(counts_ref, target_ref, q_ref, k_SI, w_LJ, lse_ref, a_ref, b_ref,
                      scores_ref, scale)
    columns = []
    for h in range(q_ref.shape[0]):
      ds = _head_score_grad(dz, scores_ref, w_LJ, h, scale)
      dq_acc[h] += jax.lax.dot_general(ds.astype(k_SI.dtype), k_SI, _NN,
                                       preferred_element_type=jnp.float32)
      columns.append(jnp.sum(dz * jnp.maximum(scores_ref[h], 0.0), axis=1, keepdims=True))
    dw_acc[...] += jnp.concatenate(columns, axis=1)

  @pl.when(j == num_key_blocks - 1)
  def _():
    dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)
    dw_ref[...] = dw_acc[...].astype(dw_ref.dtype)


def _dk_kernel(counts_ref, target_ref, q_ref, k_ref, w_ref, lse_ref, a_ref, b_ref, dk_ref, dk_acc,
               scores_ref, *, scale, blocks, num_query_blocks):
  j, i = pl.program_id(1), pl.program_id(2)

  @pl.when(i == 0)
  def _():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)

  @pl.when(blocks.visible(i, j))
  def _():
    w_LJ = w_ref[...].astype(jnp.float32)
    dz = _score_grads(counts_ref, target_ref, q_ref, k_ref[...], w_LJ, lse_ref, a_ref, b_ref,
                      scores_ref, scale)
    for h in range(q_ref.shape[0]):
      ds = _head_score_grad(dz, scores_ref, w_LJ, h, scale)
      dk_acc[...] += jax.lax.dot_general(ds.astype(q_ref.dtype), q_ref[h], _TN,
                                         preferred_element_type=jnp.float32)

  @pl.when(i == num_query_blocks - 1)
  def _():
    dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)


def _cost(steps, blocks, heads, head_dim, products, per_step_bytes, once_bytes):
  """`pl.CostEstimate`: `products` `[Lb, I] x [I, Sb]`-sized matmuls per head of each computing
  step, one exponential per (query, key) pair; `per_step_bytes` fetched by each computing step,
  `once_bytes` read or written once."""
  pairs = steps * blocks.lb * blocks.sb
  return pl.CostEstimate(flops=2 * pairs * heads * head_dim * products, transcendentals=pairs,
                         bytes_accessed=int(steps * per_step_bytes + once_bytes))


def check_indexer_kl_inputs(q_BLJI, k_BSI, w_BLJ, topk_BLT, target_BLS, dkl_BL):
  """A ValueError naming the argument whose shape disagrees with q `[B, L, J, I]`."""
  b, l, j, i = q_BLJI.shape
  s = k_BSI.shape[1]
  want = {"k_BSI": (k_BSI, (b, s, i)), "w_BLJ": (w_BLJ, (b, l, j)),
          "topk_BLT": (topk_BLT, (b, l) + topk_BLT.shape[2:]),
          "target_BLS": (target_BLS, (b, l, s)), "dkl_BL": (dkl_BL, (b, l))}
  for name, (x, shape) in want.items():
    if x.shape != shape or (name == "topk_BLT" and x.ndim != 3):
      raise ValueError(f"indexer_kl_grads_pallas: {name} has shape {x.shape}, expected "
                       f"{shape if name != 'topk_BLT' else (b, l, 'T')} for q {q_BLJI.shape} "
                       f"[B, L, J, I] and k {k_BSI.shape} [B, S, I]")


def indexer_kl_grads_pallas(q_BLJI, k_BSI, w_BLJ, topk_BLT, target_BLS, dkl_BL, *, scale: float,
                            causal: bool = False, block_q: int = BLOCK_Q,
                            block_k: int = BLOCK_K, interpret: bool = False):
  """The indexer KL's input gradients (module docstring): `jax.vjp` of
  `dsa_kl_fused.indexer_kl_at_selection(q, k, w, topk, target at the slots)` applied to `dkl_BL`.

  Args:
    q_BLJI, k_BSI, w_BLJ: the indexer's queries, keys and head weights (`LightningIndexer`).
    topk_BLT: int selected key positions; the index contract of `pallas_kernels` (out of range
      = empty, a duplicate counts twice; with `causal`, a slot after its query is empty).
    target_BLS: fp32, the attention's head-mean probability of one copy of each key (read only
      at selected keys; detached by the caller).
    dkl_BL: the cotangent of the per-query KL.
    scale: the indexer's score scale. causal: queries and keys are the same L positions.
    block_q, block_k: queries and keys a step (clipped to the padded sequence).
    interpret: run the kernels in interpret mode (any backend).
  Returns:
    `(dq_BLJI, dk_BSI, dw_BLJ)` in the dtypes of q, k and w.
  """
  check_indexer_kl_inputs(q_BLJI, k_BSI, w_BLJ, topk_BLT, target_BLS, dkl_BL)
  if block_q % 8 or block_k % 128:
    raise ValueError(f"block_q={block_q} must be a multiple of 8 and block_k={block_k} of 128 "
                     "(TPU tiles)")
  topk_BLT = op_selection(topk_BLT, q_BLJI, k_BSI, causal, "indexer_kl_grads_pallas")
  (b, l, nh, di), s = q_BLJI.shape, k_BSI.shape[1]
  blocks = KernelBlocks(1, min(block_q, round_up(l, 8)), min(block_k, round_up(s, 128)), causal)
  lb, sb = blocks.lb, blocks.sb
  l_pad, s_pad = round_up(l, lb), round_up(s, sb)
  nl, ns = l_pad // lb, s_pad // sb
  f32 = jnp.float32
  pad_keys = lambda x: pad_axis(pad_axis(x, 1, l_pad, 0.0), 2, s_pad, 0.0)
  counts = pad_keys(key_counts(topk_BLT, s))
  target = pad_keys(target_BLS.astype(f32))
  q = pad_axis(jnp.swapaxes(q_BLJI, 1, 2), 2, l_pad, 0)
  k = pad_axis(k_BSI, 1, s_pad, 0)
  w = pad_axis(w_BLJ, 1, l_pad, 0)
  g = pad_axis(dkl_BL.astype(f32), 1, l_pad, 0.0)
  steps = b * blocks.computed(l_pad, s_pad)
  q_bytes, k_bytes, w_bytes = (x.size * x.dtype.itemsize for x in (q, k, w))
  pair_block_bytes = 2 * lb * sb * 4  # counts, target
  key_block_bytes = sb * di * k.dtype.itemsize
  kw = dict(scale=float(scale), blocks=blocks)

  # (query block, key block) steps, the key blocks innermost
  def query_major(index):
    return lambda bb, i, j: (bb,) + index(i, j)

  keys = blocks.last_key_block
  pair_spec = pl.BlockSpec((None, lb, sb), query_major(lambda i, j: (i, keys(i, j))))
  q_spec = pl.BlockSpec((None, nh, lb, di), query_major(lambda i, j: (0, i, 0)))
  k_spec = pl.BlockSpec((None, sb, di), query_major(lambda i, j: (keys(i, j), 0)))
  w_spec = pl.BlockSpec((None, lb, nh), query_major(lambda i, j: (i, 0)))
  column_spec = pl.BlockSpec((None, lb, 1), query_major(lambda i, j: (i, 0)))
  column = jax.ShapeDtypeStruct((b, l_pad, 1), f32)
  scores_scratch = pltpu.VMEM((nh, lb, sb), f32)
  lse, mass = pl.pallas_call(
      functools.partial(_stats_kernel, num_key_blocks=ns, **kw),
      out_shape=(column, column), grid=(b, nl, ns),
      in_specs=[pair_spec, pair_spec, q_spec, k_spec, w_spec],
      out_specs=(column_spec, column_spec),
      scratch_shapes=[pltpu.VMEM((lb, 1), f32)] * 3 + [scores_scratch],
      compiler_params=_PARAMS,
      cost_estimate=_cost(steps, blocks, nh, di, 1, pair_block_bytes + key_block_bytes,
                          q_bytes + w_bytes + 2 * b * l_pad * 4),
      interpret=interpret, name="indexer_kl_stats")(counts, target, q, k, w)
  has_target = mass > 0
  a = jnp.where(has_target, g[..., None], 0.0)
  b_col = jnp.where(has_target, g[..., None] / jnp.where(has_target, mass, 1.0), 0.0)
  per_query = (lse, a, b_col)

  dq, dw = pl.pallas_call(
      functools.partial(_dq_kernel, num_key_blocks=ns, **kw),
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype)),
      grid=(b, nl, ns),
      in_specs=[pair_spec, pair_spec, q_spec, k_spec, w_spec] + [column_spec] * 3,
      out_specs=(q_spec, w_spec),
      scratch_shapes=[pltpu.VMEM((nh, lb, di), f32), pltpu.VMEM((lb, nh), f32), scores_scratch],
      compiler_params=_PARAMS,
      cost_estimate=_cost(steps, blocks, nh, di, 2, pair_block_bytes + key_block_bytes,
                          2 * (q_bytes + w_bytes) + 3 * b * l_pad * 4),
      interpret=interpret, name="indexer_kl_dq")(counts, target, q, k, w, *per_query)

  # (key block, query block) steps, the query blocks innermost
  def key_major(index):
    return lambda bb, j, i: (bb,) + index(i, j)

  queries = lambda i, j: blocks.first_query_block(j, i)
  query_block = lb * (nh * di * q.dtype.itemsize + nh * w.dtype.itemsize + 3 * 4)
  dk = pl.pallas_call(
      functools.partial(_dk_kernel, num_query_blocks=nl, **kw),
      out_shape=jax.ShapeDtypeStruct(k.shape, k.dtype), grid=(b, ns, nl),
      in_specs=[pl.BlockSpec((None, lb, sb), key_major(lambda i, j: (queries(i, j), j))),
                pl.BlockSpec((None, lb, sb), key_major(lambda i, j: (queries(i, j), j))),
                pl.BlockSpec((None, nh, lb, di), key_major(lambda i, j: (0, queries(i, j), 0))),
                pl.BlockSpec((None, sb, di), key_major(lambda i, j: (j, 0))),
                pl.BlockSpec((None, lb, nh), key_major(lambda i, j: (queries(i, j), 0)))]
               + [pl.BlockSpec((None, lb, 1), key_major(lambda i, j: (queries(i, j), 0)))] * 3,
      out_specs=pl.BlockSpec((None, sb, di), key_major(lambda i, j: (j, 0))),
      scratch_shapes=[pltpu.VMEM((sb, di), f32), scores_scratch],
      compiler_params=_PARAMS,
      cost_estimate=_cost(steps, blocks, nh, di, 2, pair_block_bytes + query_block, 2 * k_bytes),
      interpret=interpret, name="indexer_kl_dk")(counts, target, q, k, w, *per_query)
  return jnp.swapaxes(dq, 1, 2)[:, :l], dk[:, :s], dw[:, :l]
