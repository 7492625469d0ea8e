"""Sparse MLA attention (absorbed / MQA form) as Pallas TPU kernels, forward and backward.

The math, the custom VJP and the reference are in `sparse_mla.py`; this file supplies its
`forward` and `backward_block` pieces as kernels.

Forward, grid (B, L, nT) (one query token, all H heads, per step; nT blocks of `bt` slots):
  1. The query token's whole top-k row sits in SMEM; for slot block j the kernel DMAs each
     selected latent row (C + R values) from HBM into a VMEM buffer, one row per copy. Block
     j + 1 is fetched into the other half of a double buffer while block j computes.
  2. `[H, C] x [bt, C]^T + [H, R] x [bt, R]^T` on the MXU (fp32 accumulation) gives the logits;
     -1 slots are masked (their DMA reads row 0 so the buffer never holds garbage). Indices
     outside [0, S) were turned into -1 on entry (`sparse_mla.sparse_mla_custom_vjp`), so no
     DMA reads past the key rows and the backward sees the same selection.
  3. Online softmax across the nT blocks (running max m, sum l, fp32 accumulator `[H, C]`);
     the last block writes `out = acc / l` and `lse = m + log l`.
Every head of a token shares the gathered rows, so a row fetched once feeds H dot products
(the MQA form is what makes the gather affordable).

Backward, grid (B, Lq, nT) over one block of Lq queries: the same gather and logits,
`p = exp(logit - lse)`, then dq and dq_rope accumulate in their (fp32, resident) output blocks
and every slot's joined contribution `[dkv | dk_rope | 0]` `[bt, P]` (one product over 2H rows,
P = C + R padded to 128 lanes) is written out in fp32; XLA scatter-adds them into the key rows
(`sparse_mla.scatter_add_rows`), since TPUs have no atomics. Each gathered row block feeds all
five products (logits, dp, dq, dq_rope, the key rows) from VMEM.

Backends: TPU (Mosaic) compiled; interpret mode only when asked for (`interpret=True`, the CPU
tests). The gather-by-DMA design is TPU-specific: the GPU kernel is
`sparse_mla_triton.sparse_mla_triton`, and `model.dsa_impl` "pallas" picks by platform
(`pallas_kernels.dsa_ops`).

TPU block rules: `bt` is the whole (padded) slot count or a multiple of 128; the top-k row is
laid out `[B, L, 1, T]` so its blocks are `(1, bt)`; lse and delta are `[B, L, H, 1]`.

bf16 keys travel as 32-bit words: Mosaic slices VMEM only at whole sublane tiles, and a bf16
tile is 16 rows, so a one-row DMA into row i of a bf16 buffer is rejected ("offsets along tiled
dimensions must be aligned"); a 32-bit buffer takes it. `_pack_halves` stores column k and
column k + C/2 of a row in one uint32 (XLA, outside the kernel), and `_unpack_halves` rebuilds
the bf16 row in VMEM (shift / mask / bitcast, exact), so the kernel math is unchanged.

Notation (docs/design.md): B batch, L queries, S keys, H heads, C latent dim, R RoPE dim,
T top-k slots, bt slots per block, nT slot blocks, K 32-bit words per gathered row (C / 2 or R / 2
for bf16 keys, C or R for 32-bit ones).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.blocking import MASKED_LOGIT, default_query_block, pad_axis, platform
from pallas_kernels.sparse_mla import (SparseMLAKernels, check_sparse_mla_inputs, joined_width,
                                       sparse_mla_custom_vjp)

_NT = (((1,), (1,)), ((), ()))  # [m, k] x [n, k] -> [m, n]
_TN = (((0,), (0,)), ((), ()))  # [k, m] x [k, n] -> [m, n]


def _slot_blocks(t: int, block_t: int):
  """(bt, padded T): one block of every slot, or blocks of `block_t` (a multiple of 128)."""
  if t <= block_t:
    return t, t
  return block_t, -(-t // block_t) * block_t


def _pack_halves(x_BSC):
  """`[B, S, C]` bf16 -> `[B, S, K]` uint32 (low half: column k, high: column k + C/2);
  32-bit arrays pass unchanged."""
  if x_BSC.dtype.itemsize == 4:
    return x_BSC
  if x_BSC.dtype != jnp.bfloat16 or x_BSC.shape[-1] % 2:
    # `_unpack_halves` reads a word's half as the top of an f32, which is bf16's layout only
    raise ValueError(f"sparse_mla_pallas: kv / k_rope must be 32-bit, or bfloat16 with an even "
                     f"last dim, got {x_BSC.dtype} {x_BSC.shape}")
  half = x_BSC.shape[-1] // 2
  bits = jax.lax.bitcast_convert_type(x_BSC, jnp.uint16).astype(jnp.uint32)
  return bits[..., :half] | (bits[..., half:] << 16)


def _unpack_halves(words_TK, dtype):
  """Inverse of `_pack_halves` on a VMEM block: `[bt, K]` uint32 -> `[bt, 2K]` `dtype`."""
  if words_TK.dtype == dtype:
    return words_TK
  low = jax.lax.bitcast_convert_type(words_TK << 16, jnp.float32)  # bf16 bits = f32's top half
  high = jax.lax.bitcast_convert_type(words_TK & jnp.uint32(0xFFFF0000), jnp.float32)
  return jnp.concatenate([low, high], axis=1).astype(dtype)  # exact: bf16 values in f32


def _copy_rows(topk_smem, kv_hbm, k_rope_hbm, kv_buf, k_rope_buf, sems, b, block, slot, wait):
  """Starts (or waits for) the DMAs of slot block `block` into half `slot` of the buffers."""
  block_t = kv_buf.shape[1]

  def one_row(i, carry):
    row = jnp.maximum(topk_smem[0, block * block_t + i], 0)  # -1 slots read row 0, masked later
    for src, dst, sem in ((kv_hbm, kv_buf, sems.at[0, slot]),
                          (k_rope_hbm, k_rope_buf, sems.at[1, slot])):
      copy = pltpu.make_async_copy(src.at[b, pl.ds(row, 1)], dst.at[slot, pl.ds(i, 1)], sem)
      if wait:
        copy.wait()
      else:
        copy.start()
    return carry

  jax.lax.fori_loop(0, block_t, one_row, 0)


def _gathered_logits(refs, b, j, num_blocks, scale, key_dtypes):
  """Double-buffered gather of slot block j; returns (kv `[bt, C]`, k_rope `[bt, R]` in
  `key_dtypes`, masked logits `[H, bt]` fp32, valid `[1, bt]`)."""
  topk_smem, topk_ref, q_ref, q_rope_ref, kv_hbm, k_rope_hbm, kv_buf, k_rope_buf, sems = refs
  # lax.rem, not %: jnp.remainder lowers through `sign`, whose Mosaic rule needs chip info
  # (so TPU export from a CPU host fails on it).
  slot = jax.lax.rem(j, 2)
  copy = functools.partial(_copy_rows, topk_smem, kv_hbm, k_rope_hbm, kv_buf, k_rope_buf, sems, b)

  @pl.when(j == 0)
  def _():
    copy(0, 0, wait=False)

  @pl.when(j + 1 < num_blocks)
  def _():
    copy(j + 1, 1 - slot, wait=False)

  copy(j, slot, wait=True)
  kv_TC = _unpack_halves(kv_buf[slot], key_dtypes[0])
  k_rope_TR = _unpack_halves(k_rope_buf[slot], key_dtypes[1])
  logits_HT = (
      jax.lax.dot_general(q_ref[...], kv_TC, _NT, preferred_element_type=jnp.float32)
      + jax.lax.dot_general(q_rope_ref[...], k_rope_TR, _NT, preferred_element_type=jnp.float32)
  ) * scale
  valid_1T = topk_ref[...] >= 0
  return kv_TC, k_rope_TR, jnp.where(valid_1T, logits_HT, MASKED_LOGIT), valid_1T


def _forward_kernel(topk_smem, topk_ref, q_ref, q_rope_ref, kv_hbm, k_rope_hbm, out_ref, lse_ref,
                    *refs, scale, num_blocks, key_dtypes, head_probs):
  """With `head_probs`, also `probs_ref` `[1, T]` (after `lse_ref`) and the logits of every slot
  block, `logits_ref` `[nT, H, bt]` (last scratch): the indexer KL's target is
  `mean_h exp(logit - lse)`, which needs the final lse, so each block's logits stay in VMEM
  until the last block instead of a second gather-and-QK pass over the rows."""
  probs_ref, refs = (refs[0], refs[1:]) if head_probs else (None, refs)
  kv_buf, k_rope_buf, sems, m_ref, l_ref, acc_ref = refs[:6]
  logits_ref = refs[6] if head_probs else None
  b, j = pl.program_id(0), pl.program_id(2)

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, MASKED_LOGIT, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  gather = (topk_smem, topk_ref, q_ref, q_rope_ref, kv_hbm, k_rope_hbm, kv_buf, k_rope_buf, sems)
  kv_TC, _, logits_HT, valid_1T = _gathered_logits(gather, b, j, num_blocks, scale, key_dtypes)
  if head_probs:
    logits_ref[j] = logits_HT  # masked slots hold MASKED_LOGIT: probability 0 below
  m_prev_H1 = m_ref[...]
  m_next_H1 = jnp.maximum(m_prev_H1, logits_HT.max(axis=1, keepdims=True))
  alpha_H1 = jnp.exp(m_prev_H1 - m_next_H1)
  p_HT = jnp.where(valid_1T, jnp.exp(logits_HT - m_next_H1), 0.0)
  l_ref[...] = alpha_H1 * l_ref[...] + p_HT.sum(axis=1, keepdims=True)
  acc_ref[...] = alpha_H1 * acc_ref[...] + jnp.dot(p_HT.astype(kv_TC.dtype), kv_TC,
                                                   preferred_element_type=jnp.float32)
  m_ref[...] = m_next_H1

  @pl.when(j == num_blocks - 1)
  def _():
    l_H1 = l_ref[...]
    safe_l_H1 = jnp.where(l_H1 > 0, l_H1, 1.0)
    out_ref[...] = (acc_ref[...] / safe_l_H1).astype(out_ref.dtype)
    lse_H1 = m_ref[...] + jnp.log(safe_l_H1)
    lse_ref[...] = jnp.where(l_H1 > 0, lse_H1, -jnp.inf)
    if head_probs:  # a query with no valid slot: lse taken as 0, every logit masked, probs 0
      finite_lse_H1 = jnp.where(l_H1 > 0, lse_H1, 0.0)
      bt = logits_ref.shape[-1]
      for i in range(num_blocks):
        probs_ref[:, i * bt:(i + 1) * bt] = jnp.mean(
            jnp.exp(logits_ref[i] - finite_lse_H1), axis=0, keepdims=True)


def _backward_kernel(topk_smem, topk_ref, q_ref, q_rope_ref, dout_ref, lse_ref, delta_ref,
                     values_ref, kv_hbm, k_rope_hbm, dq_ref, dq_rope_ref, dkvr_ref, kv_buf,
                     k_rope_buf, sems, *, scale, num_blocks, key_dtypes):
  b, j = pl.program_id(0), pl.program_id(2)

  @pl.when(j == 0)
  def _():
    dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)
    dq_rope_ref[...] = jnp.zeros(dq_rope_ref.shape, jnp.float32)

  refs = (topk_smem, topk_ref, q_ref, q_rope_ref, kv_hbm, k_rope_hbm, kv_buf, k_rope_buf, sems)
  kv_TC, k_rope_TR, logits_HT, valid_1T = _gathered_logits(refs, b, j, num_blocks, scale,
                                                           key_dtypes)
  p_HT = jnp.where(valid_1T, jnp.exp(logits_HT - lse_ref[...]), 0.0)
  dp_HT = jax.lax.dot_general(dout_ref[...], kv_TC, _NT, preferred_element_type=jnp.float32)
  ds_HT = p_HT * (dp_HT - delta_ref[...]) * scale  # the logits' scale folded in once
  dq_ref[...] += jnp.dot(ds_HT.astype(kv_TC.dtype), kv_TC, preferred_element_type=jnp.float32)
  dq_rope_ref[...] += jnp.dot(ds_HT.astype(k_rope_TR.dtype), k_rope_TR,
                              preferred_element_type=jnp.float32)
  # [dkv | dk_rope | 0] = [p | ds]^T [[dout | 0], [q | q_rope | 0]]: one product contracting
  # 2H rows (H = 64 alone fills half of a 128-deep unit) into P = C + R padded to whole lanes,
  # written fp32 as the scatter-add takes it (a bf16 store made XLA widen it in a separate op).
  weights_GT = jnp.concatenate([p_HT, ds_HT], axis=0).astype(values_ref.dtype)
  dkvr_ref[...] = jax.lax.dot_general(weights_GT, values_ref[...], _TN,
                                      preferred_element_type=jnp.float32)


def _query_row(b, l, j):
  """Index map of a per-query block: query (b, l)'s whole block at every slot step j."""
  del j
  return (b, l, 0, 0)


