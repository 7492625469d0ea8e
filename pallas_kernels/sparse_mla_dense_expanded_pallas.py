"""Sparse MLA over every key in the expanded form as Pallas TPU kernels: flash attention whose
keys are weighted by the selection's per-key counts.

The math is `sparse_mla_dense_expanded`'s (its module docstring): per-head queries `[N + R]`,
keys `[N + R]` and values `[V]`, each key weighted by how many of the query's slots selected it.
XLA runs that op as matrix products whose fp32 `[B, H, L, S]` logits and probabilities go
through HBM several times; by the TPU compiler's own estimate they cost more than the products
(one 744B layer's stage: 92 ms expanded, 76 ms absorbed, docs/scaling.md). These kernels keep
a block's logits in VMEM, as flash attention does:

  forward  grid (B, H / Hb, L / Lb, S / Sb), the key blocks innermost: per step Hb heads of a
           block of Lb queries against a block of Sb keys, an online softmax over the key
           blocks (running max, sum and `[Lb, V]` accumulator per head in VMEM); writes the
           output and the log-sum-exp.
  dkv      grid (B, H / Hb, S / Sb, L / Lb), the query blocks innermost: p from the lse, dp,
           ds, and the key and value gradients accumulated in VMEM over the query blocks.
  dq       grid (B, H / Hb, L / Lb, S / Sb): the same p and ds, dq accumulated over the key
           blocks. For the parts' backward (`dsa_kl_fused`) it also forms the per-copy
           probabilities summed over every head, divided by H: the indexer KL's target over
           every key (read at the slots, what `sparse_mla_dense_expanded_parts`' backward
           gives), with twice the heads over half the queries (`_dq_blocks`). Where a query
           block's fp32 `[Lb, S]` row of that sum fits `_RESIDENT_PROBS_BYTES`, the grid is
           (B, L / Lb, H / Hb, S / Sb) and the row stays in VMEM while every head block and key
           block adds to it, written once ("resident"); otherwise each head block writes its
           partial sum, `[B, H / Hb, L, S]` fp32, summed in XLA ("partials", which the doubled
           head block halves). The parts' `indexer_kl_backward` forms the indexer's gradients
           from the target with the kernels of `indexer_kl_pallas`, over every key as these are.

The counts (`key_counts`, fp32 `[B, L, S]`, one scatter in XLA) are shared by every head: a step
reads its `[Lb, Sb]` block once for its Hb heads. With `causal` (queries and keys the same
positions) a block of keys wholly after a block's last query is skipped, and its DMA too (the
block index is clamped to the last one needed, which Pallas does not fetch again).
Each kernel gives its `pl.CostEstimate` (FLOPs of the blocks it computes, bytes it moves),
which is what `glm5_jax.planning.op_costs` prices it by.

Inputs are laid out head-major (`[B, H, L, K]`) so a block's head is a leading index; the
wrapper transposes (XLA usually folds that into the projection that makes them).

Backends: TPU (Mosaic) compiled; interpret mode only when asked for (`interpret=True`, the
CPU tests). TPU block rules: Sb is a multiple of 128 (the logits' lanes), Lb of 8; the
sequence axes are padded to whole blocks (padded keys have count 0, padded queries are cut).

Notation (docs/design.md): B batch, L queries, S keys, H heads, K = N + R query / key width,
V value width, T top-k slots; Hb heads, Lb queries, Sb keys of a block.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import indexer_kl_pallas
from pallas_kernels.blocking import (MASKED_LOGIT, KernelBlocks, op_selection, pad_axis,
                                     round_up)
from pallas_kernels.sparse_mla import SparseMLAParts, backward_delta, named_residuals
from pallas_kernels.sparse_mla_dense import key_counts
from pallas_kernels.sparse_mla_dense_expanded import check_expanded_inputs

_NT = (((1,), (1,)), ((), ()))  # [m, k] x [n, k] -> [m, n]
_TN = (((0,), (0,)), ((), ()))  # [k, m] x [k, n] -> [m, n]
# A step's buffers at the default blocks (4 heads, 512 queries, 512 keys; double-buffered
# inputs and outputs, fp32 accumulators, a few fp32 [Lb, Sb] temporaries) take ~20-30 MiB,
# over Mosaic's default 16 MiB scoped limit; v5p has 64 MiB of VMEM a core, v5e / v6e 128.
VMEM_LIMIT_BYTES = 40 << 20
_PARAMS = pltpu.CompilerParams(
    dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
    vmem_limit_bytes=VMEM_LIMIT_BYTES)
# The dq kernel with the head-summed probabilities resident: its head blocks add to them too.
_RESIDENT_PARAMS = pltpu.CompilerParams(
    dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary"),
    vmem_limit_bytes=VMEM_LIMIT_BYTES)
# A query block's fp32 `[Lb, S]` row of them, double-buffered: at most 8 MiB of VMEM (the
# 744B headline: 256 queries x 4,096 keys = 4 MiB).
_RESIDENT_PROBS_BYTES = 4 << 20


def _logits(q_ref, k_ref, hh, scale, valid):
  """fp32 `[Lb, Sb]` logits of head hh of the block, `MASKED_LOGIT` at unselected keys."""
  s = jax.lax.dot_general(q_ref[hh], k_ref[hh], _NT, preferred_element_type=jnp.float32)
  return jnp.where(valid, s * scale, MASKED_LOGIT)


def _forward_kernel(counts_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, m_ref, l_ref, acc_ref, *,
                    scale, blocks, num_key_blocks):
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, MASKED_LOGIT, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(blocks.visible(i, j))
  def _():
    counts = counts_ref[...]
    valid = counts > 0
    for hh in range(blocks.hb):
      s = _logits(q_ref, k_ref, hh, scale, valid)
      m_prev = m_ref[hh]
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
      e = jnp.where(valid, jnp.exp(s - m_new), 0.0) * counts
      alpha = jnp.exp(m_prev - m_new)
      l_ref[hh] = alpha * l_ref[hh] + jnp.sum(e, axis=-1, keepdims=True)
      acc_ref[hh] = alpha * acc_ref[hh] + jax.lax.dot_general(
          e.astype(v_ref.dtype), v_ref[hh], (((1,), (0,)), ((), ())),
          preferred_element_type=jnp.float32)
      m_ref[hh] = m_new

  @pl.when(j == num_key_blocks - 1)
  def _():
    for hh in range(blocks.hb):
      total = l_ref[hh]
      safe = jnp.where(total > 0, total, 1.0)
      out_ref[hh] = (acc_ref[hh] / safe).astype(out_ref.dtype)
      lse_ref[hh] = jnp.where(total > 0, m_ref[hh] + jnp.log(safe), -jnp.inf)


def _probs(q_ref, k_ref, lse_ref, hh, scale, counts, valid):
  """`(per-copy probabilities, p = per-copy x count)`, fp32 `[Lb, Sb]`, of head hh."""
  s = _logits(q_ref, k_ref, hh, scale, valid)
  per_copy = jnp.where(valid, jnp.exp(s - lse_ref[hh]), 0.0)
  return per_copy, per_copy * counts


def _ds(p, dout_ref, v_ref, delta_ref, hh, scale):
  """`scale x p x (dp - delta)`, fp32 `[Lb, Sb]`."""
  dp = jax.lax.dot_general(dout_ref[hh], v_ref[hh], _NT, preferred_element_type=jnp.float32)
  return scale * p * (dp - delta_ref[hh])


def _dkv_kernel(counts_ref, q_ref, k_ref, v_ref, dout_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                dk_acc, dv_acc, *, scale, blocks, num_query_blocks):
  j, i = pl.program_id(2), pl.program_id(3)

  @pl.when(i == 0)
  def _():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  @pl.when(blocks.visible(i, j))
  def _():
    counts = counts_ref[...]
    valid = counts > 0
    for hh in range(blocks.hb):
      _, p = _probs(q_ref, k_ref, lse_ref, hh, scale, counts, valid)
      ds = _ds(p, dout_ref, v_ref, delta_ref, hh, scale)
      dv_acc[hh] += jax.lax.dot_general(p.astype(dout_ref.dtype), dout_ref[hh], _TN,
                                        preferred_element_type=jnp.float32)
      dk_acc[hh] += jax.lax.dot_general(ds.astype(q_ref.dtype), q_ref[hh], _TN,
                                        preferred_element_type=jnp.float32)

  @pl.when(i == num_query_blocks - 1)
  def _():
    dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_kernel(counts_ref, q_ref, k_ref, v_ref, dout_ref, lse_ref, delta_ref, dq_ref, *refs,
               scale, blocks, num_key_blocks, probs):
  """`refs`: `(probs_ref, dq_acc)` with `probs`, else `(dq_acc,)`. `probs`: None, "partials"
  (grid (B, H / Hb, L / Lb, S / Sb); each step writes its `[Lb, Sb]` block of its head block's
  partial) or "resident" (grid (B, L / Lb, H / Hb, S / Sb); the query block's `[Lb, S]` row of
  the sum over every head stays in VMEM while its head and key blocks add to it)."""
  probs_ref, dq_acc = refs if probs else (None, *refs)
  if probs == "resident":
    i, g, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  else:
    i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _():
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

  if probs == "resident":
    @pl.when((g == 0) & (j == 0))  # skipped key blocks keep these zeros
    def _():
      probs_ref[...] = jnp.zeros(probs_ref.shape, jnp.float32)

  @pl.when(blocks.visible(i, j))
  def _():
    counts = counts_ref[...]
    valid = counts > 0
    head_sum = jnp.zeros(counts.shape, jnp.float32)
    for hh in range(blocks.hb):
      per_copy, p = _probs(q_ref, k_ref, lse_ref, hh, scale, counts, valid)
      ds = _ds(p, dout_ref, v_ref, delta_ref, hh, scale)
      dq_acc[hh] += jax.lax.dot_general(ds.astype(k_ref.dtype), k_ref[hh],
                                        (((1,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32)
      head_sum = head_sum + per_copy
    if probs == "resident":
      columns = pl.ds(pl.multiple_of(j * blocks.sb, blocks.sb), blocks.sb)
      probs_ref[:, columns] += head_sum
    elif probs:
      probs_ref[...] = head_sum

  if probs == "partials":
    @pl.when(jnp.logical_not(blocks.visible(i, j)))
    def _():
      probs_ref[...] = jnp.zeros(probs_ref.shape, jnp.float32)

  @pl.when(j == num_key_blocks - 1)
  def _():
    dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)


def _heads_inside(spec):
  """`spec` (indexed by grid (b, g, i, j)) for the grid (b, i, g, j)."""
  return pl.BlockSpec(spec.block_shape, lambda b, i, g, j: spec.index_map(b, g, i, j))


def _head_major(x_BXHY, x_pad: int):
  """`[B, H, X_pad, Y]`: heads before the sequence axis, padded with zeros to `x_pad`."""
  return pad_axis(jnp.swapaxes(x_BXHY, 1, 2), 2, x_pad, 0)


def _specs(blocks, k, v, query_index, key_index):
  """BlockSpecs of (counts, q, k, v) for a grid whose last two axes are (a, c): `query_index`
  / `key_index` map them to the query and key block."""
  hb, lb, sb = blocks.hb, blocks.lb, blocks.sb
  return [
      pl.BlockSpec((None, lb, sb), lambda b, g, a, c: (b, query_index(a, c), key_index(a, c))),
      pl.BlockSpec((None, hb, lb, k), lambda b, g, a, c: (b, g, query_index(a, c), 0)),
      pl.BlockSpec((None, hb, sb, k), lambda b, g, a, c: (b, g, key_index(a, c), 0)),
      pl.BlockSpec((None, hb, sb, v), lambda b, g, a, c: (b, g, key_index(a, c), 0))]


def _per_query_spec(blocks, width, query_index):
  return pl.BlockSpec((None, blocks.hb, blocks.lb, width),
                      lambda b, g, a, c: (b, g, query_index(a, c), 0))


def _cost(blocks, ops, flops_per_pair_head, per_step, once):
  """`pl.CostEstimate`: 2 x `flops_per_pair_head` per (query, key, head) of the steps that
  compute, one exponential per such triple; bytes: `per_step` (elements, dtype) pairs that each
  computing step of a head block fetches (the blocks that change between steps; a skipped
  step fetches nothing), and `once` bytes read or written once (the resident blocks)."""
  steps = blocks.computed(ops.l_pad, ops.s_pad) * ops.b * (ops.h // blocks.hb)
  pairs = steps * blocks.hb * blocks.lb * blocks.sb
  step_bytes = sum(n * jnp.dtype(dtype).itemsize for n, dtype in per_step)
  return pl.CostEstimate(flops=2 * pairs * flops_per_pair_head, transcendentals=pairs,
                         bytes_accessed=int(steps * step_bytes + once))


def _itemsize(x):
  return jnp.dtype(x.dtype).itemsize


class _Operands:
  """The kernels' operands: counts and head-major, padded q / k / v, and the sizes."""

  def __init__(self, blocks, q_BLHK, k_BSHK, v_BSHV, topk_BLT):
    (self.b, self.l, self.h, self.k), self.s = q_BLHK.shape, k_BSHK.shape[1]
    self.v = v_BSHV.shape[-1]
    self.l_pad, self.s_pad = round_up(self.l, blocks.lb), round_up(self.s, blocks.sb)
    counts_BLS = key_counts(topk_BLT, self.s)
    self.counts = pad_axis(pad_axis(counts_BLS, 1, self.l_pad, 0.0), 2, self.s_pad, 0.0)
    self.q = _head_major(q_BLHK, self.l_pad)
    self.kk = _head_major(k_BSHK, self.s_pad)
    self.vv = _head_major(v_BSHV, self.s_pad)

  def grid(self, blocks, last_two):
    return (self.b, self.h // blocks.hb) + last_two


def _forward(blocks, scale, interpret, q_BLHK, k_BSHK, v_BSHV, topk_BLT):
  """`(out_BLHV, lse_BLH)`."""
  ops = _Operands(blocks, q_BLHK, k_BSHK, v_BSHV, topk_BLT)
  nl, ns = ops.l_pad // blocks.lb, ops.s_pad // blocks.sb
  queries = lambda i, j: i
  keys = blocks.last_key_block
  f32, hb, lb, sb = jnp.float32, blocks.hb, blocks.lb, blocks.sb
  cost = _cost(blocks, ops, ops.k + ops.v,
               per_step=[(lb * sb, f32), (hb * sb * ops.k, k_BSHK.dtype),
                         (hb * sb * ops.v, v_BSHV.dtype)],
               once=ops.b * ops.h * ops.l_pad * (ops.k * _itemsize(ops.q)
                                                 + ops.v * _itemsize(v_BSHV) + 4))
  out, lse = pl.pallas_call(
      functools.partial(_forward_kernel, scale=scale, blocks=blocks, num_key_blocks=ns),
      out_shape=(jax.ShapeDtypeStruct((ops.b, ops.h, ops.l_pad, ops.v), v_BSHV.dtype),
                 jax.ShapeDtypeStruct((ops.b, ops.h, ops.l_pad, 1), jnp.float32)),
      grid=ops.grid(blocks, (nl, ns)),
      in_specs=_specs(blocks, ops.k, ops.v, queries, keys),
      out_specs=(_per_query_spec(blocks, ops.v, queries), _per_query_spec(blocks, 1, queries)),
      scratch_shapes=[pltpu.VMEM((blocks.hb, blocks.lb, 1), jnp.float32),
                      pltpu.VMEM((blocks.hb, blocks.lb, 1), jnp.float32),
                      pltpu.VMEM((blocks.hb, blocks.lb, ops.v), jnp.float32)],
      compiler_params=_PARAMS,
      cost_estimate=cost,
      interpret=interpret,
      name="sparse_mla_dense_expanded_forward",
  )(ops.counts, ops.q, ops.kk, ops.vv)
  return (jnp.swapaxes(out[:, :, :ops.l], 1, 2), jnp.swapaxes(lse[:, :, :ops.l, 0], 1, 2))


def _backward(blocks, scale, interpret, target, q_BLHK, k_BSHK, v_BSHV, topk_BLT, out_BLHV,
              lse_BLH, dout_BLHV, dlse_BLH):
  """`(dq_BLHK, dk_BSHK, dv_BSHV, target or None)`: the gradients and the indexer KL's target,
  `target` None (none), "slots" (fp32 `[B, L, T]`: each slot's head-mean probability, 0 at empty
  slots) or "keys" (fp32 `[B, L, S]`: the head-mean probability of one copy of each key, for
  `indexer_kl_grads_pallas`)."""
  if target not in (None, "slots", "keys"):
    raise ValueError(f"target={target!r}: expected None, 'slots' or 'keys'")
  with_target = target is not None
  ops = _Operands(blocks, q_BLHK, k_BSHK, v_BSHV, topk_BLT)
  nl, ns = ops.l_pad // blocks.lb, ops.s_pad // blocks.sb
  # The barrier keeps XLA from fusing delta's reduction into the producer of dout (the
  # output projection's input gradient): fused, the TPU compiler prices that matmul 5.40 ms
  # where the matmul and the reduction apart cost 4.70 ms (744B layer, one v5p chip).
  dout_BLHV = jax.lax.optimization_barrier(dout_BLHV)
  delta_BLH = backward_delta(dout_BLHV, out_BLHV, dlse_BLH)
  dout = _head_major(dout_BLHV.astype(q_BLHK.dtype), ops.l_pad)
  # lse of a padded (or empty) query: 0 (its counts are 0, so nothing reads it)
  per_query = [_head_major(jnp.where(jnp.isfinite(x), x, 0.0)[..., None], ops.l_pad)
               for x in (lse_BLH, delta_BLH)]
  f32, hb, lb, sb, dtype = jnp.float32, blocks.hb, blocks.lb, blocks.sb, q_BLHK.dtype
  queries_bytes = ops.b * ops.h * ops.l_pad * ((ops.k + ops.v) * _itemsize(ops.q) + 8)
  keys_bytes = ops.b * ops.h * ops.s_pad * (ops.k + ops.v) * _itemsize(ops.kk)
  query_block = [(hb * lb * (ops.k + ops.v), dtype), (2 * hb * lb, f32)]  # q, dout, lse, delta

  # dk, dv: key blocks outer, query blocks inner (the accumulation axis)
  kv_queries = lambda j, i: blocks.first_query_block(j, i)
  kv_keys = lambda j, i: j
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, scale=scale, blocks=blocks, num_query_blocks=nl),
      out_shape=(jax.ShapeDtypeStruct(ops.kk.shape, k_BSHK.dtype),
                 jax.ShapeDtypeStruct(ops.vv.shape, v_BSHV.dtype)),
      grid=ops.grid(blocks, (ns, nl)),
      in_specs=_specs(blocks, ops.k, ops.v, kv_queries, kv_keys) + [
          _per_query_spec(blocks, ops.v, kv_queries), _per_query_spec(blocks, 1, kv_queries),
          _per_query_spec(blocks, 1, kv_queries)],
      out_specs=(pl.BlockSpec((None, blocks.hb, blocks.sb, ops.k),
                              lambda b, g, j, i: (b, g, j, 0)),
                 pl.BlockSpec((None, blocks.hb, blocks.sb, ops.v),
                              lambda b, g, j, i: (b, g, j, 0))),
      scratch_shapes=[pltpu.VMEM((blocks.hb, blocks.sb, ops.k), jnp.float32),
                      pltpu.VMEM((blocks.hb, blocks.sb, ops.v), jnp.float32)],
      compiler_params=_PARAMS,
      cost_estimate=_cost(blocks, ops, 2 * (ops.k + ops.v),  # logits, dp, dv, dk
                          per_step=[(lb * sb, f32)] + query_block, once=2 * keys_bytes),
      interpret=interpret,
      name="sparse_mla_dense_expanded_dkv",
  )(ops.counts, ops.q, ops.kk, ops.vv, dout, *per_query)

  # dq and the head-summed probabilities: query blocks outer, key blocks inner; twice the
  # heads over half the queries (`_dq_blocks`). The sum over heads stays in VMEM where a query
  # block's row of it fits (`_RESIDENT_PROBS_BYTES`), else each head block writes a partial.
  qb = _dq_blocks(blocks, ops.h) if with_target else blocks
  probs = None if not with_target else (
      "resident" if qb.lb * ops.s_pad * 4 <= _RESIDENT_PROBS_BYTES else "partials")
  dq_queries = lambda i, j: i
  dq_in_specs = _specs(qb, ops.k, ops.v, dq_queries, qb.last_key_block) + [
      _per_query_spec(qb, ops.v, dq_queries), _per_query_spec(qb, 1, dq_queries),
      _per_query_spec(qb, 1, dq_queries)]
  dq_out_specs = [_per_query_spec(qb, ops.k, dq_queries)]
  if probs == "resident":
    probs_shape = (ops.b, ops.l_pad, ops.s_pad)
    # grid (B, L / Lb, H / Hb, S / Sb): the specs above index (b, g, i, j)
    dq_in_specs = [_heads_inside(spec) for spec in dq_in_specs]
    dq_out_specs = [_heads_inside(spec) for spec in dq_out_specs]
    dq_out_specs.append(pl.BlockSpec((None, qb.lb, ops.s_pad), lambda b, i, g, j: (b, i, 0)))
    grid = (ops.b, ops.l_pad // qb.lb, ops.h // qb.hb, ns)
    params = _RESIDENT_PARAMS
  else:
    probs_shape = (ops.b, ops.h // qb.hb, ops.l_pad, ops.s_pad)
    if probs:
      dq_out_specs.append(pl.BlockSpec((None, None, qb.lb, qb.sb),
                                       lambda b, g, i, j: (b, g, i, j)))
    grid = ops.grid(qb, (ops.l_pad // qb.lb, ns))
    params = _PARAMS
  dq, *probs_out = pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, blocks=qb, num_key_blocks=ns, probs=probs),
      out_shape=(jax.ShapeDtypeStruct(ops.q.shape, q_BLHK.dtype),
                 *[jax.ShapeDtypeStruct(probs_shape, jnp.float32)] * with_target),
      grid=grid,
      in_specs=dq_in_specs,
      out_specs=tuple(dq_out_specs),
      scratch_shapes=[pltpu.VMEM((qb.hb, qb.lb, ops.k), jnp.float32)],
      compiler_params=params,
      cost_estimate=_cost(qb, ops, 2 * ops.k + ops.v,  # logits, dp, dq
                          per_step=[(qb.lb * sb, f32), (qb.hb * sb * (ops.k + ops.v), dtype)],
                          once=queries_bytes + ops.q.size * _itemsize(ops.q)  # + dq
                          + with_target * 4 * math.prod(probs_shape)),  # the probabilities
      interpret=interpret,
      name="sparse_mla_dense_expanded_dq",
  )(ops.counts, ops.q, ops.kk, ops.vv, dout, *per_query)

  if with_target:
    summed = probs_out[0] if probs == "resident" else probs_out[0].sum(axis=1)
    head_mean_BLS = summed[:, :ops.l, :ops.s] / ops.h
    if target == "slots":
      picked = jnp.take_along_axis(head_mean_BLS, jnp.maximum(topk_BLT, 0), axis=-1)
      head_mean_BLS = jnp.where(topk_BLT >= 0, picked, 0.0)
  unpad = lambda x, n: jnp.swapaxes(x[:, :, :n], 1, 2)
  return (unpad(dq, ops.l), unpad(dk, ops.s), unpad(dv, ops.s),
          head_mean_BLS if with_target else None)


def _dq_blocks(blocks: KernelBlocks, h: int) -> KernelBlocks:
  """The dq kernel's blocks when it forms the KL target: twice the heads over half the queries
  where they divide (the same VMEM). Half the queries halve the resident row of the head-summed
  probabilities (`[Lb, S]` fp32: 4 MiB at the 744B headline); where it is written as partials
  instead, `[B, H / Hb, L, S]`, twice the heads halve their number."""
  if h % (2 * blocks.hb) or blocks.lb % 16:
    return blocks
  return blocks._replace(hb=2 * blocks.hb, lb=blocks.lb // 2)


def _prepared(q_BLHK, k_BSHK, v_BSHV, topk_BLT, causal, head_block, block_q, block_k):
  """`(blocks, topk_BLT)`: inputs checked, the selection emptied where it must be."""
  check_expanded_inputs(q_BLHK, k_BSHK, v_BSHV, topk_BLT)
  (_, l, h, _), s = q_BLHK.shape, k_BSHK.shape[1]
  topk_BLT = op_selection(topk_BLT, q_BLHK, k_BSHK, causal, "sparse_mla_dense_expanded_pallas")
  if head_block < 1 or h % head_block:
    raise ValueError(f"head_block={head_block} must be >= 1 and divide the {h} heads of q "
                     f"{q_BLHK.shape} [B, L, H, K]")
  if block_q % 8 or block_k % 128:
    raise ValueError(f"block_q={block_q} must be a multiple of 8 and block_k={block_k} of 128 "
                     "(TPU tiles)")
  blocks = KernelBlocks(head_block, min(block_q, round_up(l, 8)),
                        min(block_k, round_up(s, 128)), causal)
  return blocks, topk_BLT


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attend(blocks, scale, interpret, q_BLHK, k_BSHK, v_BSHV, topk_BLT):
  return _forward(blocks, scale, interpret, q_BLHK, k_BSHK, v_BSHV, topk_BLT)


def _attend_forward(blocks, scale, interpret, q_BLHK, k_BSHK, v_BSHV, topk_BLT):
  out_BLHV, lse_BLH = named_residuals(*_forward(blocks, scale, interpret, q_BLHK, k_BSHK,
                                                v_BSHV, topk_BLT))
  return (out_BLHV, lse_BLH), (q_BLHK, k_BSHK, v_BSHV, topk_BLT, out_BLHV, lse_BLH)


def _attend_backward(blocks, scale, interpret, residuals, cotangents):
  dq, dk, dv, _ = _backward(blocks, scale, interpret, None, *residuals, *cotangents)
  return dq, dk, dv, None


_attend.defvjp(_attend_forward, _attend_backward)

# 4 heads of 512 queries against 512 keys a step: a step's products are 512 x 256 x 512 (the
# matrix unit's tiles whole), the block's q / k / v / dout (bf16), fp32 accumulators and a
# head's fp32 [Lb, Sb] temporaries fit `VMEM_LIMIT_BYTES` with double buffering.
HEAD_BLOCK, BLOCK_Q, BLOCK_K = 4, 512, 512


def sparse_mla_dense_expanded_pallas(q_BLHK, k_BSHK, v_BSHV, topk_BLT, *, scale: float,
                                     causal: bool = False, head_block: int = HEAD_BLOCK,
                                     block_q: int = BLOCK_Q, block_k: int = BLOCK_K,
                                     interpret: bool = False):
  """`sparse_mla_dense_expanded` as Pallas TPU kernels (module docstring): same arguments and
  results; forward and backward (custom VJP). `head_block`, `block_q`, `block_k`: a step's
  heads, queries and keys (the latter two clipped to the padded sequence);
  `interpret`: run the kernels in interpret mode (any backend)."""
  blocks, topk_BLT = _prepared(q_BLHK, k_BSHK, v_BSHV, topk_BLT, causal, head_block, block_q,
                               block_k)
  return _attend(blocks, float(scale), interpret, q_BLHK, k_BSHK, v_BSHV, topk_BLT)


def sparse_mla_dense_expanded_pallas_parts(*, causal: bool = False,
                                           head_block: int = HEAD_BLOCK,
                                           block_q: int = BLOCK_Q, block_k: int = BLOCK_K,
                                           kl_block_q: int = indexer_kl_pallas.BLOCK_Q,
                                           kl_block_k: int = indexer_kl_pallas.BLOCK_K,
                                           interpret: bool = False) -> SparseMLAParts:
  """`sparse_mla_dense_expanded_parts` on these kernels, the indexer KL's too: the backward's
  target over every key (`SparseMLAParts.indexer_kl_backward`), the head mean of the dq
  kernel's probabilities, which `indexer_kl_pallas.indexer_kl_grads_pallas` (`kl_block_q` queries
  and `kl_block_k` keys a step) turns into the indexer's gradients; the forward's (an eval step)
  at the slots."""

  def prepared(q_BLHK, k_BSHK, v_BSHV, topk_BLT):
    return _prepared(q_BLHK, k_BSHK, v_BSHV, topk_BLT, causal, head_block, block_q, block_k)

  def forward(q_BLHK, k_BSHK, v_BSHV, topk_BLT, scale, head_probs=False):
    blocks, topk_BLT = prepared(q_BLHK, k_BSHK, v_BSHV, topk_BLT)
    out_BLHV, lse_BLH = _forward(blocks, scale, interpret, q_BLHK, k_BSHK, v_BSHV, topk_BLT)
    if not head_probs:
      return out_BLHV, lse_BLH
    # forward only (an eval step): the target from the backward kernels' probabilities
    zeros = jnp.zeros_like(out_BLHV)
    *_, target_BLT = _backward(blocks, scale, interpret, "slots", q_BLHK, k_BSHK, v_BSHV,
                               topk_BLT, out_BLHV, lse_BLH, zeros, jnp.zeros_like(lse_BLH))
    return out_BLHV, lse_BLH, target_BLT

  def backward(q_BLHK, k_BSHK, v_BSHV, topk_BLT, out_BLHV, lse_BLH, dout_BLHV, dlse_BLH, scale):
    blocks, topk_BLT = prepared(q_BLHK, k_BSHK, v_BSHV, topk_BLT)
    return _backward(blocks, scale, interpret, "keys", q_BLHK, k_BSHK, v_BSHV, topk_BLT,
                     out_BLHV, lse_BLH, dout_BLHV, dlse_BLH)

  def indexer_kl_backward(index_q_BLJI, index_k_BSI, index_w_BLJ, topk_BLT, target_BLS, dkl_BL,
                          index_scale):
    return indexer_kl_pallas.indexer_kl_grads_pallas(
        index_q_BLJI, index_k_BSI, index_w_BLJ, topk_BLT, target_BLS, dkl_BL,
        scale=index_scale, causal=causal, block_q=kl_block_q, block_k=kl_block_k,
        interpret=interpret)

  return SparseMLAParts(forward, backward, indexer_kl_backward)
