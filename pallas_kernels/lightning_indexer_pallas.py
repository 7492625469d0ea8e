"""Lightning indexer scores as a Pallas TPU kernel; top-k selection stays in XLA.

Computes the same `I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s] * scale)` as
`lightning_indexer.indexer_scores_reference`, fused: one grid step takes a `[bq]` block of
queries (all J heads) and a `[bs]` block of keys, runs J `[bq, I] x [I, bs]` MXU matmuls with
fp32 accumulation, applies ReLU and the head weights on the VPU, masks causality and segments,
and writes the `[bq, bs]` fp32 tile once. Key blocks entirely after a query block's last
position are skipped (written -inf without compute), and their index map is clamped so the
skipped steps re-use the last fetched key block instead of streaming unused keys from HBM.

Why top-k is not in the kernel: an exact, deterministic (ties to the earlier position) top-2048
over 128K candidates needs either a full sort or a bitonic merge network per query row, which is
slow on the TPU's vector unit and hard to keep tie-exact across key blocks (per-block top-k
lists must be re-merged by (score, position), not by score alone). `select_topk` (a stable
sort) on the `[query_block, S]` tile is exact, has the required tie rule, and XLA already emits
a tuned sort for it. The scores tile is written once and read once, so the price of the split is
one HBM round trip of `query_block x S x 4` bytes per block; memory stays O(query_block x S).

Backends: TPU (Mosaic) compiled; interpret mode only when asked for (`interpret=True`, the CPU
tests). The GPU kernel is `lightning_indexer_triton.indexer_topk_triton`; `model.dsa_impl`
"pallas" picks by platform (`pallas_kernels.dsa_ops`).

TPU block-shape rules respected: every block's last two dims are multiples of (8, 128) or the
full array dims; q is laid out `[B, J, L, I]` so each head's `[bq, I]` slice is a clean
(sublane, lane) tile; position / segment vectors are `[B, L, 1]` and `[B, 1, S]`.

Notation (docs/design.md): B batch, L queries, S keys, J index heads, I index head dim,
T top-k; bq / bs queries / keys per block, nq query blocks.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.blocking import default_query_block, map_query_blocks, pad_axis, round_up
from pallas_kernels.lightning_indexer import check_indexer_inputs, select_topk

_NT = (((1,), (1,)), ((), ()))  # dot_general: contract the last dims of both ([m,k] x [n,k])


def _scores_kernel(max_pos_ref, q_ref, k_ref, w_ref, q_pos_ref, q_seg_ref, k_seg_ref, o_ref, *,
                   scale, num_heads, num_q_blocks):
  """One `[bq, bs]` score tile. Refs: q `[J, bq, I]`, k `[bs, I]`, w `[bq, J]`, q_pos and
  q_seg `[bq, 1]`, k_seg `[1, bs]`, out `[bq, bs]` fp32; max_pos (SMEM) `[B * nq]`."""
  b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_s = k_ref.shape[0]
  first_key = j * block_s
  needed = first_key <= max_pos_ref[b * num_q_blocks + i]

  @pl.when(needed)
  def _():
    k_SI = k_ref[...]
    w_LJ = w_ref[...].astype(jnp.float32)
    acc_LS = jnp.zeros(o_ref.shape, jnp.float32)
    for h in range(num_heads):  # static: J small matmuls, each [bq, I] x [bs, I]^T
      s_LS = jax.lax.dot_general(q_ref[h], k_SI, _NT, preferred_element_type=jnp.float32)
      acc_LS = acc_LS + w_LJ[:, h:h + 1] * jnp.maximum(s_LS * scale, 0.0)
    keys_1S = first_key + jax.lax.broadcasted_iota(jnp.int32, (1, block_s), 1)
    visible_LS = (keys_1S <= q_pos_ref[...]) & (q_seg_ref[...] == k_seg_ref[...])
    o_ref[...] = jnp.where(visible_LS, acc_LS, -jnp.inf)

  @pl.when(jnp.logical_not(needed))
  def _():
    o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, jnp.float32)


def _tile_sizes(length, num_keys, block_q, block_s):
  """(bq, padded L, bs, padded S): a block equal to the whole (8-aligned) axis, or the given
  block (multiple of 8 / 128 on TPU) with the axis padded to a multiple of it."""
  bq = round_up(length, 8) if length <= block_q else block_q
  bs = num_keys if num_keys <= block_s else block_s
  return bq, round_up(length, bq), bs, round_up(num_keys, bs)


def indexer_scores_pallas(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL, k_seg_BS, *,
                          scale: float, block_q: int = 128, block_s: int = 512,
                          interpret: bool = False, pad_keys: bool = False):
  """Dense index scores from the Pallas kernel, fp32 `[B, L, S]` (-inf where invisible).

  Same math and arguments as `indexer_scores_reference`, any sign of `weights` and `scale`
  (package docstring, "Index contract"). `pad_keys` returns `[B, L, S']` with
  S padded to a multiple of the key block (the extra keys are invisible, -inf), sparing a copy
  when the caller only runs top-k on it. `interpret`: run the kernel in Pallas interpret mode
  (any backend) instead of compiling it for TPU.
  """
  b, l, heads, i = q_BLJI.shape
  s = k_BSI.shape[1]
  bq, lp, bs, sp = _tile_sizes(l, s, block_q, block_s)
  nq, ns = lp // bq, sp // bs

  q_BJLI = jnp.swapaxes(pad_axis(q_BLJI, 1, lp, 0), 1, 2)
  weights_BLJ = pad_axis(weights_BLJ, 1, lp, 0)
  q_pos_BL = pad_axis(q_pos_BL.astype(jnp.int32), 1, lp, -1)  # padded queries see nothing
  q_seg_BL = pad_axis(q_seg_BL.astype(jnp.int32), 1, lp, 0)
  # Padded keys sit past every real query position, so causality already hides them.
  k_BSI = pad_axis(k_BSI, 1, sp, 0)
  k_seg_BS = pad_axis(k_seg_BS.astype(jnp.int32), 1, sp, 0)
  max_pos_Bq = q_pos_BL.reshape(b, nq, bq).max(-1).reshape(-1)

  def key_block(b, i, j, max_pos_ref):
    # Steps past the query block's last position keep the last needed block resident. (lax.div,
    # not //: floor division lowers through `sign`, which needs chip info to lower.)
    return jnp.minimum(j, jax.lax.div(jnp.maximum(max_pos_ref[b * nq + i], 0), bs))

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, nq, ns),
      in_specs=[
          pl.BlockSpec((None, heads, bq, i), lambda b, i, j, mp: (b, 0, i, 0)),
          pl.BlockSpec((None, bs, k_BSI.shape[-1]),
                       lambda b, i, j, mp: (b, key_block(b, i, j, mp), 0)),
          pl.BlockSpec((None, bq, heads), lambda b, i, j, mp: (b, i, 0)),
          pl.BlockSpec((None, bq, 1), lambda b, i, j, mp: (b, i, 0)),
          pl.BlockSpec((None, bq, 1), lambda b, i, j, mp: (b, i, 0)),
          pl.BlockSpec((None, 1, bs), lambda b, i, j, mp: (b, 0, key_block(b, i, j, mp))),
      ],
      out_specs=pl.BlockSpec((None, bq, bs), lambda b, i, j, mp: (b, i, j)),
  )
  kernel = functools.partial(_scores_kernel, scale=scale, num_heads=heads, num_q_blocks=nq)
  # Every tile of the [L, S] rectangle: the tiles past a query block's last position, skipped
  # at run time by positions a static estimate cannot see (about half of a causal prefill from
  # position 0), are counted too, their FLOPs and their key reads: an overcount up to ~2x there.
  cost = pl.CostEstimate(flops=2 * b * lp * sp * heads * i + 3 * b * lp * sp * heads,
                         transcendentals=0,
                         bytes_accessed=(q_BJLI.size * q_BJLI.dtype.itemsize
                                         + nq * k_BSI.size * k_BSI.dtype.itemsize
                                         + b * lp * sp * 4))
  scores_BLS = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((b, lp, sp), jnp.float32),
      grid_spec=grid_spec,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel")),
      cost_estimate=cost,
      interpret=interpret,
      name="lightning_indexer_scores",
  )(max_pos_Bq, q_BJLI, k_BSI, weights_BLJ, q_pos_BL[..., None], q_seg_BL[..., None],
    k_seg_BS[:, None, :])
  scores_BLS = scores_BLS[:, :l]
  return scores_BLS if pad_keys else scores_BLS[:, :, :s]


def indexer_topk_pallas(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL, k_seg_BS, *, topk: int,
                        scale: float, query_block: int | None = None, block_q: int = 128,
                        block_s: int = 512, interpret: bool = False):
  """`indexer_topk_reference` with the scores from the Pallas kernel, per block of queries.

  Each block of `query_block` queries (a multiple of `block_q`; None = 512, fewer if the scores
  tile would pass 256 MiB) gets its `[query_block, S]` scores from the kernel and its top-k from
  `select_topk`, so memory is O(query_block x S) at any sequence length.
  Returns `(topk_BLT, scores_BLT)` exactly as the reference (inputs detached).
  """
  check_indexer_inputs(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL, k_seg_BS)
  b, l = q_BLJI.shape[:2]
  s = k_BSI.shape[1]
  if query_block is None:
    query_block = default_query_block(b * round_up(s, block_s) * 4, 512, 512)
  if query_block < l:
    query_block = round_up(query_block, min(block_q, query_block))
  q_BLJI, k_BSI, weights_BLJ = jax.lax.stop_gradient((q_BLJI, k_BSI, weights_BLJ))

  def one_block(q_BLJI, weights_BLJ, q_pos_BL, q_seg_BL):
    scores_BLS = indexer_scores_pallas(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL, k_seg_BS,
                                       scale=scale, block_q=block_q, block_s=block_s,
                                       interpret=interpret, pad_keys=True)
    return select_topk(scores_BLS, min(topk, s))

  return map_query_blocks(one_block, query_block, [q_BLJI, weights_BLJ, q_pos_BL, q_seg_BL],
                          [0, 0, -1, 0])
