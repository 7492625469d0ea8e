"""Sparse MLA attention (absorbed / MQA form): the jnp reference and the XLA gather path.

Each query token t selected T latent rows `topk[t]`. Every one of its H heads attends over
those rows of the shared MLA cache (docs/reference.md section 2, "absorbed"):

  logit[t, h, j] = (q[t, h] . kv[topk[t, j]] + q_rope[t, h] . k_rope[topk[t, j]]) * scale
  p[t, h, :]     = softmax_j(logit[t, h, :])          over the valid slots only
  out[t, h]      = sum_j p[t, h, j] kv[topk[t, j]]    (value = the C latent dims)
  lse[t, h]      = log sum_j exp(logit[t, h, j])      (-inf for a query with no valid slot)

with q the query already multiplied by W_kb (C = 512 latent dims) and q_rope its RoPE part
(R = 64), as FlashMLA's sparse kernels take them. Slots follow the package's index contract
(`pallas_kernels/__init__.py`): an index outside [0, S) (-1 or >= S) is an empty slot, excluded
from the sum and given no gradient, on every path; a row selected twice is two terms (weight as
logit + log 2, gradients of both slots summed). Cost is O(L x T) in time and, per query
block, in memory, instead of the dense path's O(L x S).

Gradients (custom VJP, shared by the XLA and Pallas paths; dp = dout . kv, delta = dout . out):

  ds[t, h, j] = p[t, h, j] * (dp[t, h, j] - delta[t, h] + dlse[t, h])
  dq[t, h]    = scale * sum_j ds kv[topk[t, j]]        dq_rope likewise with k_rope
  dkv[s]      = sum over (t, j) with topk[t, j] = s of  sum_h (p dout[t, h] + scale ds q[t, h])
  dk_rope[s]  = same sum of  sum_h scale ds q_rope[t, h]

dq is direct; dkv/dk_rope are per-(query, slot) contributions, joined in one row
`[dkv | dk_rope | 0]`, scatter-added into the key rows in XLA (`.at[].add`), one query block at
a time, into one fp32 accumulator (TPUs have no atomics, and a bf16 running sum would lose the
small contributions of long sequences).

Implementations (same signature `(q, q_rope, kv, k_rope, topk, *, scale) -> (out, lse)`):
  `sparse_mla_reference`  gathers every selected row at once, plain autodiff (O(L x T x C)).
  `sparse_mla_xla`        (sparse_mla_xla.py) per query block, its own custom VJP of the same
                          math, shaped for a matrix unit (one gather of joined rows, bf16
                          products, the KL target from the attention pass).
  `sparse_mla_pallas`     (sparse_mla_pallas.py) Pallas TPU kernels, same custom VJP.
Outputs are in the dtype of `kv`, lse in fp32. Tolerances: fp32 paths agree to ~1e-5 relative;
bf16 inputs (fp32 accumulation everywhere) to ~2e-2, the rounding of bf16 itself.

Notation (docs/design.md): B batch, L queries, S keys (latent rows), H heads, C latent dim
(= value dim), R RoPE dim, T top-k slots.
"""

import dataclasses
import functools
import typing
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.blocking import (MASKED_LOGIT, default_query_block, empty_out_of_range,
                                     from_query_blocks, gather_rows, map_query_blocks, pad_axis,
                                     query_block_size, round_up, to_query_blocks)


def check_sparse_mla_inputs(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT):
  b, l, h, c = q_BLHC.shape
  r = q_rope_BLHR.shape[-1]
  s = kv_BSC.shape[1]
  if (q_rope_BLHR.shape != (b, l, h, r) or kv_BSC.shape != (b, s, c)
      or k_rope_BSR.shape != (b, s, r) or topk_BLT.shape[:2] != (b, l)):
    raise ValueError(f"sparse MLA shapes disagree: q {q_BLHC.shape} [B, L, H, C], q_rope "
                     f"{q_rope_BLHR.shape} [B, L, H, R], kv {kv_BSC.shape} [B, S, C], k_rope "
                     f"{k_rope_BSR.shape} [B, S, R], topk {topk_BLT.shape} [B, L, T]")
  if not jnp.issubdtype(topk_BLT.dtype, jnp.integer):
    raise ValueError(f"topk must hold integer key indices, got {topk_BLT.dtype}")


