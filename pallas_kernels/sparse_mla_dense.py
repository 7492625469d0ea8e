"""Sparse MLA over every key, the selection as per-key counts (`model.dsa_attention_keys`).

The math is `sparse_mla`'s module docstring (forward, lse, the custom-VJP backward, the index
contract); this path computes it without gathering a row. Per block of Lb queries it forms the
logits of **all** S keys in one `[Lb x H, K] x [K, S]` product and weights each key by how many
of the query's slots selected it:

  count[t, s] = #{j : topk[t, j] = s}        (0 for unselected keys; 2 for a row selected twice)
  p[t, h, s]  = count[t, s] exp(logit[t, h, s] - lse[t, h])

which is the sparse softmax term for term (a duplicate row is two equal terms, empty slots none).
The backward is flash attention's with those weights: `dkv = p^T dout + scale ds^T q` is a
product over the block's Lb x H rows into a dense `[S, K]` accumulator, so there is no per-slot
contribution to write and no scatter-add (TPUs have no atomics: the gather paths write
`[Lb, T, K]` per block and XLA scatter-adds it, ~1.3 s of HBM traffic in the 744B step).

It does O(L x S) work where the gather paths do O(L x T), at the matrix unit's speed instead of
the gather's: worth it when S is a small multiple of T. With `causal=True` (queries and keys the
same positions) a slot that selects a key after its query is empty, and the queries are split
into `key_ranges` runs of whole blocks, each forming only the keys up to its last query (a
a loop over its blocks; 8 runs by default, `CAUSAL_KEY_RANGES`). At the 744B headline's
4,096 tokens, top-2,048 and 128-query blocks a query then forms 2,304 keys' logits on average,
about as many as its 2,048 slots, so the dense form computes little the gather paths do not
(one layer's stage by the TPU compiler's own cost model: docs/scaling.md, "The sparse stage over
every key").

Per block the temporaries are fp32 `[Lb, H, S']` logits / probabilities (S' the run's keys), so
blocks are sized for them (`_block_size`). `head_groups` as `sparse_mla_xla`'s: the key-row
gradient is accumulated per group of H / G heads and summed over the groups once, at the end.

Notation (docs/design.md): B batch, L queries, Lb queries per block, S keys (latent rows), H
heads, C latent dim, R RoPE dim, K = C + R, T top-k slots.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.blocking import (CAUSAL_KEY_RANGES, MASKED_LOGIT, causal_key_ranges,
                                     default_query_block, op_selection, pad_axis, platform,
                                     query_block_size, round_up, rows_per_device, varying_like)
from pallas_kernels.sparse_mla import (SparseMLAParts, backward_delta,
                                      check_sparse_mla_inputs, named_residuals)


def key_counts(topk_BLT, num_keys: int):
  """fp32 `[B, L, S]`: how many slots of each query selected each key (-1 slots none)."""
  b, l, _ = topk_BLT.shape
  if b * l * num_keys >= 2 ** 31:  # flat indices would overflow int32: (b, l, s) triples
    safe_BLT = jnp.where(topk_BLT < 0, num_keys, topk_BLT)  # out of range: dropped
    count = lambda idx_T: jnp.zeros((num_keys,), jnp.float32).at[idx_T].add(1.0, mode="drop")
    return jax.vmap(jax.vmap(count))(safe_BLT)
  # One scatter into the flat `[B L S]` counts by each slot's flat index (a slot outside [0, S)
  # to one past the end: dropped), not a batched scatter of (b, l, s) triples: the TPU compiler
  # formed, bounds-checked and flattened those triples in passes of their own over `[B, L, T]`.
  rows_BL1 = (jnp.arange(b * l, dtype=jnp.int32) * num_keys).reshape(b, l, 1)
  inside_BLT = (topk_BLT >= 0) & (topk_BLT < num_keys)
  flat_BLT = jnp.where(inside_BLT, rows_BL1 + topk_BLT, b * l * num_keys)
  counts = jnp.zeros((b * l * num_keys,), jnp.float32).at[flat_BLT.reshape(-1)].add(
      1.0, mode="drop")
  return counts.reshape(b, l, num_keys)


def _block_size(b: int, s: int, heads: int) -> int:
  """Queries per block: four fp32 `[H, S]` arrays a query (logits, p, dp, ds) and its counts."""
  fits = default_query_block(b * s * (4 * heads + 1) * 4, on_accelerator=platform() != "cpu")
  return 1 << (fits.bit_length() - 1)


def _masked_logits(scale, qr_BLHK, kvr_BSK, counts_BLS):
  """fp32 `[B, Lb, H, S]` logits of every key given, `MASKED_LOGIT` at the unselected ones,
  and `[B, Lb, 1, S]` whether each key is selected."""
  logits_BLHS = jnp.einsum("blhk,bsk->blhs", qr_BLHK, kvr_BSK,
                           preferred_element_type=jnp.float32) * scale
  valid_BL1S = (counts_BLS > 0)[:, :, None, :]
  return jnp.where(valid_BL1S, logits_BLHS, MASKED_LOGIT), valid_BL1S


def _forward_block(c, scale, with_target, qr_BLHK, kvr_BSK, counts_BLS):
  """One block's `(out_BLHC, lse_BLH, target_BLS or None)` over the keys given."""
  s_BLHS, valid_BL1S = _masked_logits(scale, qr_BLHK, kvr_BSK, counts_BLS)
  m_BLH1 = jnp.max(s_BLHS, axis=-1, keepdims=True)
  e_BLHS = jnp.where(valid_BL1S, jnp.exp(s_BLHS - m_BLH1), 0.0)  # one copy of each key
  l_BLH1 = jnp.sum(e_BLHS * counts_BLS[:, :, None, :], axis=-1, keepdims=True)
  safe_l_BLH1 = jnp.where(l_BLH1 > 0, l_BLH1, 1.0)
  lse_BLH = jnp.where(l_BLH1 > 0, m_BLH1 + jnp.log(safe_l_BLH1), -jnp.inf)[..., 0]
  per_copy_BLHS = e_BLHS / safe_l_BLH1
  p_BLHS = (per_copy_BLHS * counts_BLS[:, :, None, :]).astype(kvr_BSK.dtype)
  out_BLHC = jnp.einsum("blhs,bsc->blhc", p_BLHS, kvr_BSK[..., :c],
                        preferred_element_type=jnp.float32).astype(kvr_BSK.dtype)
  return out_BLHC, lse_BLH, (per_copy_BLHS.mean(axis=2) if with_target else None)