def _slot_operands(kv_BSC, k_rope_BSR, topk_BLT, block_t):
  """What both kernels gather from: `(bt, t_pad, topk_BL1T, kv_words, k_rope_words)`, the
  slots per grid step and T padded to whole blocks, the top-k padded with empty (-1) slots as
  `[B, L, 1, T_pad]` int32, and kv / k_rope as words (`_pack_halves`)."""
  bt, t_pad = _slot_blocks(topk_BLT.shape[-1], block_t)
  topk_BL1T = pad_axis(topk_BLT.astype(jnp.int32), 2, t_pad, -1)[:, :, None, :]
  return bt, t_pad, topk_BL1T, _pack_halves(kv_BSC), _pack_halves(k_rope_BSR)


def _common_specs(t_pad, bt, h, c, r):
  """BlockSpecs of (topk in SMEM, topk in VMEM, q, q_rope) and the HBM-resident kv, k_rope."""
  return [
      pl.BlockSpec((None, None, 1, t_pad), _query_row, memory_space=pltpu.SMEM),
      pl.BlockSpec((None, None, 1, bt), lambda b, l, j: (b, l, 0, j)),
      pl.BlockSpec((None, None, h, c), _query_row),
      pl.BlockSpec((None, None, h, r), _query_row),
  ], [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]