def _logits(q_BLHC, q_rope_BLHR, kv_BLTC, k_rope_BLTR, scale):
  """fp32 `[B, L, H, T]` logits against gathered rows."""
  return (jnp.einsum("blhc,bltc->blht", q_BLHC, kv_BLTC, preferred_element_type=jnp.float32)
          + jnp.einsum("blhr,bltr->blht", q_rope_BLHR, k_rope_BLTR,
                       preferred_element_type=jnp.float32)) * scale


def masked_softmax(logits_BLHT, valid_BL1T):
  """Softmax over the valid slots and its log-sum-exp; a row with no valid slot gives zero
  probabilities and lse -inf. NaN-free values and gradients (masked slots never see inf)."""
  s_BLHT = jnp.where(valid_BL1T, logits_BLHT, MASKED_LOGIT)
  m_BLH1 = jnp.max(s_BLHT, axis=-1, keepdims=True)
  e_BLHT = jnp.where(valid_BL1T, jnp.exp(s_BLHT - m_BLH1), 0.0)
  l_BLH1 = e_BLHT.sum(-1, keepdims=True)
  safe_l_BLH1 = jnp.where(l_BLH1 > 0, l_BLH1, 1.0)
  lse_BLH = jnp.where(l_BLH1 > 0, m_BLH1 + jnp.log(safe_l_BLH1), -jnp.inf)[..., 0]
  return e_BLHT / safe_l_BLH1, lse_BLH


def sparse_mla_reference(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, *, scale: float):
  """The module docstring's forward, all queries at once; differentiable by autodiff.

  Args:
    q_BLHC: absorbed queries (q_nope W_kb). q_rope_BLHR: their RoPE part.
    kv_BSC: latent rows (keys and values). k_rope_BSR: the shared RoPE key rows.
    topk_BLT: int32 selected rows per query; an index outside [0, S) (-1, or >= S) is an empty
      slot; a row selected twice counts twice (package docstring, "Index contract").
    scale: softmax scale (the model's (N + R)^-0.5).
  Returns:
    `(out_BLHC, lse_BLH)`: output in kv's dtype, fp32 log-sum-exp (zero output and lse -inf for
    a query with no valid slot).
  """
  check_sparse_mla_inputs(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT)
  topk_BLT = empty_out_of_range(topk_BLT, kv_BSC.shape[1])
  rows_BLT = jnp.maximum(topk_BLT, 0)
  kv_BLTC = gather_rows(kv_BSC, rows_BLT)
  logits_BLHT = _logits(q_BLHC, q_rope_BLHR, kv_BLTC, gather_rows(k_rope_BSR, rows_BLT), scale)
  probs_BLHT, lse_BLH = masked_softmax(logits_BLHT, (topk_BLT >= 0)[:, :, None, :])
  out_BLHC = jnp.einsum("blht,bltc->blhc", probs_BLHT.astype(kv_BSC.dtype), kv_BLTC,
                        preferred_element_type=jnp.float32)
  return out_BLHC.astype(kv_BSC.dtype), lse_BLH


def sparse_mla_backward_block(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, dout_BLHC,
                              lse_BLH, delta_BLH, scale):
  """The module docstring's backward for one block of queries, in XLA: the definition the
  Pallas backward kernel computes (`sparse_mla_pallas`), in fp32.

  `delta_BLH` is `dout . out - dlse`; `topk_BLT` holds rows in [0, S) or -1
  (`sparse_mla_custom_vjp` maps the rest to -1). Returns `(dq_BLHC, dq_rope_BLHR, dkvr_BLTP)`:
  the query gradients (fp32) and the fp32 per-slot contributions to the selected key rows,
  joined `[dkv | dk_rope | 0]` (P = `joined_width(C, R)` columns; zero at -1 slots), to be
  scatter-added by the caller.
  """
  rows_BLT = jnp.maximum(topk_BLT, 0)
  kv_BLTC = gather_rows(kv_BSC, rows_BLT)
  k_rope_BLTR = gather_rows(k_rope_BSR, rows_BLT)
  logits_BLHT = _logits(q_BLHC, q_rope_BLHR, kv_BLTC, k_rope_BLTR, scale)
  valid_BL1T = (topk_BLT >= 0)[:, :, None, :]
  p_BLHT = jnp.where(valid_BL1T, jnp.exp(logits_BLHT - lse_BLH[..., None]), 0.0)
  dp_BLHT = jnp.einsum("blhc,bltc->blht", dout_BLHC, kv_BLTC, preferred_element_type=jnp.float32)
  ds_BLHT = p_BLHT * (dp_BLHT - delta_BLH[..., None])
  f32 = lambda x: x.astype(jnp.float32)
  dq_BLHC = scale * jnp.einsum("blht,bltc->blhc", ds_BLHT, f32(kv_BLTC))
  dq_rope_BLHR = scale * jnp.einsum("blht,bltr->blhr", ds_BLHT, f32(k_rope_BLTR))
  dkv_BLTC = (jnp.einsum("blht,blhc->bltc", p_BLHT, f32(dout_BLHC))
              + scale * jnp.einsum("blht,blhc->bltc", ds_BLHT, f32(q_BLHC)))
  dk_rope_BLTR = scale * jnp.einsum("blht,blhr->bltr", ds_BLHT, f32(q_rope_BLHR))
  dkvr_BLTK = jnp.concatenate([dkv_BLTC, dk_rope_BLTR], axis=-1)
  width = joined_width(kv_BSC.shape[-1], k_rope_BSR.shape[-1])
  return dq_BLHC, dq_rope_BLHR, pad_axis(dkvr_BLTK, 3, width, 0.0)


