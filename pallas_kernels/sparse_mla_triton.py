"""Sparse MLA attention (absorbed / MQA form) as Pallas Triton (GPU) kernels: forward, backward
and split-k decode.

Same math and contract as `sparse_mla.sparse_mla_reference` (that module's docstring has the
equations and the gradients; the package docstring the index contract): slots outside [0, S)
are empty like -1, a row selected twice is two softmax terms and gets the gradients of both, a
query with no valid slot gets a zero output, lse -inf and no gradient.

Forward, grid (B, L, K), one program per query token (and split, K = 1 unless decoding):
  1. All H heads of the token are one `[H, C]` (+ `[H, R]`) tile, loaded once (FlashMLA's sparse
     design): every head attends over the same selected rows, so each gathered row feeds H dot
     products and the gather is paid once per token, not once per head.
  2. Loop over the token's slots in blocks of bt: load the bt indices, gather the rows
     `[bt, C]` from kv and `[bt, R]` from k_rope with array-indexed loads (an empty slot reads
     row 0 and is masked), logits `[H, bt]` on the tensor cores with fp32 accumulation.
  3. Online softmax (running max m, sum l `[H]`, accumulator `[H, C]` in fp32 registers); the
     end writes `out = acc / l`, `lse = m + log l` (-inf where l = 0).
  The loop stops after the last block that holds a valid slot (`n_blocks_BL`, from XLA): the
  indexer pads a short causal row with -1 at the end, so early queries do less work.
Decode (flash-decoding): with few programs (B * L small, e.g. one new token per sequence) the
  T slots are split over K programs per token; each writes a partial (out, lse) in fp32 and XLA
  merges them with a log-sum-exp (`_merge_splits`). K is picked from B * L so that about
  `_TARGET_PROGRAMS` programs run (a Hopper has 132 SMs), or given as `split_k=`.
Head-mean probabilities (`sparse_mla_triton_with_head_probs`, the indexer KL's target): once
  the first sweep has each head's lse, a second sweep over the same slot blocks re-gathers the
  rows, recomputes the logits and writes `mean_h exp(logit - lse)` per slot (`[B, L, T]`
  fp32, 0 at empty slots; padded heads left out of the mean). It costs the logits again,
  2 B L H T (C + R) FLOPs (+53% of the forward's), where the XLA pass it replaces
  (`sparse_mla_head_mean_probs`) gathered `[B, Lq, T, C + R]` into HBM for the same product.
  The head sum cannot ride on the first sweep: each head's running max changes block by block,
  so per-block sums over heads cannot be rescaled afterwards. It can ride on the backward,
  which forms p = exp(logit - lse) from the final lse for every head and slot anyway: with
  `head_probs` (`sparse_mla_triton_parts`, for `glm5_jax.attention.dsa_kl_fused`) each
  backward program also writes its heads' sum / H per slot block (no extra matmul), and a
  differentiated train step runs no second sweep.
Backward (custom VJP), grid (B, L): `delta = rowsum(dout * out) - dlse` in XLA; ONE program per
  token with all H heads (`backward_head_block`, default 64: all of GLM-5's), so each selected
  row is gathered once per token and each key row gets one set of atomics per slot block
  (FlashMLA's / TileLang's sparse backward decomposition). Per slot block of bt rows:
  1. gather kv `[bt, C]` in C / X column chunks of X = `backward_c_chunk` and k_rope `[bt, R]`;
     logits and `dp = dout . kv` `[H, bt]` accumulate over the chunks as ONE `[2H, bt]`
     product against q and dout stacked `[2H, X]` (each warpgroup computes one half), held in
     shared memory for the whole loop (loaded once, as X-column chunks);
  2. `p = exp(logit - lse)`, `ds = p (dp - delta) scale`; dq `[H, C]` (as C / X chunks) and
     dq_rope `[H, R]` accumulate in fp32 registers over the blocks and are written once;
  3. per column chunk of D = `backward_dkv_chunk` (64: half a gather chunk),
     `dkv = p^T dout + ds^T q` `[bt, D]` (q and dout chunks re-read from L2 as right-hand
     operands) and, once, `dk_rope = ds^T q_rope` `[bt, R]`, each added into
     fp32 `[B, S, C]` / `[B, S, R]` buffers with ONE masked vector atomic, cast to the input
     dtype after. The atomic is relaxed (`pallas_kernels.triton_atomics`; option
     `backward_atomic_order`): Triton 3.6 emits `atom.global.gpu.relaxed.add.v4.f32`, which
     ptxas makes a fire-and-forget `REDG.E.ADD.F32x4`, where `plgpu.atomic_add`'s acq_rel
     order put a GPU-wide memory barrier and an L1 invalidation at every atomic (H200,
     L = S = 4,096: 51.3 -> 31.4 ms for the backward alone at bt 16; docs/performance.md).
  Why this fits a Hopper SM (228 KiB shared memory, 64K registers; GLM-5: H 64, C 512, R 64,
  X 128, 8 warps = 256 threads, so at most 255 registers a thread; the arithmetic below is at
  bt 16, the largest block without spills; the default bt 32 is measured faster, see
  `TritonMLAOptions`):
    registers: dq `[64, 512]` fp32 = 128 KiB = 128 a thread, dq_rope `[64, 64]` fp32 = 16; the
      per-block tiles are small (logits, dp, p, ds `[64, 16]` fp32: 4 each; a dkv chunk
      `[16, 64]` fp32: 4, still one 16-byte atomic a thread; dk_rope 4), and gathering in
      X-column chunks keeps the gather's `[bt, C]` address and value tiles out of registers;
    shared memory: q and dout `[64, 512]` bf16 = 64 KiB each, q_rope 8 KiB (stacked with
      zeros for the logits: 16, and once more for dk_rope), a gathered block `[16, 576]` bf16 =
      18 KiB, the re-read dkv operand chunks `[64, 64]` bf16 = 8 KiB each: 178 KiB as
      compiled.
  The two uses of q (left operand of the logits, right operand of `ds^T q`) and of dout need
  different shared layouts, and Triton allocates one buffer per layout: holding both would be
  4 x 64 KiB, over the limit (the 264-408 KiB that made the first all-heads backward unable to
  launch). Hence the re-reads from L2 for the dkv products (2 x 64 KiB per slot block, beside the
  18 KiB gather). What is invariant in the slot loop LLVM hoists out of it and keeps live
  through it (wgmma descriptors, address tensors), so the kernel keeps that set small
  (`_backward_kernel`'s comment). As compiled offline (Triton 3.6, sm_90a, after the TTIR
  passes the GPU's pipeline runs first; `tools/check_triton_compile.py`), with and without the
  head sums: 255 registers, 0 bytes of spills, 178 KiB of shared memory at bt 16; 44 / 28
  bytes of spill stores / loads (12 / 12 with the head sums; 3 local-memory instructions in the
  slot loop) and 204 KiB at bt 32; docs/performance.md.
  dkv / dk_rope are bitwise NON-deterministic on GPU (the atomics land in a varying order:
  run-to-run differences within fp32 rounding of the sum); dq, dq_rope, out and lse are
  deterministic. Many queries selecting one key (e.g. the first tokens) serialize their
  atomics on that row. With `backward_head_block` hb < H (more heads than fit, or for timing),
  H / hb programs per token each add their heads' share of the key-row gradients.

Interpret mode (CPU tests): the discharge of a vector `atomic_add` in interpret mode takes no
mask and, for duplicate addresses within one call, keeps one update (it is gather, add, set),
so in interpret mode the rows are added one at a time (`_add_rows`); the GPU issues one masked
vector atomic per block. The CUDA lowering of the vector form is checked on CPU by the tests;
Triton's own compiler (ptxas) and real-GPU numbers are left to the device suite.

Triton block rules: every block dim a power of two and every dot operand >= 16 per dim, so H,
C, R are zero-padded to powers of two >= 16 (no-ops at GLM-5's H=64, C=512, R=64; padded heads
have zero queries and zero cotangents, so they change nothing) and T to a multiple of bt with
-1 slots.

Notation (docs/design.md): B batch, L queries, S keys, H heads, C latent dim, R RoPE dim,
T top-k slots, bt slots per block, K splits of the slots per token (decode).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import triton_atomics
from pallas_kernels.blocking import MASKED_LOGIT, empty_out_of_range, pad_axis, round_up
from pallas_kernels.sparse_mla import (SparseMLAParts, backward_delta,
                                       check_sparse_mla_inputs, named_residuals)

_NT = (((1,), (1,)), ((), ()))  # [m, k] x [n, k] -> [m, n]
_TN = (((0,), (0,)), ((), ()))  # [k, m] x [k, n] -> [m, n]
_F32 = jnp.float32
# Decode splits the slots until about this many programs run: about two waves on a 132-SM H100
# (one program per SM fits at the default blocks' ~144 KiB of shared memory), so no SM idles
# while a few finish a long row.
_TARGET_PROGRAMS = 256


@dataclasses.dataclass(frozen=True)
class TritonMLAOptions:
  """Block sizes and launch parameters (keywords of `sparse_mla_triton`).

  Hopper defaults (H100 / H200: 228 KiB shared memory and 64K 32-bit registers per SM):
    block_t=32, num_warps=8, num_stages=2 (forward): the fp32 accumulator `[64, 512]` is 128 KiB
      of registers, 128 per thread with 8 warps (4 warps would spill); a gathered block is
      32 x (512 + 64) bf16 = 36 KiB of shared memory, two of them in flight (num_stages=2) plus
      the 72 KiB query tile stay well under 228 KiB; bt=64 would double that and leave no
      room for a third stage.
    backward_head_block=64, backward_block_t=32, backward_c_chunk=128, backward_dkv_chunk=64,
      backward_num_warps=8, backward_num_stages=1, backward_atomic_order="relaxed": all of
      GLM-5's heads in one program per token (module docstring: the register and shared-memory
      arithmetic). Measured on an H200 (tools/tune_sparse_mla.py, L = S = 4,096, the backward
      alone; docs/device_runs/2026-11-30-h200.md): bt 32 20.3 ms, bt 16 31.4 ms, bt 16 with
      D 128 25.6 ms, 32 heads per program at bt 32 (two programs per token) 35.0 ms, all with
      relaxed atomics; with acq_rel atomics 37.0 / 51.3 / 42.2 / 68.5 ms. Offline (Triton 3.6,
      sm_90a, GLM-5 shapes) bt 16 X 128 D 64 is the all-heads point without spills (255
      registers, 178 KiB); bt 32 spills 44 / 28 bytes (3 local-memory instructions in the slot
      loop) at 204 KiB and is still the fastest: half as many slot blocks, so half the
      per-block work of the loop (the q and dout re-reads, the dq updates, the atomics).
    split_k: None = automatic (`_auto_split`); 1 = never split; K = split the slots over K
      programs per token (forward only; the backward is never split).
  """

  block_t: int = 32
  num_warps: int = 8
  num_stages: int = 2
  backward_head_block: int = 64
  backward_block_t: int = 32
  backward_num_warps: int = 8
  backward_num_stages: int = 1
  backward_c_chunk: int = 128
  backward_dkv_chunk: int = 64
  backward_atomic_order: str = "relaxed"
  split_k: int | None = None
  interpret: bool = False


def sparse_mla_flops(b: int, l: int, h: int, c: int, r: int, t: int, backward: bool = False):
  """Matmul FLOPs of one pass (2 per multiply-add), for TFLOP/s reports.

  Forward: logits `q . kv + q_rope . k_rope` (C + R) and `p . kv` (C) per (query, head, slot):
  2 B L H T (2C + R). Backward only (not forward + backward): the recomputed logits (C + R),
  `dout . kv` (C), dq (C), dq_rope (R), dkv `p dout + ds q` (2C), dk_rope (R):
  2 B L H T (5C + 3R). Pass as `t` the slots counted: the selection width for nominal FLOP/s,
  the number of valid slots for achieved ones (the kernels skip trailing empty blocks).
  """
  per_slot = (5 * c + 3 * r) if backward else (2 * c + r)
  return 2 * b * l * h * t * per_slot


def _pow2(n: int, floor: int = 16) -> int:
  """The smallest power of two >= max(n, floor) (Triton blocks; dot operands >= 16)."""
  return max(floor, 1 << (n - 1).bit_length())


def _slot_block(t: int, block_t: int, name: str) -> int:
  """Slots per block: `block_t` (option `name`), or less when T itself is smaller."""
  if block_t < 16 or block_t & (block_t - 1):
    raise ValueError(f"sparse_mla_triton: {name}={block_t} must be a power of two >= 16 "
                     "(Triton block dims are powers of two; dot operands >= 16)")
  return min(block_t, _pow2(t))


def _head_block(padded_heads: int, head_block: int) -> int:
  """Heads per backward program: `backward_head_block`, or all heads when there are fewer."""
  if head_block < 16 or head_block & (head_block - 1):
    raise ValueError(f"sparse_mla_triton: backward_head_block={head_block} must be a power of "
                     "two >= 16 (Triton block dims are powers of two; dot operands >= 16)")
  return min(head_block, padded_heads)


def _auto_split(programs: int, num_blocks: int) -> int:
  """Splits per token (a power of two, at most one per slot block) so that about
  `_TARGET_PROGRAMS` programs run; 1 for prefill / training (B * L is large)."""
  k = 1
  while programs * k < _TARGET_PROGRAMS and 2 * k <= num_blocks:
    k *= 2
  return k


def _gather(topk_ref, kv_ref, k_rope_ref, b, l, j, bt):
  """Slot block j of token (b, l): indices `[bt]`, their validity, rows `[bt, C]`, `[bt, R]`."""
  rows_T = topk_ref[b, l, pl.ds(j * bt, bt)]
  valid_T = rows_T >= 0
  safe_T = jnp.where(valid_T, rows_T, 0)  # an empty slot reads row 0; its logit is masked
  return safe_T, valid_T, kv_ref[b, safe_T, :], k_rope_ref[b, safe_T, :]


def _logits(q_HC, q_rope_HR, kv_TC, k_rope_TR, valid_T, scale):
  """Masked fp32 logits `[H, bt]` (empty slots MASKED_LOGIT, never -inf: no inf - inf)."""
  s_HT = (jax.lax.dot_general(q_HC, kv_TC, _NT, preferred_element_type=_F32)
          + jax.lax.dot_general(q_rope_HR, k_rope_TR, _NT, preferred_element_type=_F32)) * scale
  return jnp.where(valid_T[None, :], s_HT, MASKED_LOGIT)


def _forward_kernel(n_blocks_ref, topk_ref, q_ref, q_rope_ref, kv_ref, k_rope_ref, out_ref,
                    lse_ref, *probs_ref, scale, bt, blocks_per_split, heads):
  b, l, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  q_HC, q_rope_HR = q_ref[...], q_rope_ref[...]
  h, c = q_HC.shape

  def block(j, carry):
    m_H, l_H, acc_HC = carry
    _, valid_T, kv_TC, k_rope_TR = _gather(topk_ref, kv_ref, k_rope_ref, b, l, j, bt)
    s_HT = _logits(q_HC, q_rope_HR, kv_TC, k_rope_TR, valid_T, scale)
    m_next_H = jnp.maximum(m_H, s_HT.max(axis=1))
    alpha_H = jnp.exp(m_H - m_next_H)
    p_HT = jnp.where(valid_T[None, :], jnp.exp(s_HT - m_next_H[:, None]), 0.0)
    acc_HC = alpha_H[:, None] * acc_HC + jnp.dot(p_HT.astype(kv_TC.dtype), kv_TC,
                                                 preferred_element_type=_F32)
    return m_next_H, alpha_H * l_H + p_HT.sum(axis=1), acc_HC

  # This split's slot blocks, cut at the token's last block with a valid slot.
  start = k * blocks_per_split
  stop = jnp.minimum(start + blocks_per_split, n_blocks_ref[b, l])
  init = (jnp.full((h,), MASKED_LOGIT, _F32), jnp.zeros((h,), _F32), jnp.zeros((h, c), _F32))
  m_H, l_H, acc_HC = jax.lax.fori_loop(start, stop, block, init)
  safe_l_H = jnp.where(l_H > 0, l_H, 1.0)
  out_ref[...] = (acc_HC / safe_l_H[:, None]).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(l_H > 0, m_H + jnp.log(safe_l_H), -jnp.inf)
  if probs_ref:
    _head_mean_probs(probs_ref[0], topk_ref, q_HC, q_rope_HR, kv_ref, k_rope_ref,
                     m_H + jnp.log(safe_l_H), b, l, stop, scale=scale, bt=bt, heads=heads)


def _head_mean_probs(probs_ref, topk_ref, q_HC, q_rope_HR, kv_ref, k_rope_ref, lse_H, b, l,
                     n_blocks, *, scale, bt, heads):
  """The second pass of the forward (`head_probs`): `mean_h exp(logit - lse)` per slot, fp32,
  over the first `heads` heads (the rest are padding), 0 at empty slots and past the token's
  last valid block. Needs the final lse, hence the second sweep over the slot blocks: it
  re-gathers the rows (L2-resident from the first sweep at training lengths) and repeats the
  logits, not the `p . kv` product."""
  real_H = jax.lax.broadcasted_iota(jnp.int32, lse_H.shape, 0) < heads

  def block(j, _):
    _, valid_T, kv_TC, k_rope_TR = _gather(topk_ref, kv_ref, k_rope_ref, b, l, j, bt)
    s_HT = _logits(q_HC, q_rope_HR, kv_TC, k_rope_TR, valid_T, scale)
    p_HT = jnp.where(valid_T[None, :] & real_H[:, None], jnp.exp(s_HT - lse_H[:, None]), 0.0)
    probs_ref[b, l, pl.ds(j * bt, bt)] = p_HT.sum(axis=0) / heads

  def zero_block(j, _):
    probs_ref[b, l, pl.ds(j * bt, bt)] = jnp.zeros((bt,), _F32)

  jax.lax.fori_loop(0, n_blocks, block, None)
  jax.lax.fori_loop(n_blocks, topk_ref.shape[2] // bt, zero_block, None)


def _add_rows(acc_ref, b, rows_T, valid_T, vals_TX, interpret, order, col0=0):
  """`acc[b, rows[i]] += vals[i]` for the valid slots i, atomically (duplicates accumulate),
  with memory order `order` (`pallas_kernels.triton_atomics`).

  GPU: one masked vector atomic over `[bt, X]` addresses. Interpret mode: row by row (module
  docstring: its vector atomic neither takes a mask nor accumulates duplicate addresses)."""
  if not interpret:
    cols_X = col0 + jax.lax.broadcasted_iota(jnp.int32, (1, vals_TX.shape[1]), 1)
    mask_TX = jnp.broadcast_to(valid_T[:, None], vals_TX.shape)
    triton_atomics.atomic_add(acc_ref, (b, rows_T[:, None], cols_X), vals_TX, mask=mask_TX,
                              order=order)
    return

  def one_row(i, _):
    val_X = jnp.where(valid_T[i], vals_TX[i], 0.0)
    triton_atomics.atomic_add(acc_ref, (b, rows_T[i], pl.ds(col0, vals_TX.shape[1])), val_X,
                              order=order)

  jax.lax.fori_loop(0, rows_T.shape[0], one_row, None)


def _backward_kernel(n_blocks_ref, topk_ref, q_ref, q_rope_ref, dout_ref, lse_ref, delta_ref,
                     kv_ref, k_rope_ref, _dkv_in, _dk_rope_in, first_row_ref, dq_ref, dq_rope_ref,
                     dkv_ref, dk_rope_ref, *probs_ref, scale, bt, c_chunk, dkv_cols, interpret,
                     heads, padded_heads, atomic_order):
  # _dkv_in / _dk_rope_in are the zero buffers aliased to dkv_ref / dk_rope_ref. probs_ref
  # (`head_probs`): `[B, L, G, T]` fp32, this head block's share of the head-mean probabilities
  # (`_backward`'s docstring); `heads` the real head count, `padded_heads` whether H was padded.
  # Register pressure (module docstring, "Why this fits"): every value that is invariant in the
  # slot loop is hoisted out of it by LLVM and stays live through it, beside dq's 144 registers.
  # So: (1) q and dout are stacked into one `[2H, X]` operand per chunk (P = 2H rows), and the
  # logits and dP are ONE `[2H, bt]` product: each warpgroup computes its half, where two `[H, bt]`
  # products laid out by Triton over both warpgroups ran twice, with 140 loop-invariant wgmma
  # descriptors instead of 36; (2) first_row_ref (`[1]` int32 holding 0) is read in the loop (and
  # after it) as the first head row of the q / dout re-reads, of lse and delta, and of the dq
  # stores: an offset read from memory there cannot be hoisted (the loop's atomics may write it),
  # so their address tensors are rebuilt where they are used, a few integer ops; it is read
  # again for each key-row gradient chunk, after the previous chunk's atomics, so one chunk's
  # re-reads are not issued early beside another's; (3) the key-row gradient is formed in
  # chunks of `dkv_cols` (`backward_dkv_chunk`, 64) columns, half a gather chunk: its `mma.sync`
  # operands (dout and q `[H, 64]`, split over the 8 warps) and accumulator take half the
  # registers, and a `[16, 64]` fp32 block is still 4 floats a thread, one 16-byte atomic. Offline, with the TTIR passes the GPU runs (docs/performance.md):
  # 92 -> 0 bytes of spills a thread (the head-probs variant 8 -> 0); each of (2)'s lse / delta
  # read, (2)'s per-chunk read and (3) alone leaves 16-92 bytes.
  b, l, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  h, c = q_ref.shape
  chunks = [pl.ds(c0, c_chunk) for c0 in range(0, c, c_chunk)]
  dkv_chunks = [pl.ds(c0, dkv_cols) for c0 in range(0, c, dkv_cols)]
  q_rope_HR = q_rope_ref[...]
  stack = lambda top, bottom: jnp.stack([top, bottom], axis=-1).transpose(2, 0, 1).reshape(
      (2 * top.shape[0],) + top.shape[1:])  # [H, X] twice -> [2H, X]
  qd_nPX = [stack(q_ref[:, x], dout_ref[:, x]) for x in chunks]
  qd_rope_PR = stack(q_rope_HR, jnp.zeros_like(q_rope_HR))  # dP has no RoPE term

  def block(j, carry):
    dq_nHX, dq_rope_HR = carry
    rows_T = topk_ref[b, l, pl.ds(j * bt, bt)]
    valid_T = rows_T >= 0
    safe_T = jnp.where(valid_T, rows_T, 0)
    kv_nTX = [kv_ref[b, safe_T, x] for x in chunks]
    k_rope_TR = k_rope_ref[b, safe_T, :]
    sdp_PT = jax.lax.dot_general(qd_rope_PR, k_rope_TR, _NT, preferred_element_type=_F32)
    for qd_PX, kv_TX in zip(qd_nPX, kv_nTX):
      sdp_PT += jax.lax.dot_general(qd_PX, kv_TX, _NT, preferred_element_type=_F32)
    # The two halves, exactly (a sum with a zero): a reduction over the stacked axis keeps the
    # halves spread over the warps, where `jnp.split` left each one in every warp (604 B spilled).
    sdp_2HT = sdp_PT.reshape(2, h, bt)
    top_2 = (jax.lax.broadcasted_iota(jnp.int32, (2, 1, 1), 0) == 0)
    s_HT = jnp.where(top_2, sdp_2HT, 0.0).sum(axis=0)
    dp_HT = jnp.where(top_2, 0.0, sdp_2HT).sum(axis=0)
    lse_H, delta_H = (x_ref[pl.ds(first_row_ref[0], h)] for x_ref in (lse_ref, delta_ref))
    s_HT = jnp.where(valid_T[None, :], s_HT * scale, MASKED_LOGIT)
    p_HT = jnp.where(valid_T[None, :], jnp.exp(s_HT - lse_H[:, None]), 0.0)
    ds_HT = p_HT * (dp_HT - delta_H[:, None]) * scale  # the logits' scale folded in once
    if probs_ref:  # the row offset read in the loop, as (2) above
      _store_head_sum(probs_ref[0], p_HT, b + first_row_ref[0], l, g, j, bt, heads,
                      padded_heads)
    p16_HT, ds16_HT = p_HT.astype(kv_ref.dtype), ds_HT.astype(kv_ref.dtype)
    dq_nHX = [dq + jnp.dot(ds16_HT, kv_TX, preferred_element_type=_F32)
              for dq, kv_TX in zip(dq_nHX, kv_nTX)]
    dq_rope_HR += jnp.dot(ds16_HT, k_rope_TR, preferred_element_type=_F32)
    for x in dkv_chunks:
      heads_H = pl.ds(first_row_ref[0], h)  # (2): read after the previous chunk's atomics
      dkv_TX = (jax.lax.dot_general(p16_HT, dout_ref[heads_H, x], _TN,
                                    preferred_element_type=_F32)
                + jax.lax.dot_general(ds16_HT, q_ref[heads_H, x], _TN,
                                      preferred_element_type=_F32))
      _add_rows(dkv_ref, b, rows_T, valid_T, dkv_TX, interpret, atomic_order, x.start)
    dk_rope_TR = jax.lax.dot_general(ds16_HT, q_rope_HR, _TN, preferred_element_type=_F32)
    _add_rows(dk_rope_ref, b, rows_T, valid_T, dk_rope_TR, interpret, atomic_order)
    return dq_nHX, dq_rope_HR

  init = ([jnp.zeros((h, c_chunk), _F32) for _ in chunks], jnp.zeros(q_rope_HR.shape, _F32))
  dq_nHX, dq_rope_HR = jax.lax.fori_loop(0, n_blocks_ref[b, l], block, init)
  if probs_ref:  # the slot blocks past the token's last valid one
    jax.lax.fori_loop(n_blocks_ref[b, l], topk_ref.shape[2] // bt,
                      lambda j, _: _store_zeros(probs_ref[0], b, l, g, j, bt), None)
  # The stores' addresses are built here, not kept through the loop; the column offset is a
  # multiple of c_chunk, so Triton still knows its alignment and vectorizes the stores.
  row0 = first_row_ref[0]
  for x, dq_HX in zip(chunks, dq_nHX):
    dq_ref[pl.ds(row0, h), pl.ds(row0 * c_chunk + x.start, c_chunk)] = dq_HX.astype(dq_ref.dtype)
  dq_rope_ref[pl.ds(row0, h), :] = dq_rope_HR.astype(dq_rope_ref.dtype)


def _store_head_sum(probs_ref, p_HT, b, l, g, j, bt, heads, padded_heads):
  """`probs[b, l, g, j-th slot block] = sum_h p[h] / heads` over this program's real heads (g
  its head block; heads past `heads` are padding, with uniform p, left out)."""
  h = p_HT.shape[0]
  if padded_heads:  # static: no mask at GLM-5's 64 heads
    real_H = g * h + jax.lax.broadcasted_iota(jnp.int32, (h, 1), 0) < heads
    p_HT = jnp.where(real_H, p_HT, 0.0)
  probs_ref[b, l, g, pl.ds(j * bt, bt)] = p_HT.sum(axis=0) / heads


def _store_zeros(probs_ref, b, l, g, j, bt):
  probs_ref[b, l, g, pl.ds(j * bt, bt)] = jnp.zeros((bt,), _F32)


def _padded(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, bt):
  """Inputs padded to Triton blocks (H, C, R to powers of two >= 16, T to a multiple of bt
  with -1), and `n_blocks_BL`: the slot blocks up to the last valid slot of each token."""
  hp, cp, rp = (_pow2(n) for n in (q_BLHC.shape[2], q_BLHC.shape[3], q_rope_BLHR.shape[3]))
  t_pad = round_up(topk_BLT.shape[-1], bt)
  topk_BLT = pad_axis(topk_BLT.astype(jnp.int32), 2, t_pad, -1)
  last_BL = jnp.max(jnp.where(topk_BLT >= 0, jnp.arange(t_pad, dtype=jnp.int32), -1), axis=-1)
  n_blocks_BL = (last_BL + bt) // bt  # 0 for a token with no valid slot
  pad_hx = lambda x, x_dim: pad_axis(pad_axis(x, 2, hp, 0), 3, x_dim, 0)
  return (pad_hx(q_BLHC, cp), pad_hx(q_rope_BLHR, rp), pad_axis(kv_BSC, 2, cp, 0),
          pad_axis(k_rope_BSR, 2, rp, 0), topk_BLT, n_blocks_BL)


def _merge_splits(out_BLKHC, lse_BLKH):
  """Flash-decoding merge of K partial results, each normalized over its own slots:
  `lse = log sum_k exp(lse_k)`, `out = sum_k exp(lse_k - lse) out_k` (-inf / 0 if all empty)."""
  m_BLH = jnp.max(lse_BLKH, axis=2)
  safe_m_BLH = jnp.where(jnp.isfinite(m_BLH), m_BLH, 0.0)
  w_BLKH = jnp.exp(lse_BLKH - safe_m_BLH[:, :, None])  # exp(-inf) = 0 for an empty split
  total_BLH = w_BLKH.sum(axis=2)
  safe_total_BLH = jnp.where(total_BLH > 0, total_BLH, 1.0)
  out_BLHC = jnp.einsum("blkh,blkhc->blhc", w_BLKH / safe_total_BLH[:, :, None], out_BLKHC)
  lse_BLH = jnp.where(total_BLH > 0, safe_m_BLH + jnp.log(safe_total_BLH), -jnp.inf)
  return out_BLHC, lse_BLH


def _forward(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale, opts, head_probs=False):
  """`(out, lse)`, plus the head-mean probabilities `[B, L, T]` (fp32) with `head_probs`."""
  b, l, h, c = q_BLHC.shape
  bt = _slot_block(topk_BLT.shape[-1], opts.block_t, "block_t")
  q, q_rope, kv, k_rope, topk, n_blocks = _padded(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR,
                                                   topk_BLT, bt)
  hp, cp, rp = q.shape[2], q.shape[3], q_rope.shape[3]
  t_pad = topk.shape[-1]
  num_blocks = t_pad // bt
  if head_probs and opts.split_k not in (None, 1):
    raise ValueError(f"sparse_mla_triton: split_k={opts.split_k} with head_probs; the head "
                     "probabilities need each token's final lse in one program (split_k=1)")
  k = 1 if head_probs else _auto_split(b * l, num_blocks) if opts.split_k is None else (
      opts.split_k)
  if k < 1:
    raise ValueError(f"sparse_mla_triton: split_k={opts.split_k} must be >= 1 (or None)")
  token = lambda *block: pl.BlockSpec((None, None) + block, lambda bi, li, ki: (bi, li, 0, 0))
  split = lambda *block: pl.BlockSpec((None, None, None) + block,
                                      lambda bi, li, ki: (bi, li, ki) + (0,) * len(block))
  # One split writes the output directly (kv's dtype); several write fp32 partials to merge.
  out_dtype = kv_BSC.dtype if k == 1 else _F32
  out_shape = [jax.ShapeDtypeStruct((b, l, k, hp, cp), out_dtype),
               jax.ShapeDtypeStruct((b, l, k, hp), _F32)]
  out_specs = [split(hp, cp), split(hp)]
  if head_probs:  # written slot block by slot block, at dynamic offsets: the whole array
    out_shape.append(jax.ShapeDtypeStruct((b, l, t_pad), _F32))
    out_specs.append(pl.no_block_spec)
  outs = pl.pallas_call(
      functools.partial(_forward_kernel, scale=scale, bt=bt,
                        blocks_per_split=-(-num_blocks // k), heads=h),
      out_shape=tuple(out_shape),
      grid=(b, l, k),
      in_specs=[pl.no_block_spec, pl.no_block_spec, token(hp, cp), token(hp, rp),
                pl.no_block_spec, pl.no_block_spec],
      out_specs=tuple(out_specs),
      compiler_params=plgpu.CompilerParams(num_warps=opts.num_warps,
                                           num_stages=opts.num_stages),
      interpret=opts.interpret,
      # The name tells the FLOP ledger (glm5_jax.planning.flop_ledger) of the second sweep.
      name="sparse_mla_triton_forward" + ("_head_probs" if head_probs else ""),
  )(n_blocks, topk, q, q_rope, kv, k_rope)
  out_BLKHC, lse_BLKH = outs[:2]
  if k == 1:
    out_BLHC, lse_BLH = out_BLKHC[:, :, 0], lse_BLKH[:, :, 0]
  else:
    out_BLHC, lse_BLH = _merge_splits(out_BLKHC, lse_BLKH)
  results = (out_BLHC[:, :, :h, :c].astype(kv_BSC.dtype), lse_BLH[:, :, :h])
  return results + ((outs[2][:, :, :topk_BLT.shape[-1]],) if head_probs else ())


def _backward(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, dout_BLHC, lse_BLH, delta_BLH,
              scale, opts, head_probs=False):
  """Returns `(dq, dq_rope, dkv, dk_rope)` in the dtypes of q, q_rope, kv, k_rope; with
  `head_probs` also the head-mean probabilities `[B, L, T]` fp32 (`sparse_mla_head_mean_probs`'s
  values) from the p the kernel forms anyway: each program writes its head block's sum / H per
  slot block (`[B, L, G, T]`, G = H / hb), summed over G here."""
  (b, l, h, c), (s, r) = q_BLHC.shape, k_rope_BSR.shape[1:]
  if opts.backward_atomic_order not in triton_atomics.ORDERS:
    raise ValueError(f"sparse_mla_triton: backward_atomic_order={opts.backward_atomic_order!r}, "
                     f"expected one of {triton_atomics.ORDERS}")
  bt = _slot_block(topk_BLT.shape[-1], opts.backward_block_t, "backward_block_t")
  q, q_rope, kv, k_rope, topk, n_blocks = _padded(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR,
                                                   topk_BLT, bt)
  hp, cp, rp = q.shape[2], q.shape[3], q_rope.shape[3]
  hb = _head_block(hp, opts.backward_head_block)
  c_chunk = min(cp, _slot_block(opts.backward_c_chunk, opts.backward_c_chunk,
                                "backward_c_chunk"))  # divides cp: both powers of two
  dkv_cols = min(c_chunk, _slot_block(opts.backward_dkv_chunk, opts.backward_dkv_chunk,
                                      "backward_dkv_chunk"))  # divides c_chunk
  dout = pad_axis(pad_axis(dout_BLHC, 2, hp, 0), 3, cp, 0)
  # Padded heads: lse 0 and delta 0 with zero q and dout give them p finite, ds = 0.
  lse, delta = (pad_axis(x.astype(_F32), 2, hp, 0.0) for x in (lse_BLH, delta_BLH))
  # One program per (token, block of hb heads); the heads axis is the block's first dim.
  heads = lambda *block: pl.BlockSpec((None, None) + block,
                                      lambda bi, li, hi: (bi, li, hi) + (0,) * (len(block) - 1))
  out_shape = [jax.ShapeDtypeStruct((b, l, hp, cp), q_BLHC.dtype),
               jax.ShapeDtypeStruct((b, l, hp, rp), q_rope_BLHR.dtype),
               jax.ShapeDtypeStruct((b, s, cp), _F32),
               jax.ShapeDtypeStruct((b, s, rp), _F32)]
  out_specs = [heads(hb, cp), heads(hb, rp), pl.no_block_spec, pl.no_block_spec]
  if head_probs:  # written slot block by slot block, at dynamic offsets: the whole array
    out_shape.append(jax.ShapeDtypeStruct((b, l, hp // hb, topk.shape[-1]), _F32))
    out_specs.append(pl.no_block_spec)
  outs = pl.pallas_call(
      functools.partial(_backward_kernel, scale=scale, bt=bt, c_chunk=c_chunk,
                        dkv_cols=dkv_cols, interpret=opts.interpret, heads=h,
                        padded_heads=hp != h, atomic_order=opts.backward_atomic_order),
      out_shape=tuple(out_shape),
      grid=(b, l, hp // hb),
      in_specs=[pl.no_block_spec, pl.no_block_spec, heads(hb, cp), heads(hb, rp),
                heads(hb, cp), heads(hb), heads(hb)] + [pl.no_block_spec] * 5,
      out_specs=tuple(out_specs),
      input_output_aliases={9: 2, 10: 3},  # the zeroed fp32 accumulators are the dkv outputs
      compiler_params=plgpu.CompilerParams(num_warps=opts.backward_num_warps,
                                           num_stages=opts.backward_num_stages),
      interpret=opts.interpret,
      # The FLOP ledger (glm5_jax.planning.flop_ledger) prices both names alike.
      name="sparse_mla_triton_backward" + ("_head_probs" if head_probs else ""),
  )(n_blocks, topk, q, q_rope, dout, lse, delta, kv, k_rope,
    jnp.zeros((b, s, cp), _F32), jnp.zeros((b, s, rp), _F32), jnp.zeros((1,), jnp.int32))
  dq, dq_rope, dkv, dk_rope = outs[:4]
  grads = (dq[:, :, :h, :c], dq_rope[:, :, :h, :r], dkv[:, :, :c].astype(kv_BSC.dtype),
           dk_rope[:, :, :r].astype(k_rope_BSR.dtype))
  return grads + ((outs[4].sum(axis=2)[:, :, :topk_BLT.shape[-1]],) if head_probs else ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _sparse_mla(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale, opts, head_probs):
  return _forward(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale, opts, head_probs)


def _vjp_forward(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale, opts, head_probs):
  outs = _forward(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale, opts, head_probs)
  # Named so a remat policy can keep them (`sparse_mla.named_residuals`).
  out_BLHC, lse_BLH = named_residuals(*outs[:2])
  return (out_BLHC, lse_BLH, *outs[2:]), (q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT,
                                          out_BLHC, lse_BLH)


def _backward_from_cotangents(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, out_BLHC,
                              lse_BLH, dout_BLHC, dlse_BLH, scale, opts, head_probs=False):
  """`_backward` from the cotangents of out and lse: `(dq, dq_rope, dkv, dk_rope[, probs])`."""
  # d lse / d logit = p, so the lse cotangent enters as a shift of delta.
  delta_BLH = backward_delta(dout_BLHC, out_BLHC, dlse_BLH)
  return _backward(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT,
                   dout_BLHC.astype(q_BLHC.dtype), lse_BLH, delta_BLH, scale, opts, head_probs)


def _vjp_backward(scale, opts, head_probs, residuals, cotangents):
  # The head probabilities are a detached target (`sparse_mla_head_mean_probs`): their
  # cotangent, cotangents[2] with head_probs, is dropped.
  del head_probs
  grads = _backward_from_cotangents(*residuals, *cotangents[:2], scale, opts)
  return grads + (None,)


_sparse_mla.defvjp(_vjp_forward, _vjp_backward)


def sparse_mla_triton(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, *, scale: float,
                      interpret: bool = False, **block_options):
  """`sparse_mla_reference` (same arguments, results and index contract) on the Triton kernels
  of the module docstring; differentiable in q, q_rope, kv, k_rope (custom VJP).

  Args (beyond the reference's):
    interpret: run the kernels in Pallas interpret mode (CPU tests) instead of compiling them
      for the GPU.
    block_options: `TritonMLAOptions` fields (block_t, num_warps, num_stages,
      backward_head_block, backward_block_t, backward_c_chunk, backward_dkv_chunk,
      backward_num_warps, backward_num_stages, split_k).
  Returns:
    `(out_BLHC, lse_BLH)`: out in kv's dtype, lse fp32 (-inf for a query with no valid slot).
  Unlike the reference, the four float inputs must share one dtype (bf16 on GPU; fp32 runs the
  dots in IEEE fp32, slowly).
  """
  args, scale, opts = _checked(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale,
                               interpret, block_options)
  return _sparse_mla(*args, scale, opts, False)


def sparse_mla_triton_with_head_probs(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, *,
                                      scale: float, interpret: bool = False, **block_options):
  """`sparse_mla_triton` that also returns the indexer KL's target from its forward kernel:
  `(out_BLHC, lse_BLH, probs_BLT)`, probs = `sparse_mla_head_mean_probs` (fp32 head-mean
  probability at each slot, 0 at empty slots), computed in a second sweep of the forward
  program once each head's lse is final (module docstring), so no XLA pass gathers the rows
  again. probs carries no gradient (a detached target, as the XLA function's). The forward
  runs unsplit (split_k None or 1)."""
  args, scale, opts = _checked(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale,
                               interpret, block_options)
  return _sparse_mla(*args, scale, opts, True)


def sparse_mla_triton_parts(*, interpret: bool = False, **block_options) -> SparseMLAParts:
  """The Triton kernels as `sparse_mla.SparseMLAParts`, for a custom VJP of the caller's (the
  sparse stage's attention and indexer KL as one, `glm5_jax.attention.dsa_kl_fused`): the
  forward (`head_probs=True`: with its second sweep, the indexer KL's target), and the
  backward that also returns the head-mean probabilities from its own p, so a differentiated
  step needs no second sweep. Arguments are taken as checked: one float dtype, indices already
  -1 outside [0, S) (`blocking.empty_out_of_range`). Options as `sparse_mla_triton`'s."""
  fields = {f.name for f in dataclasses.fields(TritonMLAOptions)} - {"interpret"}
  if set(block_options) - fields:
    raise TypeError(f"sparse_mla_triton_parts: unknown options "
                    f"{sorted(set(block_options) - fields)}; expected some of {sorted(fields)}")
  opts = TritonMLAOptions(interpret=interpret, **block_options)

  def forward(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale, head_probs=False):
    return _forward(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, float(scale), opts,
                    head_probs)

  def backward(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, out_BLHC, lse_BLH, dout_BLHC,
               dlse_BLH, scale):
    return _backward_from_cotangents(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT,
                                     out_BLHC, lse_BLH, dout_BLHC, dlse_BLH, float(scale), opts,
                                     head_probs=True)

  return SparseMLAParts(forward, backward)


def _checked(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT, scale, interpret,
             block_options):
  """The public functions' argument checks: `(arrays, scale, TritonMLAOptions)`."""
  check_sparse_mla_inputs(q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT)
  fields = {f.name for f in dataclasses.fields(TritonMLAOptions)} - {"interpret"}
  unknown = set(block_options) - fields
  if unknown:
    raise TypeError(f"sparse_mla_triton: unknown options {sorted(unknown)}; "
                    f"expected some of {sorted(fields)}")
  dtypes = {x.dtype for x in (q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR)}
  if len(dtypes) > 1:  # the reference would promote; a Triton dot takes one element type
    raise ValueError(f"sparse_mla_triton: q, q_rope, kv and k_rope must share one dtype (a "
                     f"Triton dot takes operands of one element type), got q {q_BLHC.dtype}, "
                     f"q_rope {q_rope_BLHR.dtype}, kv {kv_BSC.dtype}, k_rope {k_rope_BSR.dtype}")
  opts = TritonMLAOptions(interpret=interpret, **block_options)
  # Out-of-range slots become -1 once, so forward, residuals and backward see one selection.
  topk_BLT = empty_out_of_range(topk_BLT, kv_BSC.shape[1])
  return (q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT), float(scale), opts