def _scratch(bt, kv_words_BSK, k_rope_words_BSK):
  """Double buffers for the gathered rows, in the HBM arrays' (`_pack_halves`) word type."""
  return [pltpu.VMEM((2, bt, kv_words_BSK.shape[-1]), kv_words_BSK.dtype),
          pltpu.VMEM((2, bt, k_rope_words_BSK.shape[-1]), k_rope_words_BSK.dtype),
          pltpu.SemaphoreType.DMA((2, 2))]


def _cost_estimate(queries, t_pad, h, flops_per_head_slot, q_BLHC, q_rope_BLHR, kv_BSC,
                   k_rope_BSR, per_query, exps_per_logit=1):
  """The kernel's `pl.CostEstimate`, what `glm5_jax.planning.op_costs` prices it by.

  FLOPs: `2 x flops_per_head_slot` per (query, head, slot), the MXU products as the unit runs
  them (forward: logits C + R, values C; backward: logits C + R, dp C, dq C + R, the key rows
  2P: a `[bt, 2H] x [2H, P]` product per slot block, padding included). Bytes: what the
  kernel moves per query: each slot's key row once for all heads and products (C + R values;
  a -1 slot DMAs row 0), the top-k row twice (its SMEM and VMEM copies), q and q_rope once, and
  `per_query`'s other inputs and outputs, `(elements, dtype)` pairs. Exponentials:
  `exps_per_logit` per (query, head, slot).
  """
  (_, _, _, c), r = q_BLHC.shape, q_rope_BLHR.shape[-1]
  moved = [(t_pad * c, kv_BSC.dtype), (t_pad * r, k_rope_BSR.dtype), (2 * t_pad, jnp.int32),
           (h * c, q_BLHC.dtype), (h * r, q_rope_BLHR.dtype), *per_query]
  per_query_bytes = sum(n * jnp.dtype(dtype).itemsize for n, dtype in moved)
  return pl.CostEstimate(flops=2 * queries * t_pad * h * flops_per_head_slot,
                         transcendentals=queries * t_pad * h * exps_per_logit,
                         bytes_accessed=queries * per_query_bytes)