def _at_slots(probs_BLS, topk_BLT):
  """fp32 `[B, Lb, T]`: `probs_BLS` at each slot's key, 0 at empty slots and keys past the
  ones given."""
  keys = probs_BLS.shape[-1]
  picked = jnp.take_along_axis(probs_BLS, jnp.clip(topk_BLT, 0, keys - 1), axis=-1)
  return jnp.where((topk_BLT >= 0) & (topk_BLT < keys), picked, 0.0)


def _backward_block(c, scale, groups, with_target, qr_BLHK, kvr_BSK, topk_BLT, counts_BLS,
                    dout_BLHC, lse_BLH, delta_BLH):
  """One block's `(dqr_BLHK, dkvr_BSGK, target_BLT or None)`, fp32: the query gradients, the
  key-row gradients of each group of H / G heads, over the keys given, and (`with_target`) the
  head-mean probability of one copy of each slot's key, from the p the gradients form anyway."""
  dtype = kvr_BSK.dtype
  (b, lb, h, k), c_pad = qr_BLHK.shape, qr_BLHK.shape[-1] - c
  s_BLHS, valid_BL1S = _masked_logits(scale, qr_BLHK, kvr_BSK, counts_BLS)
  per_copy_BLHS = jnp.where(valid_BL1S, jnp.exp(s_BLHS - lse_BLH[..., None]), 0.0)
  target_BLT = _at_slots(per_copy_BLHS.mean(axis=2), topk_BLT) if with_target else None
  p_BLHS = per_copy_BLHS * counts_BLS[:, :, None, :]
  dout_BLHC = dout_BLHC.astype(dtype)
  dp_BLHS = jnp.einsum("blhc,bsc->blhs", dout_BLHC, kvr_BSK[..., :c],
                       preferred_element_type=jnp.float32)
  scaled_ds_BLHS = (scale * p_BLHS * (dp_BLHS - delta_BLH[..., None])).astype(dtype)
  dqr_BLHK = jnp.einsum("blhs,bsk->blhk", scaled_ds_BLHS, kvr_BSK,
                        preferred_element_type=jnp.float32)
  # dkv = p^T dout + scale ds^T q, dk_rope = scale ds^T q_rope: contractions over the block's
  # Lb x H/G rows (a full matrix unit already; the gather paths join them to fill it), the
  # value rows padded from C to K so both land in one [S, K] row.
  grouped = lambda x: x.reshape(b, lb, groups, h // groups, x.shape[-1])
  dout_BLHK = jnp.pad(dout_BLHC, [(0, 0)] * 3 + [(0, c_pad)])
  dkvr_BSGK = (jnp.einsum("blghs,blghk->bsgk", grouped(p_BLHS.astype(dtype)), grouped(dout_BLHK),
                          preferred_element_type=jnp.float32)
               + jnp.einsum("blghs,blghk->bsgk", grouped(scaled_ds_BLHS), grouped(qr_BLHK),
                            preferred_element_type=jnp.float32))
  return dqr_BLHK, dkvr_BSGK, target_BLT


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _sparse_mla(c, scale, block, ranges, with_target, groups, qr_BLHK, kvr_BSK, topk_BLT):
  del groups  # the backward's
  return _forward(c, scale, block, ranges, with_target, qr_BLHK, kvr_BSK, topk_BLT)


def _block_loop(length: int, block: int, body, carry, per_query, pad_values):
  """`fori_loop` over the blocks of `length` queries: `body(i, carry, *per_query_block)` with
  each `[B, length, ...]` array of `per_query` sliced at block i (padded at the end with its
  `pad_values` to whole blocks). Slices in place rather than `to_query_blocks`' `[n, B, Lb]`
  reshape, which the TPU compiler materialized as transposes of q, dout and the outputs."""
  padded = round_up(length, block)
  per_query = [pad_axis(x, 1, padded, v) for x, v in zip(per_query, pad_values)]

  def step(i, carry):
    sliced = [jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=1) for x in per_query]
    return body(i, carry, *sliced)

  return jax.lax.fori_loop(0, padded // block, step, carry)


def _uninitialized(shape, dtype, like):
  """An output buffer every row of which a block loop writes before it is read:
  `jax.lax.empty` (no fill on TPU and GPU), typed as `like` under `shard_map`. The tests make
  it NaN to show that no unwritten row reaches a result."""
  return varying_like(jax.lax.empty(shape, dtype), like)


def _forward(c, scale, block, ranges, with_target, qr_BLHK, kvr_BSK, topk_BLT):
  """`(out_BLHC, lse_BLH, target_BLT or None)`: per range, a loop over its query blocks
  writing into the whole outputs."""
  (b, l, h, _), t = qr_BLHK.shape, topk_BLT.shape[-1]
  padded = round_up(l, block)  # the last range's padded tail, written and cut off
  bufs = [_uninitialized((b, padded, h, c), kvr_BSK.dtype, qr_BLHK),
          _uninitialized((b, padded, h), jnp.float32, qr_BLHK)]
  if with_target:
    bufs.append(_uninitialized((b, padded, t), jnp.float32, qr_BLHK))
  for start, stop, keys in ranges:

    def body(i, bufs, qr, topk, start=start, keys=keys):
      out, lse, probs = _forward_block(c, scale, with_target, qr, kvr_BSK[:, :keys],
                                       key_counts(topk, keys))
      new = [out, lse]
      if with_target:  # the per-copy probability at each slot (empty slots 0)
        new.append(_at_slots(probs, topk))
      return tuple(jax.lax.dynamic_update_slice_in_dim(buf, x, start + i * block, axis=1)
                   for buf, x in zip(bufs, new))

    rows = slice(start, stop)
    bufs = _block_loop(stop - start, block, body, tuple(bufs),
                       [qr_BLHK[:, rows], topk_BLT[:, rows]], [0, -1])
  out_BLHC, lse_BLH, *target = (x[:, :l] for x in bufs)
  return out_BLHC, lse_BLH, (target[0] if with_target else None)


def _vjp_forward(c, scale, block, ranges, with_target, groups, qr_BLHK, kvr_BSK, topk_BLT):
  del groups  # the backward's
  out_BLHC, lse_BLH, target_BLT = _forward(c, scale, block, ranges, with_target, qr_BLHK,
                                           kvr_BSK, topk_BLT)
  out_BLHC, lse_BLH = named_residuals(out_BLHC, lse_BLH)
  return (out_BLHC, lse_BLH, target_BLT), (qr_BLHK, kvr_BSK, topk_BLT, out_BLHC, lse_BLH)


def _backward(c, scale, block, ranges, groups, with_target, qr_BLHK, kvr_BSK, topk_BLT,
              out_BLHC, lse_BLH, dout_BLHC, dlse_BLH):
  """`(dqr_BLHK, dkvr_BSK, target_BLT or None)`: per range, a loop over its query blocks
  carrying the range's key-row gradient `[B, keys, G, K]` (fp32), added into the whole
  `[B, S, G, K]` once per range; summed over the head groups once at the end. `with_target`:
  the indexer KL's target too, written block by block as the forward's is."""
  delta_BLH = backward_delta(dout_BLHC, out_BLHC, dlse_BLH)
  (b, l, _, _), (_, s, k), t = qr_BLHK.shape, kvr_BSK.shape, topk_BLT.shape[-1]
  padded = round_up(l, block)
  dkvr_BSGK = varying_like(jnp.zeros((b, s, groups, k), jnp.float32), qr_BLHK)
  bufs = [_uninitialized((b, padded) + qr_BLHK.shape[2:], qr_BLHK.dtype, qr_BLHK)]
  if with_target:
    bufs.append(_uninitialized((b, padded, t), jnp.float32, qr_BLHK))
  for start, stop, keys in ranges:
    rows = slice(start, stop)

    def body(i, carry, qr, topk, dout, lse, delta, start=start, keys=keys):
      acc_BSGK, bufs = carry
      dqr, dkvr, target = _backward_block(c, scale, groups, with_target, qr, kvr_BSK[:, :keys],
                                          topk, key_counts(topk, keys), dout, lse, delta)
      new = [dqr.astype(qr_BLHK.dtype)] + ([target] if with_target else [])
      return acc_BSGK + dkvr, tuple(
          jax.lax.dynamic_update_slice_in_dim(buf, x, start + i * block, axis=1)
          for buf, x in zip(bufs, new))

    acc = varying_like(jnp.zeros((b, keys, groups, k), jnp.float32), qr_BLHK)
    acc_BSGK, bufs = _block_loop(
        stop - start, block, body, (acc, tuple(bufs)),
        [x[:, rows] for x in (qr_BLHK, topk_BLT, dout_BLHC, lse_BLH, delta_BLH)],
        [0, -1, 0, 0.0, 0.0])
    dkvr_BSGK = dkvr_BSGK.at[:, :keys].add(acc_BSGK)
  dqr_BLHK, *target = (x[:, :l] for x in bufs)
  # The one sum over the head groups (heads split over a mesh axis: one all-reduce).
  return (dqr_BLHK, dkvr_BSGK.sum(2).astype(kvr_BSK.dtype),
          target[0] if with_target else None)


def _vjp_backward(c, scale, block, ranges, with_target, groups, residuals, cotangents):
  """`_backward`'s gradients; the target's cotangent is ignored (detached by contract)."""
  del with_target  # the forward's
  qr_BLHK, kvr_BSK, topk_BLT, out_BLHC, lse_BLH = residuals
  dqr_BLHK, dkvr_BSK, _ = _backward(c, scale, block, ranges, groups, False, qr_BLHK, kvr_BSK,
                                    topk_BLT, out_BLHC, lse_BLH, *cotangents[:2])
  return dqr_BLHK, dkvr_BSK, None


_sparse_mla.defvjp(_vjp_forward, _vjp_backward)


def _prepared(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, query_block, causal,
              head_groups, batch_shards, key_ranges):
  """`(c, block, ranges, qr_BLHK, kvr_BSK, topk_BLT)`: the inputs checked, joined and the
  selection emptied where it must be, the blocks and key ranges sized."""
  check_sparse_mla_inputs(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT)
  (b, l, h, c), s = q_BLHC.shape, kv_BSC.shape[1]
  topk_BLT = op_selection(topk_BLT, q_BLHC, kv_BSC, causal, "sparse_mla_dense")
  if head_groups < 1 or h % head_groups:
    raise ValueError(f"head_groups={head_groups} must be >= 1 and divide the {h} heads of q "
                     f"{q_BLHC.shape} [B, L, H, C]")
  if query_block is None:
    query_block = _block_size(rows_per_device(b, batch_shards), s, h)
  qr_BLHK = jnp.concatenate([q_BLHC, q_rope_BLHR.astype(q_BLHC.dtype)], axis=-1)
  kvr_BSK = jnp.concatenate([kv_BSC, k_rope_BSR.astype(kv_BSC.dtype)], axis=-1)
  block = query_block_size(l, query_block)
  ranges = tuple(causal_key_ranges(l, s, block, causal, key_ranges))
  return c, block, ranges, qr_BLHK, kvr_BSK, topk_BLT


def _run(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale, query_block, causal,
         head_groups, batch_shards, with_target, key_ranges=CAUSAL_KEY_RANGES):
  c, block, ranges, qr_BLHK, kvr_BSK, topk_BLT = _prepared(
      q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, query_block, causal, head_groups,
      batch_shards, key_ranges)
  return _sparse_mla(c, scale, block, ranges, with_target, head_groups, qr_BLHK, kvr_BSK,
                     topk_BLT)


def sparse_mla_dense(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, *, scale: float,
                     query_block: int | None = None, causal: bool = False, head_groups: int = 1,
                     batch_shards: int = 1, key_ranges: int = CAUSAL_KEY_RANGES):
  """Sparse MLA over every key, the selection as per-key counts (module docstring): O(L x S)
  work (half of it with `causal`) and O(query_block x H x S) memory, forward and backward
  (custom VJP), no gather or scatter. Same arguments and results as
  `sparse_mla.sparse_mla_reference` (index contract included: out-of-range slots are empty,
  duplicates count twice), plus:

  Args:
    causal: queries and keys are the same L positions and a slot selecting a key after its
      query is empty; each of `key_ranges` runs of query blocks then skips the keys after its
      last query.
    query_block: queries per block; None sizes the blocks for the platform traced for.
    head_groups, batch_shards: as `sparse_mla_xla`'s.
  """
  out_BLHC, lse_BLH, _ = _run(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale,
                              query_block, causal, head_groups, batch_shards, with_target=False,
                              key_ranges=key_ranges)
  return out_BLHC, lse_BLH


def sparse_mla_dense_with_kl_target(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, *,
                                    scale: float, query_block: int | None = None,
                                    causal: bool = False, head_groups: int = 1,
                                    batch_shards: int = 1, key_ranges: int = CAUSAL_KEY_RANGES):
  """`sparse_mla_dense`'s `(out_BLHC, lse_BLH)` and the indexer KL's target, fp32 `[B, L, T]`
  (`sparse_mla.sparse_mla_head_mean_probs`'s values: the head-mean probability of one copy of
  each slot's key, 0 at empty slots), from the same pass; detached."""
  out_BLHC, lse_BLH, target_BLT = _run(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale,
                                       query_block, causal, head_groups, batch_shards,
                                       with_target=True, key_ranges=key_ranges)
  return out_BLHC, lse_BLH, jax.lax.stop_gradient(target_BLT)


def sparse_mla_dense_parts(*, causal: bool = False, head_groups: int = 1, batch_shards: int = 1,
                           query_block: int | None = None,
                           key_ranges: int = CAUSAL_KEY_RANGES) -> SparseMLAParts:
  """`sparse_mla_dense` as `sparse_mla.SparseMLAParts`, for a custom VJP of the caller's
  (`glm5_jax.attention.dsa_kl_fused`): the backward also returns the indexer KL's target, the
  head mean of the p it forms for its own gradients (one reduce over the heads a block), so the
  forward (and a remat's rerun of it) forms none. Options as `sparse_mla_dense`'s."""
  options = dict(query_block=query_block, causal=causal, head_groups=head_groups,
                 batch_shards=batch_shards, key_ranges=key_ranges)

  def forward(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale, head_probs=False):
    c, block, ranges, qr_BLHK, kvr_BSK, topk_BLT = _prepared(
        q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, **options)
    out_BLHC, lse_BLH, target_BLT = _forward(c, scale, block, ranges, head_probs, qr_BLHK,
                                             kvr_BSK, topk_BLT)
    return (out_BLHC, lse_BLH, target_BLT) if head_probs else (out_BLHC, lse_BLH)

  def backward(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, out_BLHC, lse_BLH, dout_BLHC,
               dlse_BLH, scale):
    c, block, ranges, qr_BLHK, kvr_BSK, topk_BLT = _prepared(
        q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, **options)
    dqr_BLHK, dkvr_BSK, target_BLT = _backward(c, scale, block, ranges, head_groups, True,
                                               qr_BLHK, kvr_BSK, topk_BLT, out_BLHC, lse_BLH,
                                               dout_BLHC, dlse_BLH)
    return (dqr_BLHK[..., :c], dqr_BLHK[..., c:].astype(q_rope_BLHR.dtype),
            dkvr_BSK[..., :c], dkvr_BSK[..., c:].astype(k_rope_BSR.dtype), target_BLT)

  return SparseMLAParts(forward, backward)
