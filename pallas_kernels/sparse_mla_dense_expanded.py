"""Sparse MLA over every key in the expanded form: per-head keys and values, the selection as
per-key counts (`model.dsa_attention_keys`, issue 40).

`sparse_mla_dense` attends in the absorbed form: every head's query against the shared
`K = C + R = 576`-wide latent row and the output in the C = 512 latent dims, 2 (C + R) + 2 C
FLOPs a head and key, forward. This op takes the expanded form instead, the keys
`k = [c W_kb | k_rope]` (N + R = 256 wide) and values `v = c W_vb` (V = 256) of each head, built by
the caller: 2 (N + R) + 2 V FLOPs a head and key, 2.1x fewer at GLM-5's dims, and the same in
the backward. Expanding the S key rows costs what absorbing the L queries costs
(`2 C H (N + V)` a token either way when L = S), so for self-attention over every key the
expanded form is cheaper exactly when `N + V < 2 C` (`mla._expanded_dense_keys`). The gather
paths cannot use it: a gather of per-head rows moves H times the bytes.

The math is `sparse_mla_dense`'s (counts as weights, a duplicate row two terms, empty slots
none); what changes is the loop. The key-row gradient of the expanded form is per head,
`[S, H, N + R]` and `[S, H, V]`: accumulated over blocks of queries as the absorbed form's
`[S, K]` is, it would be read and written once a block. So the loop runs over **groups of
heads** (`head_block` heads an iteration), and inside one iteration over `key_ranges` static runs
of queries, each forming only the keys up to its last query (causal); a group's key and value
gradients are complete when its iteration ends. Per iteration the temporaries are fp32
`[B, g, L_r, S_r]` logits / probabilities (g heads, a run's queries and keys), so `head_block`
is sized for them (`_head_block`).

Notation (docs/design.md): B batch, L queries, S keys, H heads, K = N + R query / key width,
V value width, T top-k slots, g heads of a group.
"""

import functools
import typing

import jax
import jax.numpy as jnp

from pallas_kernels.blocking import (CAUSAL_KEY_RANGES, MASKED_LOGIT, causal_key_ranges,
                                     op_selection, platform, round_up, rows_per_device,
                                     temporaries_budget, varying_like)
from pallas_kernels.sparse_mla import SparseMLAParts, backward_delta, named_residuals
from pallas_kernels.sparse_mla_dense import key_counts


def check_expanded_inputs(q_BLHK, k_BSHK, v_BSHV, topk_BLT):
  b, l, h, k = q_BLHK.shape
  s = k_BSHK.shape[1]
  if (k_BSHK.shape != (b, s, h, k) or v_BSHV.shape[:3] != (b, s, h)
      or topk_BLT.shape[:2] != (b, l)):
    raise ValueError(f"expanded sparse MLA shapes disagree: q {q_BLHK.shape} [B, L, H, K], k "
                     f"{k_BSHK.shape} [B, S, H, K], v {v_BSHV.shape} [B, S, H, V], topk "
                     f"{topk_BLT.shape} [B, L, T]")
  if not jnp.issubdtype(topk_BLT.dtype, jnp.integer):
    raise ValueError(f"topk must hold integer key indices, got {topk_BLT.dtype}")


