"""Lightning indexer fused with a streaming exact top-k, as a Pallas Triton (GPU) kernel.

Same contract as `lightning_indexer.indexer_topk_reference` (that module's docstring and the
package docstring's "Index contract"): the scores

  I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s] * scale)          (fp32, any sign of w, scale)

over the keys t may see (s <= q_pos[t], same segment), top T = min(topk, S) keys per query, best
first, ties to the lower index, +0.0 == -0.0, -1 / -inf in empty slots, inputs detached. The
`[L, S]` scores never reach HBM: each score tile lives in registers, and only the keys that
can still be in a query's top-T leave the chip.

Design (one program per block of bq queries of one batch row; grid (L / bq, B), the last
query block first, since under causal skipping it has the most keys to score):

1. Score a key tile. q of the block is one `[bq*J, I]` operand (q `[B, L, J, I]` reshaped for
   free), so each key tile costs a single tensor-core dot `[bq*J, I] x [I, bs]` with fp32
   accumulation, then ReLU(. * scale), times w `[bq*J, 1]`, and a sum over heads
   (`[bq, J, bs]` -> `[bq, bs]`). Invisible keys get -inf; -0.0 becomes +0.0.
2. Candidate buffer. Per query an HBM scratch row of C slots (values fp32 + key indices int32,
   outputs of the kernel, `[B, L, C]`, C >= T + bs), always in key-index order, with a count
   and a threshold `thr` (-inf until T keys were seen, then the T-th best of the keys seen up
   to the last compaction). A key enters iff its score > thr: a key with score <= thr has T
   earlier keys ranked above it (score >= thr, lower index), so it can never be in the top-T.
   Entering keys are appended at `count + exclusive cumsum(enter)` (masked scatter store).
3. Compaction, when the next tile could overflow a row (max count > C - bs): per row, the exact
   T-th largest score v* by a radix search, MSB first, on the order-preserving uint32 image of
   the fp32 scores: 32 / radix_bits counting passes over the row (`chunk` slots a load, up to
   8 independent loads a step), each counting the keys >= each of the 2**radix_bits - 1
   candidate digits in per-lane counters; then, in index
   order, keep the scores > v* and the first (T - #{> v*}) scores == v* (ties to the lower
   index), written back in place (new slot <= old slot). thr <- v*, count <- T.
4. Causal skipping: the loop stops at the tile holding the block's last visible position.
5. After a final compaction the first min(count, T) slots of a row are its top-T in index
   order; a small XLA sort of `[B, L, T]` (score desc, index asc) gives best-first order.
No sort runs in the kernel (Triton has none): only dot, elementwise ops, cumsum, reductions,
masked loads / scatter stores, loops and conds.

Cost model per query (S keys seen, J heads, I head dim):
- Scoring: 2*J*I*S tensor-core flops and ~3*J*S fp32 elementwise ops; k tiles are shared by
  the bq queries of a program, so k reads are S*I*2/bq bytes per query (bq*J = 256 flops per
  byte of k at the defaults, about the H100's dense bf16 balance).
- Selection: with scores in random order about T*ln(S/T) keys enter after the first C - bs, so
  a block compacts about 1 + T*ln(S/T)/(C - T) times (a NumPy simulation of this policy, 8
  queries per block, normal scores, T = 2048, C = 4096, bs = 32: 1 compaction at S = 4096, 3
  at 16K, 5 at 64K), plus the final one. A compaction reads (32 / radix_bits + 2) * C values
  and C indices and writes <= C slots (L2-resident when the buffers of the running programs
  fit). Adversarial order (scores rising with s) makes every key enter: ~S/(C - T)
  compactions (simulated: 7 at S = 16K), still O(S) per query.
- HBM: scratch B * L * C * 8 bytes (C = 4096: 2 GiB at L = 64K), outputs B * L * T * 8.
Larger C compacts less often but each compaction reads more; the product is flat around C
= 2-4T. The selection's L2 traffic can exceed the key reads at long S: the suite's timings
decide whether radix_bits = 4 or a larger block_q pays.

GPU memory ordering: buffer slots written by one thread are read by others (appends then
counting passes; in-place compaction), so `plgpu.debug_barrier()` (`__syncthreads`, which also
orders global memory within the block) separates every store phase from the next load phase.
Scatter positions of masked-out lanes are kept distinct from the written ones (a stable
partition of the tile), so interpret mode, which writes masked lanes back unchanged, can
never lose a write to a duplicate index.

Checked without a GPU: interpret mode against the reference and lowering for CUDA (the Triton
custom call) in tests/test_triton_indexer.py; compiled once by hand with Triton 3.6 for sm_90a
down to a cubin (see `indexer_topk_triton`'s defaults). Never run on a GPU yet: races, speed and
the bf16 recall are the device suite's to measure.

Notation (docs/design.md): B batch, L queries, S keys, J index heads, I index head dim,
T top-k, C candidate slots per query; bq / bs queries / keys per tile.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.blocking import pad_axis, round_up
from pallas_kernels.lightning_indexer import check_indexer_inputs

_NT = (((1,), (1,)), ((), ()))  # dot_general: contract the last dims of both ([m,k] x [n,k])
_SIGN = np.uint32(0x80000000)  # numpy scalars: a Python int this large overflows int32
_ONES = np.uint32(0xFFFFFFFF)


def _order_key(values):
  """fp32 -> uint32 with the same order (-inf lowest): flip all bits of negatives, set the sign
  bit of non-negatives. +0.0 and -0.0 differ here, so callers map -0.0 to +0.0 first."""
  bits = jax.lax.bitcast_convert_type(values, jnp.uint32)
  flip = jnp.where(bits >= _SIGN, _ONES, _SIGN)
  return bits ^ flip


def _from_order_key(keys):
  """Inverse of `_order_key`."""
  flip = jnp.where(keys >= _SIGN, _SIGN, _ONES)
  return jax.lax.bitcast_convert_type(keys ^ flip, jnp.float32)


def _barrier(interpret):
  """`__syncthreads` between a store phase and the next load phase (module docstring). Interpret
  mode runs one program at a time and has no rule for the barrier, so it is skipped there."""
  if not interpret:
    plgpu.debug_barrier()


def _partition_slots(keep, first):
  """Slots for a stable partition of each row of `keep` `[bq, n]`: kept lanes at
  `first + rank`, the others after them (distinct slots, so masked scatters cannot collide).
  Returns (slots `[bq, n]` int32, kept per row `[bq]`)."""
  keep_i = keep.astype(jnp.int32)
  kept_before = jnp.cumsum(keep_i, axis=1) - keep_i
  lane = jax.lax.broadcasted_iota(jnp.int32, keep.shape, 1)
  num_kept = jnp.sum(keep_i, axis=1)
  slot = jnp.where(keep, kept_before, num_kept[:, None] + lane - kept_before)
  return first[:, None] + slot, num_kept


def _compact(val_ref, idx_ref, count, thr, *, topk, chunk, radix_bits, interpret):
  """Keeps each row's top-`topk` of its first `count` slots, in slot (= key index) order.

  Rows with count <= topk keep everything; rows with count >= topk get thr = the topk-th best.
  Returns (count, thr), both `[bq]`.
  """
  bq, capacity = val_ref.shape
  rows = jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
  lane = jax.lax.broadcasted_iota(jnp.int32, (bq, chunk), 1)
  num_chunks = (jnp.max(count) + chunk - 1) // chunk

  def load_keys(c):
    keys = _order_key(val_ref[:, pl.ds(c * chunk, chunk)])
    return keys, c * chunk + lane < count[:, None]

  # Counting passes step `unroll` chunks at a time: their loads are independent, so they are
  # in flight together (one chunk per step would wait out an L2 latency for 2 values a thread).
  unroll = next(u for u in (8, 4, 2, 1) if (capacity // chunk) % u == 0)
  num_steps = (jnp.max(count) + chunk * unroll - 1) // (chunk * unroll)

  def count_where(*preds):  # per pred [bq]: #{valid slots whose key has pred(key)}; one pass
    def body(step, accs):  # per-lane counts: one cross-lane reduction per pass, not per chunk
      for c in range(unroll):
        keys, valid = load_keys(step * unroll + c)
        accs = tuple(acc + (valid & pred(keys)).astype(jnp.int32)
                     for acc, pred in zip(accs, preds))
      return accs
    zeros = tuple(jnp.zeros((bq, chunk), jnp.int32) for _ in preds)
    return [jnp.sum(acc, axis=1) for acc in jax.lax.fori_loop(0, num_steps, body, zeros)]

  def next_digit(step, prefix):  # MSB first: the largest v with #{key >= v} >= topk
    shift = (32 - radix_bits * (step + 1)).astype(jnp.uint32)
    cands = [prefix | (np.uint32(d) << shift) for d in range(1, 2 ** radix_bits)]
    counts = count_where(*[lambda keys, cand=cand: keys >= cand[:, None] for cand in cands])
    # counts fall as d grows, so the digit is the number of candidates still reaching topk
    digit = sum((n >= topk).astype(jnp.uint32) for n in counts)
    return prefix | (digit << shift)

  kth = jax.lax.fori_loop(0, 32 // radix_bits, next_digit, jnp.zeros((bq,), jnp.uint32))
  # Rows with count < topk end at kth = 0, below every real key: they keep all their slots.
  [num_above] = count_where(lambda keys: keys > kth[:, None])
  need_equal = topk - num_above
  shrinks = count > topk

  def rewrite(c, carry):
    written, equal_seen = carry
    keys, valid = load_keys(c)
    values = val_ref[:, pl.ds(c * chunk, chunk)]
    indices = idx_ref[:, pl.ds(c * chunk, chunk)]
    equal = valid & (keys == kth[:, None])
    equal_i = equal.astype(jnp.int32)
    equal_rank = equal_seen[:, None] + jnp.cumsum(equal_i, axis=1) - equal_i
    keep = valid & ((keys > kth[:, None]) | (equal & (equal_rank < need_equal[:, None])))
    slots, num_kept = _partition_slots(keep, written)
    store = keep & shrinks[:, None]
    _barrier(interpret)  # every lane has read this chunk before any slot of it is rewritten
    plgpu.store(val_ref.at[rows, slots], values, mask=store)
    plgpu.store(idx_ref.at[rows, slots], indices, mask=store)
    return written + num_kept, equal_seen + jnp.sum(equal_i, axis=1)

  zeros = jnp.zeros((bq,), jnp.int32)
  jax.lax.fori_loop(0, num_chunks, rewrite, (zeros, zeros))
  _barrier(interpret)  # the rewritten slots are visible to the next tile's appends / passes
  thr = jnp.where(count >= topk, _from_order_key(kth), thr)
  return jnp.minimum(count, topk), thr


def _indexer_topk_kernel(q_ref, w_ref, q_pos_ref, q_seg_ref, k_ref, k_seg_ref,
                         val_ref, idx_ref, count_ref, *, scale, topk, num_keys, block_s, chunk,
                         radix_bits, precision, interpret):
  """One block of queries. Refs: q `[bq*J, I]`, w `[bq*J]` fp32, q_pos and q_seg `[bq]`,
  k `[S', I]`, k_seg `[S']` (S' = S padded to bs); outputs val `[bq, C]` fp32, idx `[bq, C]`
  int32 (slots >= count are garbage), count `[bq]` int32."""
  bq, capacity = val_ref.shape
  rows_j = q_ref.shape[0]
  q = q_ref[...]
  w = w_ref[...][:, None]
  q_pos, q_seg = q_pos_ref[...], q_seg_ref[...]
  rows = jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
  last_pos = jnp.max(q_pos)
  num_tiles = jnp.where(last_pos < 0, 0,
                        jnp.minimum(last_pos // block_s + 1, k_ref.shape[0] // block_s))

  def key_tile(t, carry):
    count, thr = carry
    first = t * block_s
    k = k_ref[pl.ds(first, block_s), :]
    s = jax.lax.dot_general(q, k, _NT, precision=precision,
                            preferred_element_type=jnp.float32)      # [bq*J, bs]
    heads = jnp.maximum(s * scale, 0.0) * w
    scores = jnp.sum(heads.reshape(bq, rows_j // bq, block_s), axis=1)  # [bq, bs]
    keys = first + jax.lax.broadcasted_iota(jnp.int32, (bq, block_s), 1)
    visible = ((keys <= q_pos[:, None]) & (keys < num_keys)
               & (k_seg_ref[pl.ds(first, block_s)][None, :] == q_seg[:, None]))
    scores = jnp.where(visible, scores, -jnp.inf)
    scores = jnp.where(scores == 0, 0.0, scores)  # -0.0 ties +0.0 (package docstring)
    enter = scores > thr[:, None]  # -inf never enters: invisible keys stay out
    slots, num_in = _partition_slots(enter, count)
    plgpu.store(val_ref.at[rows, slots], scores, mask=enter)
    plgpu.store(idx_ref.at[rows, slots], keys, mask=enter)
    count = count + num_in
    _barrier(interpret)  # appended slots are visible to a compaction's counting passes
    return jax.lax.cond(jnp.max(count) > capacity - block_s,
                        functools.partial(_compact, val_ref, idx_ref, topk=topk, chunk=chunk,
                                          radix_bits=radix_bits, interpret=interpret),
                        lambda count, thr: (count, thr), count, thr)

  init = (jnp.zeros((bq,), jnp.int32), jnp.full((bq,), -jnp.inf, jnp.float32))
  count, thr = jax.lax.fori_loop(0, num_tiles, key_tile, init)
  count, _ = jax.lax.cond(jnp.max(count) > topk,
                          functools.partial(_compact, val_ref, idx_ref, topk=topk, chunk=chunk,
                                          radix_bits=radix_bits, interpret=interpret),
                          lambda count, thr: (count, thr), count, thr)
  count_ref[...] = count


def _next_power_of_two(n):
  return 1 << max(n - 1, 0).bit_length()


def _power_of_two(name, value):
  if value < 1 or value & (value - 1):
    raise ValueError(f"indexer_topk_triton: {name}={value} must be a power of two (Triton "
                     "tensors have power-of-two shapes)")


def indexer_topk_triton(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL, k_seg_BS, *,
                        topk: int, scale: float, interpret: bool = False, block_q: int = 8,
                        block_s: int = 32, chunk: int = 64, capacity: int | None = None,
                        radix_bits: int = 2, num_warps: int = 8, num_stages: int = 1):
  """`indexer_topk_reference` as one fused Triton kernel (module docstring); no `[L, S]` array.

  Args: as `indexer_topk_reference` (q `[B, L, J, I]`, k `[B, S, I]`, weights `[B, L, J]`,
    q_pos / q_seg `[B, L]`, k_seg `[B, S]`, `topk`, `scale`), plus
    interpret: run the kernel in Pallas interpret mode (CPU tests).
    block_q (bq): queries per program; bq*J is the dot's M (>= 16). 8 x 32 heads = 256 rows:
      256 flops per byte of k, about the H100's dense bf16 balance.
    block_s (bs): keys per tile, the dot's N (>= 16). chunk: slots per compaction step (each
      loads `[bq, chunk]`). capacity (C): candidate slots per query, a multiple of `chunk`,
      default max(2T, T + bs) rounded up; larger C compacts less often (module docstring).
    radix_bits: bits of the T-th value found per counting pass (32 / radix_bits passes, each
      counting 2**radix_bits - 1 candidates at once): 2 halves the passes of a bitwise search
      for 3 per-lane counters (114 registers, 110 for 1); 4 (15 counters) takes 198.
    num_warps / num_stages: Triton launch options.
    Hopper defaults (bq 8, bs 32, chunk 64, 8 warps, 1 stage), from compiling the kernel at
    GLM-5 shapes with Triton 3.6 for sm_90a on a CPU host (ptxas -v; no GPU run yet): they use
    114 registers per thread and 72 KiB of shared memory (q's `[256, 128]` bf16 operand and a
    key tile), no spills, so two programs fit on an SM and one can score while the other
    compacts. bs 64 (222 registers), chunk 128 (156) or 4 warps (255) leave one program per
    SM; bq 16 needs 136 KiB of shared memory. num_stages changes nothing: the key
    loop holds a cond with nested loops, which Triton's pipeliner leaves alone (identical PTX
    for 1 and 3 stages). Timings on the GPU decide between these (device suite sweep).
    fp32 inputs run an IEEE fp32 dot on the CUDA cores (the same compile: 144 KiB of shared
    memory, register spills): exact but slow, for checks; the model feeds bf16.
  Returns:
    `(topk_BLT, scores_BLT)` exactly as `indexer_topk_reference` (T = min(topk, S)).
  """
  check_indexer_inputs(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL, k_seg_BS)
  for name, value in (("block_q", block_q), ("block_s", block_s), ("chunk", chunk)):
    _power_of_two(name, value)
  if radix_bits not in (1, 2, 4):
    raise ValueError(f"indexer_topk_triton: radix_bits={radix_bits} must be 1, 2 or 4")
  b, l, heads, i = q_BLJI.shape
  s = k_BSI.shape[1]
  t = min(topk, s)
  if t < 1:
    raise ValueError(f"indexer_topk_triton: topk={topk} and S={s} must both be >= 1")
  # Triton tensors have power-of-two shapes and a dot needs >= 16 in each dim: zero heads
  # (weight 0) and zero feature columns change no score.
  heads_p, i_p = _next_power_of_two(heads), max(16, _next_power_of_two(i))
  if block_q * heads_p < 16 or block_s < 16:
    raise ValueError(f"indexer_topk_triton: the Triton dot needs block_q*J ({block_q}*{heads_p}"
                     f", J padded to a power of two) and block_s ({block_s}) both >= 16")
  min_capacity = round_up(t + block_s, chunk)
  capacity = max(min_capacity, round_up(2 * t, chunk)) if capacity is None else capacity
  if capacity < min_capacity or capacity % chunk:
    raise ValueError(f"indexer_topk_triton: capacity={capacity} must be a multiple of chunk="
                     f"{chunk} and >= T + block_s = {t + block_s}")
  q_BLJI, k_BSI, weights_BLJ = jax.lax.stop_gradient((q_BLJI, k_BSI, weights_BLJ))
  dtype = jnp.bfloat16 if q_BLJI.dtype == k_BSI.dtype == jnp.bfloat16 else jnp.float32
  lp, sp = round_up(l, block_q), round_up(s, block_s)
  q = pad_axis(pad_axis(pad_axis(q_BLJI.astype(dtype), 1, lp, 0), 2, heads_p, 0), 3, i_p, 0)
  q = q.reshape(b, lp * heads_p, i_p)
  w = pad_axis(pad_axis(weights_BLJ.astype(jnp.float32), 1, lp, 0), 2, heads_p, 0)
  w = w.reshape(b, lp * heads_p)
  q_pos = pad_axis(q_pos_BL.astype(jnp.int32), 1, lp, -1)  # padded queries see nothing
  q_seg = pad_axis(q_seg_BL.astype(jnp.int32), 1, lp, 0)
  k = pad_axis(pad_axis(k_BSI.astype(dtype), 1, sp, 0), 2, i_p, 0)
  k_seg = pad_axis(k_seg_BS.astype(jnp.int32), 1, sp, 0)

  # fp32 inputs: HIGHEST makes Triton's dot IEEE fp32 instead of TF32; bf16 is unaffected.
  kernel = functools.partial(
      _indexer_topk_kernel, scale=scale, topk=t, num_keys=s, block_s=block_s, chunk=chunk,
      radix_bits=radix_bits, precision=jax.lax.Precision.HIGHEST, interpret=interpret)
  nq = lp // block_q
  # Grid (query blocks, batch): the long axis on CUDA's x dimension (y and z stop at 65535).
  # Query blocks run last first: under causal skipping the late blocks see the most keys, so
  # starting them first evens out the tail of the launch.
  per_block = lambda *block: pl.BlockSpec(
      (None,) + block, lambda qi, bi: (bi, nq - 1 - qi, 0)[:len(block) + 1])
  per_batch = lambda *block: pl.BlockSpec(
      (None,) + block, lambda qi, bi: (bi, 0, 0)[:len(block) + 1])
  values, indices, count = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((b, lp, capacity), jnp.float32),
                 jax.ShapeDtypeStruct((b, lp, capacity), jnp.int32),
                 jax.ShapeDtypeStruct((b, lp), jnp.int32)),
      grid=(nq, b),
      in_specs=[per_block(block_q * heads_p, i_p), per_block(block_q * heads_p),
                per_block(block_q), per_block(block_q), per_batch(sp, i_p), per_batch(sp)],
      out_specs=(per_block(block_q, capacity), per_block(block_q, capacity),
                 per_block(block_q)),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="lightning_indexer_topk",
  )(q, w, q_pos, q_seg, k, k_seg)
  return _best_first(values[:, :l, :t], indices[:, :l, :t], count[:, :l])


def _best_first(values_BLT, indices_BLT, count_BL):
  """The kernel's top-T in index order -> best first, ties to the lower index, -1 / -inf in
  the slots past `count` (a stable sort of `[B, L, T]`, O(L x T log T))."""
  valid_BLT = jnp.arange(values_BLT.shape[-1]) < count_BL[..., None]
  values_BLT = jnp.where(valid_BLT, values_BLT, -jnp.inf)
  indices_BLT = jnp.where(valid_BLT, indices_BLT, -1)
  negated_BLT, indices_BLT = jax.lax.sort((-values_BLT, indices_BLT), dimension=2,
                                          is_stable=True, num_keys=1)
  return indices_BLT.astype(jnp.int32), -negated_BLT
