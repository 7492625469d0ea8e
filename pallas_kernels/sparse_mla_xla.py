"""Sparse MLA in XLA (no Pallas), shaped for a matrix unit: the `xla` row of `dsa_ops`.

The math is `sparse_mla`'s module docstring (forward, lse, the custom-VJP backward, the index
contract). What this path does about the cost of it, per block of queries (issue 40: by the TPU
compiler's own cost model this loop was half the 744B step):

- **One row, one gather.** The latent row and its RoPE key are one `[B, S, K]` array
  (K = C + R = 576, joined once per call), so each selected row is gathered once per query
  block, for all H heads, and feeds every product of that block; a query is likewise one
  `[H, K]` matrix, so the logits are one contraction over K instead of two.
- **bf16 into the matrix unit, fp32 out.** Every product takes the inputs' dtype (the
  gathered rows, `dout`, the probabilities and `ds` cast to it, as flash attention's backward
  does) and accumulates in fp32; no operand is widened to fp32 (a widened `[B, Lb, T, C]` was
  twice the bytes and the compiler's slowest products). fp32 inputs stay fp32 throughout.
- **The key-row gradient as one product over 2H.** `dkv = p^T dout + scale ds^T q` and
  `dk_rope = scale ds^T q_rope` are one contraction of `[p | scale ds]` (2H = 128 rows) with
  `[[dout, 0], [q, q_rope]]` (a contraction over H = 64 alone fills half of a 128-wide unit),
  its K columns padded to P, a multiple of 128, and scatter-added into one fp32 `[B, S, P]`
  accumulator.
- **The indexer KL's target from the attention pass.** `sparse_mla_xla_with_kl_target` also
  returns the head-mean probability at each slot, from the forward's own probabilities, where
  `sparse_mla_head_mean_probs` is a second gather-and-QK pass.
- **Query blocks sized for the platform traced for** (`blocking.platform`: an ahead-of-time
  TPU compile from a CPU host gets the accelerator's blocks, not the host's).

Per-slot key-row contributions are rounded to the inputs' dtype before the fp32 scatter-add
(half the bytes written and read back); the sum itself stays fp32.

Notation (docs/design.md): B batch, L queries, Lb queries per block, S keys (latent rows), H
heads, C latent dim, R RoPE dim, K = C + R, T top-k slots.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.blocking import (default_query_block, empty_out_of_range, from_query_blocks,
                                     gather_rows, map_query_blocks, platform, query_block_size,
                                     round_up, rows_per_device, to_query_blocks)
from pallas_kernels.sparse_mla import (backward_delta, check_sparse_mla_inputs, masked_softmax,
                                      named_residuals, scatter_add_rows)


def _block_size(b: int, t: int, k: int, heads: int) -> int:
  """Queries per block: the backward's temporaries per query are the gathered rows (K, inputs'
  dtype, counted at 4 bytes), four fp32 `[H, T]` arrays and the `[T, K]` contributions."""
  fits = default_query_block(b * t * (2 * k + 4 * heads) * 4, on_accelerator=platform() != "cpu")
  return 1 << (fits.bit_length() - 1)  # a power of two: divides the usual sequence lengths


def _forward_block(c: int, scale: float, with_target: bool, qr_BLHK, kvr_BSK, topk_BLT):
  """One block's `(out_BLHC, lse_BLH, target_BLT or None)`; `topk_BLT` in [0, S) or -1."""
  kvr_BLTK = gather_rows(kvr_BSK, jnp.maximum(topk_BLT, 0))
  logits_BLHT = jnp.einsum("blhk,bltk->blht", qr_BLHK, kvr_BLTK,
                           preferred_element_type=jnp.float32) * scale
  probs_BLHT, lse_BLH = masked_softmax(logits_BLHT, (topk_BLT >= 0)[:, :, None, :])
  out_BLHC = jnp.einsum("blht,bltc->blhc", probs_BLHT.astype(kvr_BSK.dtype), kvr_BLTK[..., :c],
                        preferred_element_type=jnp.float32).astype(kvr_BSK.dtype)
  return out_BLHC, lse_BLH, (probs_BLHT.mean(axis=2) if with_target else None)