def joined_width(c: int, r: int) -> int:
  """P: the columns of the joined key-row contributions `[dkv | dk_rope | 0]`, C + R rounded
  up to whole 128-wide lane tiles (a TPU kernel writes and XLA scatter-adds them as they are)."""
  return round_up(c + r, 128)


def scatter_add_rows(acc_BS, topk_BLT, rows_BLT):
  """`acc[b, topk[b, l, t]] += rows[b, l, t]` (`[B, S, ...]` += `[B, L, T, ...]`): duplicate
  indices accumulate; slots outside [0, S) are dropped, never wrapped around or clamped.

  The batch is a vmapped (batching) dimension of the scatter, not an index coordinate: with the
  batch as an index (`acc.at[arange(B)[:, None, None], topk]`) the SPMD partitioner cannot prove
  that batch row b only writes acc[b], so under a batch-sharded mesh it kept the whole-batch
  accumulator on every device and all-reduced it over the batch devices in every query block
  of the backward (issue 25: ~47,000 GiB per step for the 744B layout).
  """
  s = acc_BS.shape[1]
  safe_BLT = jnp.where(topk_BLT < 0, s, topk_BLT)  # s is out of range: mode="drop" skips it
  add = lambda acc_S, idx_LT, rows_LT: acc_S.at[idx_LT].add(rows_LT, mode="drop")
  return jax.vmap(add)(acc_BS, safe_BLT, rows_BLT)


@dataclasses.dataclass(frozen=True)
class SparseMLAKernels:
  """How one implementation computes the pieces of the custom VJP.

  forward: `(q, q_rope, kv, k_rope, topk, scale) -> (out, lse)` over every query, or `(out,
    lse, head_mean_probs)` (the indexer KL's target, `sparse_mla_head_mean_probs`'s values; no
    gradient flows through it).
  backward_block: `sparse_mla_backward_block`'s signature and results (the key-row
    contributions joined, `[dkv | dk_rope | 0]`), for one block of queries.
  backward_query_block: queries per backward block (bounds the per-slot contributions).
  head_groups: G, the key-row gradients are accumulated per group of H / G heads and summed
    over the groups once, after the query-block loop (`_vjp_backward`).
  """

  forward: Callable
  backward_block: Callable
  backward_query_block: int | None
  head_groups: int = 1


class SparseMLAParts(typing.NamedTuple):
  """A sparse MLA's forward and backward as plain functions, for a caller that builds its own
  custom VJP around them (`glm5_jax.attention.dsa_kl_fused`: the attention and the indexer KL
  as one, whose backward needs the KL target this backward emits).

  forward: `(q, q_rope, kv, k_rope, topk, scale, head_probs=False) -> (out, lse[, probs])`,
    probs the head-mean probabilities (`sparse_mla_head_mean_probs`) from a second sweep.
  backward: `(q, q_rope, kv, k_rope, topk, out, lse, dout, dlse, scale) -> (dq, dq_rope, dkv,
    dk_rope, probs)`: the module docstring's gradients, and the head-mean probabilities from the
    p the backward forms at every selected slot anyway (no extra matmul).
  indexer_kl_backward: None, or where the backward's last output is the target over every key
    instead (fp32 `[B, L, S]`, the head-mean probability of one copy of each key; the TPU
    kernels over every key), the indexer KL's input gradients from it: `(index_q, index_k,
    index_w, topk, target_BLS, dkl_BL, index_scale) -> (dindex_q, dindex_k, dindex_w)`
    (`pallas_kernels.indexer_kl_pallas`).
  """

  forward: Callable
  backward: Callable
  indexer_kl_backward: Callable | None = None