_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _forward(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale, *, block_t, interpret,
             head_probs=False):
  """`(out, lse)`, plus the head-mean probabilities fp32 `[B, L, T]` with `head_probs`."""
  b, l, h, c = q_BLHC.shape
  r, t = q_rope_BLHR.shape[-1], topk_BLT.shape[-1]
  bt, t_pad, topk_BL1T, kv_words, k_rope_words = _slot_operands(kv_BSC, k_rope_BSR, topk_BLT,
                                                                block_t)
  in_specs, hbm_specs = _common_specs(t_pad, bt, h, c, r)
  written = [(h * c, kv_BSC.dtype), (h, jnp.float32)] + [(t_pad, jnp.float32)] * head_probs
  cost = _cost_estimate(b * l, t_pad, h, 2 * c + r, q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR,
                        per_query=written, exps_per_logit=1 + head_probs)
  probs = [jax.ShapeDtypeStruct((b, l, 1, t_pad), jnp.float32)] * head_probs
  outs = pl.pallas_call(
      functools.partial(_forward_kernel, scale=scale, num_blocks=t_pad // bt,
                        key_dtypes=(kv_BSC.dtype, k_rope_BSR.dtype), head_probs=head_probs),
      out_shape=(jax.ShapeDtypeStruct((b, l, h, c), kv_BSC.dtype),
                 jax.ShapeDtypeStruct((b, l, h, 1), jnp.float32), *probs),
      grid=(b, l, t_pad // bt),
      in_specs=in_specs + hbm_specs,
      out_specs=(pl.BlockSpec((None, None, h, c), _query_row),
                 pl.BlockSpec((None, None, h, 1), _query_row),
                 *[pl.BlockSpec((None, None, 1, t_pad), _query_row)] * head_probs),
      scratch_shapes=_scratch(bt, kv_words, k_rope_words) + [
          pltpu.VMEM((h, 1), jnp.float32), pltpu.VMEM((h, 1), jnp.float32),
          pltpu.VMEM((h, c), jnp.float32)] + [
              pltpu.VMEM((t_pad // bt, h, bt), jnp.float32)] * head_probs,
      compiler_params=_PARAMS,
      cost_estimate=cost,
      interpret=interpret,
      name="sparse_mla_forward" + "_head_probs" * head_probs,
  )(topk_BL1T, topk_BL1T, q_BLHC, q_rope_BLHR, kv_words, k_rope_words)
  return (outs[0], outs[1][..., 0]) + tuple(p[:, :, 0, :t] for p in outs[2:])


def _backward_block(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, dout_BLHC, lse_BLH,
                    delta_BLH, scale, *, block_t, interpret):
  """`sparse_mla.sparse_mla_backward_block` as a kernel (same arguments and results)."""
  b, l, h, c = q_BLHC.shape
  r, t = q_rope_BLHR.shape[-1], topk_BLT.shape[-1]
  bt, t_pad, topk_BL1T, kv_words, k_rope_words = _slot_operands(kv_BSC, k_rope_BSR, topk_BLT,
                                                                block_t)
  in_specs, hbm_specs = _common_specs(t_pad, bt, h, c, r)
  slot = lambda b, l, j: (b, l, j, 0)
  p = joined_width(c, r)
  pad = lambda x_BLHK: pad_axis(x_BLHK.astype(q_BLHC.dtype), 3, p, 0)
  values_BLGP = jnp.concatenate(  # [[dout | 0], [q | q_rope | 0]], G = 2H rows
      [pad(dout_BLHC), pad(jnp.concatenate([q_BLHC, q_rope_BLHR.astype(q_BLHC.dtype)], -1))], 2)
  dq, dq_rope, dkvr_rows = pl.pallas_call(
      functools.partial(_backward_kernel, scale=scale, num_blocks=t_pad // bt,
                        key_dtypes=(kv_BSC.dtype, k_rope_BSR.dtype)),
      out_shape=(jax.ShapeDtypeStruct((b, l, h, c), jnp.float32),
                 jax.ShapeDtypeStruct((b, l, h, r), jnp.float32),
                 jax.ShapeDtypeStruct((b, l, t_pad, p), jnp.float32)),
      grid=(b, l, t_pad // bt),
      in_specs=in_specs + [pl.BlockSpec((None, None, h, c), _query_row),
                           pl.BlockSpec((None, None, h, 1), _query_row),
                           pl.BlockSpec((None, None, h, 1), _query_row),
                           pl.BlockSpec((None, None, 2 * h, p), _query_row)] + hbm_specs,
      out_specs=(pl.BlockSpec((None, None, h, c), _query_row),
                 pl.BlockSpec((None, None, h, r), _query_row),
                 pl.BlockSpec((None, None, bt, p), slot)),
      scratch_shapes=_scratch(bt, kv_words, k_rope_words),
      compiler_params=_PARAMS,
      cost_estimate=_cost_estimate(  # the key-row product as the MXU runs it: 2H x P per slot
          b * l, t_pad, h, (c + r) + c + (c + r) + 2 * p, q_BLHC, q_rope_BLHR, kv_BSC,
          k_rope_BSR, per_query=[(h * c, dout_BLHC.dtype), (2 * h, jnp.float32),  # dout, lse, delta
                                 (2 * h * p, q_BLHC.dtype),  # the key-row product's values
                                 (h * (c + r) + t_pad * p, jnp.float32)]),  # dq's, key rows
      interpret=interpret,
      name="sparse_mla_backward",
  )(topk_BL1T, topk_BL1T, q_BLHC, q_rope_BLHR, dout_BLHC, lse_BLH[..., None],
    delta_BLH[..., None], values_BLGP, kv_words, k_rope_words)
  return dq, dq_rope, dkvr_rows[:, :, :t]


def sparse_mla_pallas(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, *, scale: float,
                      block_t: int = 512, backward_query_block: int | None = None,
                      head_groups: int = 1, interpret: bool = False, head_probs: bool = False):
  """`sparse_mla_reference` (same arguments and results) on the Pallas kernels, differentiable.

  Same index contract (package docstring): slots outside [0, S) are empty, duplicates count
  twice (the online softmax takes one term per slot; the backward's per-slot contributions are
  scatter-added, so they accumulate).

  Args (beyond the reference's):
    block_t: slots per grid step (a multiple of 128 on TPU when smaller than T).
    backward_query_block: queries per backward kernel call, bounding the per-slot dkv
      contributions `[B, block, T, C + R]`; None: what `blocking.default_query_block` fits for
      the platform traced for (counted at 4 bytes), rounded down to a power of two.
    head_groups: as `sparse_mla_xla`'s (the backward kernel runs once per group of H / G heads).
    interpret: run the kernels in Pallas interpret mode (any backend, slow; the CPU tests)
      instead of compiling them for TPU. Never implied by the platform.
    head_probs: also return the indexer KL's target from the forward kernel (use
      `sparse_mla_pallas_with_head_probs`).
  """
  check_sparse_mla_inputs(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT)
  if backward_query_block is None:  # sized for the platform traced for, as sparse_mla_xla's
    b, t = kv_BSC.shape[0], _slot_blocks(topk_BLT.shape[-1], block_t)[1]
    fits = default_query_block(b * t * (kv_BSC.shape[-1] + k_rope_BSR.shape[-1]) * 4,
                               on_accelerator=platform() != "cpu")
    backward_query_block = 1 << (fits.bit_length() - 1)  # divides the usual sequence lengths
  kernels = SparseMLAKernels(
      forward=functools.partial(_forward, block_t=block_t, interpret=interpret,
                                head_probs=head_probs),
      backward_block=functools.partial(_backward_block, block_t=block_t, interpret=interpret),
      backward_query_block=backward_query_block, head_groups=head_groups)
  return sparse_mla_custom_vjp(kernels, q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale)


def sparse_mla_pallas_with_head_probs(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, *,
                                      scale: float, **options):
  """`sparse_mla_pallas`'s `(out_BLHC, lse_BLH)` and the indexer KL's target, fp32 `[B, L, T]`
  (`sparse_mla.sparse_mla_head_mean_probs`'s values) from the forward kernel itself: each slot
  block's logits stay in VMEM until the last block's lse (`_forward_kernel`), so the target
  costs no second gather of the rows. Detached: it carries no gradient. `options`:
  `sparse_mla_pallas`'s."""
  out_BLHC, lse_BLH, probs_BLT = sparse_mla_pallas(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR,
                                                   topk_BLT, scale=scale, head_probs=True,
                                                   **options)
  return out_BLHC, lse_BLH, jax.lax.stop_gradient(probs_BLT)