def _backward_block(c: int, scale: float, qr_BLHK, kvr_BSK, topk_BLT, dout_BLHC, lse_BLH,
                    delta_BLH):
  """One block's `(dqr_BLHK, dkvr_BLTP)`: the query gradients (fp32, `[dq | dq_rope]`) and
  the per-slot key-row contributions `[dkv | dk_rope | 0]` (inputs' dtype, zero at -1 slots,
  P = K rounded up to 128 columns) to scatter-add."""
  dtype = kvr_BSK.dtype
  kvr_BLTK = gather_rows(kvr_BSK, jnp.maximum(topk_BLT, 0))
  logits_BLHT = jnp.einsum("blhk,bltk->blht", qr_BLHK, kvr_BLTK,
                           preferred_element_type=jnp.float32) * scale
  p_BLHT = jnp.where((topk_BLT >= 0)[:, :, None], jnp.exp(logits_BLHT - lse_BLH[..., None]), 0.0)
  dout_BLHC = dout_BLHC.astype(dtype)
  dp_BLHT = jnp.einsum("blhc,bltc->blht", dout_BLHC, kvr_BLTK[..., :c],
                       preferred_element_type=jnp.float32)
  scaled_ds_BLHT = (scale * p_BLHT * (dp_BLHT - delta_BLH[..., None])).astype(dtype)
  dqr_BLHK = jnp.einsum("blht,bltk->blhk", scaled_ds_BLHT, kvr_BLTK,
                        preferred_element_type=jnp.float32)
  # [dkv | dk_rope] = [p | scale ds]^T [[dout, 0], [q, q_rope]]: one product over 2H rows,
  # its columns padded from K = 576 to a multiple of 128 (unpadded, the TPU compiler wrote the
  # result slot-minor and transposed it for the scatter-add in every block).
  weights_BLGT = jnp.concatenate([p_BLHT.astype(dtype), scaled_ds_BLHT], axis=2)
  k = qr_BLHK.shape[-1]
  pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, round_up(k, 128) - x.shape[-1])])
  values_BLGP = jnp.concatenate([pad(dout_BLHC), pad(qr_BLHK)], axis=2)
  dkvr_BLTP = jnp.einsum("blgt,blgp->bltp", weights_BLGT, values_BLGP,
                         preferred_element_type=jnp.float32)
  return dqr_BLHK, dkvr_BLTP.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _sparse_mla(c, scale, query_block, head_groups, with_target, qr_BLHK, kvr_BSK, topk_BLT):
  return _forward(c, scale, query_block, with_target, qr_BLHK, kvr_BSK, topk_BLT)


def _forward(c, scale, query_block, with_target, qr_BLHK, kvr_BSK, topk_BLT):
  block = functools.partial(_forward_block, c, scale, with_target)
  out_BLHC, lse_BLH, target_BLT = map_query_blocks(
      lambda qr, topk: block(qr, kvr_BSK, topk), query_block, [qr_BLHK, topk_BLT], [0, -1])
  return out_BLHC, lse_BLH, target_BLT


def _vjp_forward(c, scale, query_block, head_groups, with_target, qr_BLHK, kvr_BSK, topk_BLT):
  out_BLHC, lse_BLH, target_BLT = _forward(c, scale, query_block, with_target, qr_BLHK,
                                           kvr_BSK, topk_BLT)
  # Named so a remat policy can keep them ("save_attn_lse": `sparse_mla.named_residuals`).
  out_BLHC, lse_BLH = named_residuals(out_BLHC, lse_BLH)
  return (out_BLHC, lse_BLH, target_BLT), (qr_BLHK, kvr_BSK, topk_BLT, out_BLHC, lse_BLH)