def sparse_mla_custom_vjp(kernels, q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale):
  """`kernels.forward` with the blockwise backward of the module docstring.

  Indices outside [0, S) become -1 here, once, so the forward kernels, the residuals and the
  backward all see the same selection (and no Pallas DMA reads past the key rows).
  """
  if kernels.head_groups < 1 or q_BLHC.shape[2] % kernels.head_groups:
    raise ValueError(f"head_groups={kernels.head_groups} must be >= 1 and divide the "
                     f"{q_BLHC.shape[2]} heads of q {q_BLHC.shape} [B, L, H, C]")
  topk_BLT = empty_out_of_range(topk_BLT, kv_BSC.shape[1])
  return _sparse_mla_with_vjp(kernels, q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6))
def _sparse_mla_with_vjp(kernels, q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale):
  return kernels.forward(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale)


def backward_delta(dout_BLHC, out_BLHC, dlse_BLH):
  """fp32 `[B, L, H]`: `dout . out - dlse`, the softmax backward's per-row term that every
  path's `ds = p (dp - delta)` takes (module docstring)."""
  return (jnp.sum(dout_BLHC.astype(jnp.float32) * out_BLHC.astype(jnp.float32), axis=-1)
          - dlse_BLH.astype(jnp.float32))


# The names the forward rules give their output and log-sum-exp residuals, so that a remat
# policy (`glm5_jax.layers.remat`, "save_attn_lse") can keep them: a `checkpoint_name` on the
# op's results outside the custom VJP tags a copy, and jax would rerun the forward kernel for
# the residuals in the backward all the same.
OUT_NAME, LSE_NAME = "sparse_mla_out", "sparse_mla_lse"


def named_residuals(out_BLHC, lse_BLH):
  """`(out, lse)` tagged `OUT_NAME` / `LSE_NAME` for `jax.checkpoint` policies (values as
  they are)."""
  return checkpoint_name(out_BLHC, OUT_NAME), checkpoint_name(lse_BLH, LSE_NAME)


def _vjp_forward(kernels, q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale):
  out_BLHC, lse_BLH, *probs = kernels.forward(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT,
                                              scale)
  out_BLHC, lse_BLH = named_residuals(out_BLHC, lse_BLH)
  return (out_BLHC, lse_BLH, *probs), (q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT,
                                       out_BLHC, lse_BLH)