def _local_head_block(b: int, runs, local_heads: int, k: int, v: int,
                      on_accelerator: bool) -> int:
  """Heads a device takes an iteration: the largest divisor of its heads whose temporaries fit
  `blocking.temporaries_budget` (four fp32 `[B, g, L_r, S_r]` arrays of the largest run, and
  the group's fp32 key and value gradients `[B, g, S, K + V]`)."""
  largest, keys = max((stop - start) * n for start, stop, n in runs), runs[-1][2]
  per_head = b * 4 * (4 * largest + keys * (k + v))
  fits = max(1, temporaries_budget(on_accelerator) // per_head)
  return max(g for g in range(1, min(fits, local_heads) + 1) if local_heads % g == 0)


def _runs(l: int, s: int, causal: bool, key_ranges: int):
  """`[(start, stop, keys)]`: the query runs (causal: `key_ranges` of them, each up to its
  last query's keys; else one over all S), 8-aligned."""
  block = round_up(-(-l // key_ranges), 8)
  return causal_key_ranges(l, s, block, causal, key_ranges)


class _Heads(typing.NamedTuple):
  """The head loop's split: H = shards x local; `local_block` local heads an iteration, so an
  iteration takes `shards x local_block` heads, the same on every device a head split puts
  them on (a slice along the split axis would gather it)."""

  shards: int
  local_block: int

  def iterations(self, h: int) -> int:
    return h // self.shards // self.local_block

  def split(self, x_BXHY):
    """`[B, X, P, H / P, Y]`: the heads axis split into its shards."""
    b, x, h, y = x_BXHY.shape
    return x_BXHY.reshape(b, x, self.shards, h // self.shards, y)

  def take(self, x_BXPHY, i):
    """`[B, g, X, Y]`: iteration i's heads of a split array, heads a batch dim."""
    b, x, p, _, y = x_BXPHY.shape
    part = jax.lax.dynamic_slice_in_dim(x_BXPHY, i * self.local_block, self.local_block, axis=3)
    return jnp.swapaxes(part.reshape(b, x, p * self.local_block, y), 1, 2)

  def put(self, buf_BXPHY, x_BGXY, i):
    """`buf` (split) with iteration i's heads replaced by `x` (`[B, g, X, Y]`)."""
    b, x, p, _, y = buf_BXPHY.shape
    part = jnp.swapaxes(x_BGXY, 1, 2).reshape(b, x, p, self.local_block, y)
    return jax.lax.dynamic_update_slice_in_dim(buf_BXPHY, part.astype(buf_BXPHY.dtype),
                                               i * self.local_block, axis=3)

  def loop(self, h: int, body, carry):
    """`body(i, carry) -> carry` over the iterations (no loop for one)."""
    if self.iterations(h) == 1:
      return body(0, carry)
    return jax.lax.fori_loop(0, self.iterations(h), body, carry)


def _add_at(acc, x, start):
  """`acc` with `x` added into the box of x's shape at `start`: a slice, an add and an update in
  place (`.at[box].add` became a pad of x to the whole accumulator and a whole add)."""
  box = jax.lax.dynamic_slice(acc, start, x.shape)
  return jax.lax.dynamic_update_slice(acc, box + x, start)


def _masked_logits(scale, q_BGLK, k_BGSK, counts_BLS):
  """fp32 `[B, g, L_r, S_r]` logits, `MASKED_LOGIT` at unselected keys, and `[B, 1, L_r, S_r]`
  whether each key is selected."""
  logits = jnp.einsum("bglk,bgsk->bgls", q_BGLK, k_BGSK,
                      preferred_element_type=jnp.float32) * scale
  valid = (counts_BLS > 0)[:, None]
  return jnp.where(valid, logits, MASKED_LOGIT), valid


def _forward_group(scale, runs, probs_BLS, q_BGLK, k_BGSK, v_BGSV, counts_BLS):
  """One head group's `(out_BGLV, lse_BGL, probs_BLS)` over every run: `probs_BLS` (fp32, or
  None) plus the group's per-copy probabilities summed over its heads."""
  outs, lses = [], []
  for start, stop, keys in runs:
    cnt = counts_BLS[:, start:stop, :keys]
    s, valid = _masked_logits(scale, q_BGLK[:, :, start:stop], k_BGSK[:, :, :keys], cnt)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(valid, jnp.exp(s - m), 0.0)
    denom = jnp.sum(e * cnt[:, None], axis=-1, keepdims=True)
    safe = jnp.where(denom > 0, denom, 1.0)
    lses.append(jnp.where(denom > 0, m + jnp.log(safe), -jnp.inf)[..., 0])
    per_copy = e / safe
    p = (per_copy * cnt[:, None]).astype(v_BGSV.dtype)
    outs.append(jnp.einsum("bgls,bgsv->bglv", p, v_BGSV[:, :, :keys],
                           preferred_element_type=jnp.float32).astype(v_BGSV.dtype))
    if probs_BLS is not None:
      probs_BLS = _add_at(probs_BLS, per_copy.sum(axis=1), (0, start, 0))
  return jnp.concatenate(outs, axis=2), jnp.concatenate(lses, axis=2), probs_BLS


def _backward_group(scale, runs, probs_BLS, q_BGLK, k_BGSK, v_BGSV, counts_BLS, dout_BGLV,
                    lse_BGL, delta_BGL):
  """One head group's `(dq_BGLK, dk_BGSK, dv_BGSV, probs_BLS)`: dq per run, dk and dv fp32
  summed over the runs, and `probs_BLS` (or None) plus the group's head-summed per-copy
  probabilities, from the p the gradients form anyway."""
  dtype = q_BGLK.dtype
  dk = jnp.zeros(k_BGSK.shape, jnp.float32)
  dv = jnp.zeros(v_BGSV.shape, jnp.float32)
  dqs = []
  for start, stop, keys in runs:
    cnt = counts_BLS[:, start:stop, :keys]
    q, k, v = q_BGLK[:, :, start:stop], k_BGSK[:, :, :keys], v_BGSV[:, :, :keys]
    dout = dout_BGLV[:, :, start:stop].astype(dtype)
    s, valid = _masked_logits(scale, q, k, cnt)
    per_copy = jnp.where(valid, jnp.exp(s - lse_BGL[:, :, start:stop, None]), 0.0)
    p = per_copy * cnt[:, None]
    dp = jnp.einsum("bglv,bgsv->bgls", dout, v, preferred_element_type=jnp.float32)
    ds = (scale * p * (dp - delta_BGL[:, :, start:stop, None])).astype(dtype)
    dqs.append(jnp.einsum("bgls,bgsk->bglk", ds, k,
                          preferred_element_type=jnp.float32).astype(dtype))
    dk = _add_at(dk, jnp.einsum("bgls,bglk->bgsk", ds, q, preferred_element_type=jnp.float32),
                 (0, 0, 0, 0))
    dv = _add_at(dv, jnp.einsum("bgls,bglv->bgsv", p.astype(dtype), dout,
                                preferred_element_type=jnp.float32), (0, 0, 0, 0))
    if probs_BLS is not None:
      probs_BLS = _add_at(probs_BLS, per_copy.sum(axis=1), (0, start, 0))
  return jnp.concatenate(dqs, axis=2), dk.astype(dtype), dv.astype(dtype), probs_BLS


def _at_slots(head_sum_BLS, heads: int, topk_BLT):
  """fp32 `[B, L, T]`: the head-mean probability at each slot's key, 0 at empty slots."""
  picked = jnp.take_along_axis(head_sum_BLS, jnp.maximum(topk_BLT, 0), axis=-1) / heads
  return jnp.where(topk_BLT >= 0, picked, 0.0)


def _forward(scale, heads: _Heads, runs, with_target, q_BLHK, k_BSHK, v_BSHV, topk_BLT):
  """`(out_BLHV, lse_BLH, target_BLT or None)`."""
  (b, l, h, _), v_dim = q_BLHK.shape, v_BSHV.shape[-1]
  counts_BLS = key_counts(topk_BLT, k_BSHK.shape[1])
  q, k, v = (heads.split(x) for x in (q_BLHK, k_BSHK, v_BSHV))
  carry = (heads.split(varying_like(jnp.zeros((b, l, h, v_dim), v_BSHV.dtype), q_BLHK)),
           heads.split(varying_like(jnp.zeros((b, l, h, 1), jnp.float32), q_BLHK)),
           varying_like(jnp.zeros(counts_BLS.shape, jnp.float32), q_BLHK) if with_target
           else None)

  def body(i, carry):
    out, lse, probs = carry
    o, ls, probs = _forward_group(scale, runs, probs, heads.take(q, i), heads.take(k, i),
                                  heads.take(v, i), counts_BLS)
    return heads.put(out, o, i), heads.put(lse, ls[..., None], i), probs

  out, lse, probs_BLS = heads.loop(h, body, carry)
  target = _at_slots(probs_BLS, h, topk_BLT) if with_target else None
  return out.reshape(b, l, h, v_dim), lse.reshape(b, l, h), target


def _backward(scale, heads: _Heads, runs, with_target, q_BLHK, k_BSHK, v_BSHV, topk_BLT,
              out_BLHV, lse_BLH, dout_BLHV, dlse_BLH):
  """`(dq_BLHK, dk_BSHK, dv_BSHV, target_BLT or None)`."""
  h = q_BLHK.shape[2]
  counts_BLS = key_counts(topk_BLT, k_BSHK.shape[1])
  delta_BLH = backward_delta(dout_BLHV, out_BLHV, dlse_BLH)
  q, k, v, dout = (heads.split(x) for x in (q_BLHK, k_BSHK, v_BSHV, dout_BLHV))
  lse, delta = (heads.split(x[..., None]) for x in (lse_BLH, delta_BLH))
  zeros = lambda x: heads.split(varying_like(jnp.zeros_like(x), q_BLHK))
  carry = (zeros(q_BLHK), zeros(k_BSHK), zeros(v_BSHV),
           varying_like(jnp.zeros(counts_BLS.shape, jnp.float32), q_BLHK) if with_target
           else None)

  def body(i, carry):
    dq, dk, dv, probs = carry
    gq, gk, gv, probs = _backward_group(
        scale, runs, probs, heads.take(q, i), heads.take(k, i), heads.take(v, i), counts_BLS,
        heads.take(dout, i), heads.take(lse, i)[..., 0], heads.take(delta, i)[..., 0])
    return heads.put(dq, gq, i), heads.put(dk, gk, i), heads.put(dv, gv, i), probs

  dq, dk, dv, probs_BLS = heads.loop(h, body, carry)
  target = _at_slots(probs_BLS, h, topk_BLT) if with_target else None
  return (dq.reshape(q_BLHK.shape), dk.reshape(k_BSHK.shape), dv.reshape(v_BSHV.shape), target)


def _prepared(q_BLHK, k_BSHK, v_BSHV, topk_BLT, causal, head_block, head_shards, batch_shards,
              key_ranges):
  """`(heads, runs, topk_BLT)`: the inputs checked, the selection emptied where it must be (out
  of range; causal: after its query), the runs and head groups sized."""
  check_expanded_inputs(q_BLHK, k_BSHK, v_BSHV, topk_BLT)
  (b, l, h, k), s, v = q_BLHK.shape, k_BSHK.shape[1], v_BSHV.shape[-1]
  topk_BLT = op_selection(topk_BLT, q_BLHK, k_BSHK, causal, "sparse_mla_dense_expanded")
  if key_ranges < 1:
    raise ValueError(f"key_ranges={key_ranges} must be >= 1 (causal query ranges)")
  if head_shards < 1 or h % head_shards:
    raise ValueError(f"head_shards={head_shards} must be >= 1 and divide the {h} heads of q "
                     f"{q_BLHK.shape} [B, L, H, K]")
  runs = tuple(_runs(l, s, causal, key_ranges))
  local = h // head_shards
  if head_block is None:
    head_block = _local_head_block(rows_per_device(b, batch_shards), runs, local, k, v,
                                   on_accelerator=platform() != "cpu")
  if head_block < 1 or local % head_block:
    raise ValueError(f"head_block={head_block} must be >= 1 and divide the {local} heads a "
                     f"device holds (H={h} over head_shards={head_shards})")
  return _Heads(head_shards, head_block), runs, topk_BLT


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attend(scale, heads, runs, q_BLHK, k_BSHK, v_BSHV, topk_BLT):
  return _forward(scale, heads, runs, False, q_BLHK, k_BSHK, v_BSHV, topk_BLT)[:2]


def _attend_forward(scale, heads, runs, q_BLHK, k_BSHK, v_BSHV, topk_BLT):
  out_BLHV, lse_BLH, _ = _forward(scale, heads, runs, False, q_BLHK, k_BSHK, v_BSHV, topk_BLT)
  out_BLHV, lse_BLH = named_residuals(out_BLHV, lse_BLH)
  return (out_BLHV, lse_BLH), (q_BLHK, k_BSHK, v_BSHV, topk_BLT, out_BLHV, lse_BLH)


def _attend_backward(scale, heads, runs, residuals, cotangents):
  dq, dk, dv, _ = _backward(scale, heads, runs, False, *residuals, *cotangents)
  return dq, dk, dv, None


_attend.defvjp(_attend_forward, _attend_backward)


def sparse_mla_dense_expanded(q_BLHK, k_BSHK, v_BSHV, topk_BLT, *, scale: float,
                              causal: bool = False, head_block: int | None = None,
                              head_shards: int = 1, batch_shards: int = 1,
                              key_ranges: int = CAUSAL_KEY_RANGES):
  """Sparse attention of per-head queries, keys and values over every key, the selection as
  per-key counts (module docstring); forward and backward (custom VJP), no gather or scatter
  but the counts'.

  Args:
    q_BLHK: queries `[q_nope | q_rope]`, RoPE applied. k_BSHK: keys `[c W_kb | k_rope]` (the
      RoPE key broadcast over heads). v_BSHV: values `c W_vb`.
    topk_BLT: int selected key positions; the index contract of `pallas_kernels` (out of range
      = empty, a duplicate counts twice).
    scale: softmax scale.
    causal: queries and keys are the same L positions; a slot selecting a key after its query
      is empty, and each of `key_ranges` runs of queries forms only the keys up to its last.
    head_block: heads a device takes an iteration (a divisor of H / head_shards); None sizes
      it for the platform traced for and the rows a device holds.
    head_shards, batch_shards: the devices XLA splits the heads / the batch over (an
      iteration takes the same heads on each head shard, so the loop never gathers them).
  Returns:
    `(out_BLHV, lse_BLH)`: output in v's dtype, fp32 log-sum-exp (zero output and lse -inf for a
    query with no valid slot), as `sparse_mla_reference` gives for the absorbed inputs.
  """
  heads, runs, topk_BLT = _prepared(q_BLHK, k_BSHK, v_BSHV, topk_BLT, causal, head_block,
                                    head_shards, batch_shards, key_ranges)
  return _attend(float(scale), heads, runs, q_BLHK, k_BSHK, v_BSHV, topk_BLT)


def sparse_mla_dense_expanded_parts(*, causal: bool = False, head_block: int | None = None,
                                    head_shards: int = 1, batch_shards: int = 1,
                                    key_ranges: int = CAUSAL_KEY_RANGES) -> SparseMLAParts:
  """`sparse_mla_dense_expanded` as `sparse_mla.SparseMLAParts` over `(q, k, v)`, for
  `glm5_jax.attention.dsa_kl_fused`: forward `(q, k, v, topk, scale, head_probs=False) ->
  (out, lse[, target])`; backward `(q, k, v, topk, out, lse, dout, dlse, scale) -> (dq, dk, dv,
  target)`, the target (the head-mean probability of one copy of each slot's key) from the p
  the backward forms for its gradients. Options as `sparse_mla_dense_expanded`'s."""

  def prepared(q_BLHK, k_BSHK, v_BSHV, topk_BLT):
    return _prepared(q_BLHK, k_BSHK, v_BSHV, topk_BLT, causal, head_block, head_shards,
                     batch_shards, key_ranges)

  def forward(q_BLHK, k_BSHK, v_BSHV, topk_BLT, scale, head_probs=False):
    heads, runs, topk_BLT = prepared(q_BLHK, k_BSHK, v_BSHV, topk_BLT)
    out_BLHV, lse_BLH, target_BLT = _forward(scale, heads, runs, head_probs, q_BLHK, k_BSHK,
                                             v_BSHV, topk_BLT)
    return (out_BLHV, lse_BLH, target_BLT) if head_probs else (out_BLHV, lse_BLH)

  def backward(q_BLHK, k_BSHK, v_BSHV, topk_BLT, out_BLHV, lse_BLH, dout_BLHV, dlse_BLH, scale):
    heads, runs, topk_BLT = prepared(q_BLHK, k_BSHK, v_BSHV, topk_BLT)
    return _backward(scale, heads, runs, True, q_BLHK, k_BSHK, v_BSHV, topk_BLT, out_BLHV,
                     lse_BLH, dout_BLHV, dlse_BLH)

  return SparseMLAParts(forward, backward)