def _vjp_backward(c, scale, query_block, head_groups, with_target, residuals, cotangents):
  """Per query block: `_backward_block` on each group of H / G heads (G = `head_groups`), the
  key-row contributions scatter-added into one fp32 `[B, S, G, P]` accumulator, summed over
  the groups once at the end (with the heads split over G devices, one all-reduce a call, not
  one a block: `sparse_mla.SparseMLAKernels`). The target's cotangent is ignored: the target
  is detached by contract (`sparse_mla_xla_with_kl_target`)."""
  qr_BLHK, kvr_BSK, topk_BLT, out_BLHC, lse_BLH = residuals
  dout_BLHC, dlse_BLH = cotangents[:2]
  (b, l, h, k), s, g = qr_BLHK.shape, kvr_BSK.shape[1], head_groups
  delta_BLH = backward_delta(dout_BLHC, out_BLHC, dlse_BLH)
  block = query_block_size(l, query_block)
  blocked = [to_query_blocks(x, block, pad) for x, pad in
             ((qr_BLHK, 0), (topk_BLT, -1), (dout_BLHC, 0), (lse_BLH, 0.0), (delta_BLH, 0.0))]
  split = lambda x: x.reshape(x.shape[:2] + (g, h // g) + x.shape[3:])  # [B, Lb, G, H/G, ...]
  grouped = jax.vmap(functools.partial(_backward_block, c, scale), out_axes=(2, 3),
                     in_axes=(2, None, None, 2, 2, 2))

  def one_block(dkvr_BSGP, xs):
    qr, topk, dout, lse, delta = xs
    dqr_BLGHK, dkvr_BLTGP = grouped(split(qr), kvr_BSK, topk, split(dout), split(lse),
                                    split(delta))
    dqr = dqr_BLGHK.reshape(qr.shape).astype(qr_BLHK.dtype)
    return scatter_add_rows(dkvr_BSGP, topk, dkvr_BLTGP), dqr

  accumulator = jnp.zeros((b, s, g, round_up(k, 128)), jnp.float32)
  dkvr_BSGP, dqr_nBLHK = jax.lax.scan(one_block, accumulator, blocked)
  # The one sum over the head groups (heads split over a mesh axis: one all-reduce).
  dkvr_BSK = dkvr_BSGP[..., :k].sum(2).astype(kvr_BSK.dtype)
  return from_query_blocks(dqr_nBLHK, l), dkvr_BSK, None


_sparse_mla.defvjp(_vjp_forward, _vjp_backward)


def _run(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale, query_block, head_groups,
         batch_shards, with_target):
  check_sparse_mla_inputs(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT)
  (b, _, h, c), t = q_BLHC.shape, topk_BLT.shape[-1]
  if head_groups < 1 or h % head_groups:
    raise ValueError(f"head_groups={head_groups} must be >= 1 and divide the {h} heads of q "
                     f"{q_BLHC.shape} [B, L, H, C]")
  k = c + q_rope_BLHR.shape[-1]
  if query_block is None:
    query_block = _block_size(rows_per_device(b, batch_shards), t, k, h)
  # Indices outside [0, S) become -1 once: forward, residuals and backward see one selection.
  topk_BLT = empty_out_of_range(topk_BLT, kv_BSC.shape[1])
  qr_BLHK = jnp.concatenate([q_BLHC, q_rope_BLHR.astype(q_BLHC.dtype)], axis=-1)
  kvr_BSK = jnp.concatenate([kv_BSC, k_rope_BSR.astype(kv_BSC.dtype)], axis=-1)
  out_BLHC, lse_BLH, target_BLT = _sparse_mla(c, scale, query_block, head_groups, with_target,
                                              qr_BLHK, kvr_BSK, topk_BLT)
  return out_BLHC, lse_BLH, target_BLT


def sparse_mla_xla(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, *, scale: float,
                   query_block: int | None = None, head_groups: int = 1, batch_shards: int = 1):
  """Sparse MLA without Pallas, per block of queries (module docstring); O(L x T) work and
  O(query_block x T x (K + H)) memory, forward and backward (custom VJP). The default on GPU
  and CPU, and the baseline the kernels are measured against. Same arguments and results as
  `sparse_mla.sparse_mla_reference` (index contract included: out-of-range slots are empty,
  duplicates count twice); `query_block` None: see `_block_size`. `head_groups`: the
  backward's head grouping (`sparse_mla.SparseMLAKernels`); pass the number of devices the
  heads are split over, 1 when they are not split. Any value that divides H gives the same
  gradients (up to fp32 summation order); each group costs one `[B, S, K]` fp32 accumulator.
  `batch_shards`: how many devices XLA's partitioner splits the batch over (`query_block`
  None sizes the blocks by each device's rows, `blocking.rows_per_device`)."""
  out_BLHC, lse_BLH, _ = _run(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale,
                              query_block, head_groups, batch_shards, with_target=False)
  return out_BLHC, lse_BLH


def sparse_mla_xla_with_kl_target(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, *,
                                  scale: float, query_block: int | None = None,
                                  head_groups: int = 1, batch_shards: int = 1):
  """`sparse_mla_xla`'s `(out_BLHC, lse_BLH)` and the indexer KL's target, fp32 `[B, L, T]`:
  what `sparse_mla.sparse_mla_head_mean_probs` computes (the head-mean probability at each
  slot, 0 at empty ones), taken from the attention's own probabilities in the same pass.
  The target is detached: it carries no gradient (the main model must not learn from the
  indexer loss)."""
  out_BLHC, lse_BLH, target_BLT = _run(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale,
                                       query_block, head_groups, batch_shards,
                                       with_target=True)
  return out_BLHC, lse_BLH, jax.lax.stop_gradient(target_BLT)