def _grouped_backward_block(kernels, q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT,
                            dout_BLHC, lse_BLH, delta_BLH, scale):
  """`kernels.backward_block` on each group of H / G heads (G = `kernels.head_groups`).

  Returns `(dq_BLHC, dq_rope_BLHR, dkvr_BLTGP)`: the joined key-row contributions of each
  group's heads, not yet summed over the groups. With the heads split over a mesh axis
  and G its size, each device holds one group, so the per-slot contributions stay device-local
  partial sums; summing them here would be an all-reduce of `[B, Lq, T, C + R]` in every query
  block, where `_vjp_backward` sums the `[B, S, C + R]` accumulator over the groups once.
  """
  g, h = kernels.head_groups, q_BLHC.shape[2]
  if g == 1:
    dq, dq_rope, dkvr_BLTP = kernels.backward_block(
        q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, dout_BLHC, lse_BLH, delta_BLH, scale)
    return dq, dq_rope, dkvr_BLTP[:, :, :, None]
  split = lambda x: x.reshape(x.shape[:2] + (g, h // g) + x.shape[3:])  # [B, L, G, H/G, ...]
  merge = lambda x: x.reshape(x.shape[:2] + (h,) + x.shape[4:])
  block = lambda q, q_rope, dout, lse, delta: kernels.backward_block(
      q, q_rope, kv_BSC, k_rope_BSR, topk_BLT, dout, lse, delta, scale)
  dq, dq_rope, dkvr_BLTGP = jax.vmap(block, in_axes=2, out_axes=(2, 2, 3))(
      split(q_BLHC), split(q_rope_BLHR), split(dout_BLHC), split(lse_BLH), split(delta_BLH))
  return merge(dq), merge(dq_rope), dkvr_BLTGP


def _vjp_backward(kernels, scale, residuals, cotangents):
  q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, out_BLHC, lse_BLH = residuals
  dout_BLHC, dlse_BLH = cotangents[:2]  # a head-mean probs output is detached: no cotangent
  l = q_BLHC.shape[1]
  delta_BLH = backward_delta(dout_BLHC, out_BLHC, dlse_BLH)
  block = query_block_size(l, kernels.backward_query_block)
  blocked = [to_query_blocks(x, block, pad) for x, pad in
             ((q_BLHC, 0), (q_rope_BLHR, 0), (topk_BLT, -1), (dout_BLHC, 0), (lse_BLH, 0.0),
              (delta_BLH, 0.0))]

  def one_block(dkvr_BSGP, xs):
    q, q_rope, topk, dout, lse, delta = xs
    dq, dq_rope, dkvr_rows = _grouped_backward_block(
        kernels, q, q_rope, kv_BSC, k_rope_BSR, topk, dout, lse, delta, scale)
    return (scatter_add_rows(dkvr_BSGP, topk, dkvr_rows),
            (dq.astype(q_BLHC.dtype), dq_rope.astype(q_rope_BLHR.dtype)))

  g = kernels.head_groups
  (b, s, c), r = kv_BSC.shape, k_rope_BSR.shape[-1]
  zeros = jnp.zeros((b, s, g, joined_width(c, r)), jnp.float32)
  dkvr_BSGP, (dq_nBLHC, dq_rope_nBLHR) = jax.lax.scan(one_block, zeros, blocked)
  # The one sum over the head groups (with the heads split over a mesh axis: one all-reduce).
  dkvr_BSP = dkvr_BSGP.sum(2)
  return (from_query_blocks(dq_nBLHC, l), from_query_blocks(dq_rope_nBLHR, l),
          dkvr_BSP[..., :c].astype(kv_BSC.dtype),
          dkvr_BSP[..., c:c + r].astype(k_rope_BSR.dtype), None)


_sparse_mla_with_vjp.defvjp(_vjp_forward, _vjp_backward)


def _default_query_block(kv_BSC, k_rope_BSR, topk_BLT, heads):
  """Queries per block sized by the gathered rows and `[H, T]` logits (`default_query_block`)."""
  b, t = kv_BSC.shape[0], topk_BLT.shape[-1]
  row = kv_BSC.shape[-1] + k_rope_BSR.shape[-1]
  return default_query_block(b * t * (3 * row + 4 * heads) * 4)


def sparse_mla_head_mean_probs(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, lse_BLH, *,
                               scale: float, query_block: int | None = None):
  """The attention's head-mean probability at each selected slot, fp32 `[B, L, T]`.

  `mean_h exp(logit[t, h, j] - lse[t, h])` from the forward's `lse`, 0 at empty slots (index
  outside [0, S)); rows sum to 1 over the valid slots. A row selected twice gets its probability
  in both slots (each copy is one softmax term, as in the forward). This is the sparse-stage
  indexer KL's target (docs/reference.md section 3) restricted to the selected keys, and it
  never carries a gradient (the main model must not learn from the indexer loss). One extra QK
  pass over the selected rows, per query block, in XLA on every backend.
  """
  check_sparse_mla_inputs(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT)
  topk_BLT = empty_out_of_range(topk_BLT, kv_BSC.shape[1])
  args = jax.lax.stop_gradient((q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, lse_BLH))
  q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, lse_BLH = args
  if query_block is None:
    query_block = _default_query_block(kv_BSC, k_rope_BSR, topk_BLT, q_BLHC.shape[2])

  def one_block(q, q_rope, topk, lse):
    rows = jnp.maximum(topk, 0)
    logits = _logits(q, q_rope, gather_rows(kv_BSC, rows), gather_rows(k_rope_BSR, rows), scale)
    valid = (topk >= 0)[:, :, None, :]
    return jnp.where(valid, jnp.exp(logits - lse[..., None]), 0.0).mean(axis=2)

  return map_query_blocks(one_block, query_block, [q_BLHC, q_rope_BLHR, topk_BLT, lse_BLH],
                          [0, 0, -1, 0.0])
