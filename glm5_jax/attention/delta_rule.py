"""The gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks", arXiv
2412.06464): recurrent form for decoding, chunked parallel (WY / UT-transform) form for training.

Per head, with unit-norm keys k_t, decay alpha_t in (0, 1] and update gate beta_t in (0, 1), the
state S_t (a [K, V] matrix here, the transpose of the paper's S) follows

  S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t.

Equivalently S_t = alpha_t S_{t-1} + k_t u_t^T with the "new value"
u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t): the state moves the value stored under k_t a step
beta_t toward v_t after decaying everything by alpha_t.

Chunked form (paper section 3.3; the WY / UT-transform form of DeltaNet, Yang et al. 2024,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length", arXiv
2406.06484). Split the
sequence into chunks of A positions; inside a chunk with start state S_0 let
g_r = sum_{i <= r} log alpha_i and Gamma[r, i] = exp(g_r - g_i) for i <= r. Unrolling,

  u_r = beta_r (v_r - exp(g_r) S_0^T k_r - sum_{i<r} Gamma[r, i] (k_i . k_r) u_i),

a unit lower-triangular system (I + A) U = diag(beta) V - diag(beta exp(g)) K S_0 with
A[r, i] = beta_r Gamma[r, i] (k_r . k_i) for i < r. Solving it once per chunk for the parts that
do not depend on S_0,

  U~ = (I + A)^-1 diag(beta) V,   W = (I + A)^-1 diag(beta exp(g)) K,   so   U = U~ - W S_0,

leaves only small matmuls for the sequential scan over chunks:

  O   = diag(exp(g)) Q S_0 + (Gamma * tril(Q K^T)) U
  S_A = exp(g_A) S_0 + (diag(exp(g_A - g)) K)^T U.

(I + A)^-1 comes from `unit_lower_triangular_inverse` (block doubling, matmuls only), not a
LAPACK triangular solve: on CPU, jaxlib's batched trsm custom call can deadlock XLA's intra-op
thread pool when two run at once on a 2-core host.

Every exponent is a decay over positions i < r of one chunk (g_r - g_i <= 0, g_r <= 0), so
nothing is exponentiated above 1; the cumulative log-decays stay within one chunk, which bounds
their magnitude and the rounding of their differences. All of it runs in fp32 with
`Precision.HIGHEST` matmuls (no bf16 / TF32 passes).

Packed documents: the state resets to zero wherever the segment id changes (a position whose id
differs from its predecessor's starts a new run). The chunked form expresses the reset as a
zero decay between positions of different runs, so both forms agree across boundaries.

Notation (docs/design.md): B batch, L length, H heads, K key dim, V value dim, Z chunks, A chunk
length; locally, R and I index the rows and columns of a chunk's A x A matrices, and in the
triangular inverse X is any leading batch dims, P the chunk length padded to a power of two,
M / S the number / size of the diagonal blocks being merged.
"""

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def l2_normalize(x, eps: float = 1e-6):
  """`x / sqrt(sum(x^2) + eps)` over the last axis, in fp32 (the delta rule needs |k| = 1)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def segment_runs(segment_ids_BL):
  """int32 `[B, L]`: 0, 1, 2, ... counting the changes of segment id along each row. Two
  positions share a run iff no segment boundary lies between them (the state never crosses a
  run boundary)."""
  changed_BL = segment_ids_BL[:, 1:] != segment_ids_BL[:, :-1]
  return jnp.concatenate([jnp.zeros_like(segment_ids_BL[:, :1], jnp.int32),
                          jnp.cumsum(changed_BL, axis=1, dtype=jnp.int32)], axis=1)


def unit_lower_triangular_inverse(a_XAA):
  """`(I + a)^-1` for strictly lower-triangular matrices `a_XAA` (`[..., A, A]`, A the chunk
  length), by block doubling.

  Invert the diagonal blocks of size 1 (all 1), then repeatedly merge adjacent pairs:
  [[T1, 0], [A21, T2]]^-1 = [[T1^-1, 0], [-T2^-1 A21 T1^-1, T2^-1]], log2(A) rounds of batched
  matmuls (the recursive triangular inversion, as stable as substitution for these matrices).
  The matrices are padded to a power of two with identity rows, which leaves the inverse unchanged.
  """
  size = a_XAA.shape[-1]
  p = 1 << (size - 1).bit_length()
  batch = a_XAA.shape[:-2]
  a_XPP = jnp.pad(a_XAA, [(0, 0)] * len(batch) + [(0, p - size), (0, p - size)])
  blocks_XMSS = jnp.ones(batch + (p, 1, 1), a_XAA.dtype)  # inverses of the 1 x 1 diagonal
  s = 1
  while s < p:
    m = p // (2 * s)
    first_MS = (jnp.arange(m) * 2 * s)[:, None] + jnp.arange(s)[None, :]
    a21_XMSS = a_XPP[..., (first_MS + s)[:, :, None], first_MS[:, None, :]]
    pairs = blocks_XMSS.reshape(batch + (m, 2, s, s))
    t1_XMSS, t2_XMSS = pairs[..., 0, :, :], pairs[..., 1, :, :]
    t21_XMSS = -jnp.einsum("...ij,...jk,...kl->...il", t2_XMSS, a21_XMSS, t1_XMSS,
                           precision=HIGHEST)
    top = jnp.concatenate([t1_XMSS, jnp.zeros_like(t1_XMSS)], axis=-1)
    bottom = jnp.concatenate([t21_XMSS, t2_XMSS], axis=-1)
    blocks_XMSS = jnp.concatenate([top, bottom], axis=-2)
    s *= 2
  return blocks_XMSS[..., 0, :size, :size]


def gated_delta_rule_step(state_BHKV, q_BHK, k_BHK, v_BHV, log_alpha_BH, beta_BH):
  """One recurrent step (decoding): returns `(o_BHV, new state_BHKV)`, fp32."""
  state_BHKV = jnp.exp(log_alpha_BH)[..., None, None] * state_BHKV
  recalled_BHV = jnp.einsum("bhk,bhkv->bhv", k_BHK, state_BHKV, precision=HIGHEST)
  u_BHV = beta_BH[..., None] * (v_BHV - recalled_BHV)
  state_BHKV = state_BHKV + k_BHK[..., :, None] * u_BHV[..., None, :]
  return jnp.einsum("bhk,bhkv->bhv", q_BHK, state_BHKV, precision=HIGHEST), state_BHKV


def _as_f32(*arrays):
  return [a.astype(jnp.float32) for a in arrays]


def _initial_state(initial_state_BHKV, q_BLHK, v_BLHV):
  if initial_state_BHKV is not None:
    return initial_state_BHKV.astype(jnp.float32)
  b, _, h, k = q_BLHK.shape
  return jnp.zeros((b, h, k, v_BLHV.shape[-1]), jnp.float32)


def gated_delta_rule_recurrent(q_BLHK, k_BLHK, v_BLHV, log_alpha_BLH, beta_BLH, segment_ids_BL,
                               initial_state_BHKV=None, *, return_states: bool = False):
  """The recurrence position by position (`lax.scan`): the decoding form and the reference.

  Args:
    q_BLHK, k_BLHK: queries and keys (unit norm, see `l2_normalize`).
    v_BLHV: values.
    log_alpha_BLH: log decays (<= 0).
    beta_BLH: update gates in (0, 1).
    segment_ids_BL: document ids; the state resets where the id changes.
    initial_state_BHKV: the state before position 0 (continues into the first run), default 0.
    return_states: also return the state after every position (decode's `cache_steps`).
  Returns:
    `(o_BLHV, final state_BHKV)`, fp32; with `return_states`, `(o_BLHV, final state_BHKV,
    states_BLHKV)`.
  """
  q, k, v, log_alpha, beta = _as_f32(q_BLHK, k_BLHK, v_BLHV, log_alpha_BLH, beta_BLH)
  runs_BL = segment_runs(segment_ids_BL)
  reset_BL = jnp.concatenate([jnp.zeros_like(runs_BL[:, :1], bool),
                              runs_BL[:, 1:] != runs_BL[:, :-1]], axis=1)

  def step(state_BHKV, xs):
    q_BHK, k_BHK, v_BHV, log_alpha_BH, beta_BH, reset_B = xs
    state_BHKV = jnp.where(reset_B[:, None, None, None], 0.0, state_BHKV)
    o_BHV, state_BHKV = gated_delta_rule_step(state_BHKV, q_BHK, k_BHK, v_BHV, log_alpha_BH,
                                              beta_BH)
    return state_BHKV, ((o_BHV, state_BHKV) if return_states else o_BHV)

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  final_BHKV, ys = jax.lax.scan(
      step, _initial_state(initial_state_BHKV, q, v),
      tuple(map(time_major, (q, k, v, log_alpha, beta, reset_BL))))
  if return_states:
    return time_major(ys[0]), final_BHKV, time_major(ys[1])
  return time_major(ys), final_BHKV


def gated_delta_rule_decode(q_BLHK, k_BLHK, v_BLHV, log_alpha_BLH, beta_BLH, real_BL,
                            state_BHKV, *, return_states: bool):
  """Cached decoding of L new tokens per slot: the recurrence continued from `state_BHKV`
  (the cache; zero for a fresh sequence). A padded token (`real_BL` False) gets alpha = 1 and
  beta = 0, a step that leaves the state exactly unchanged, so padding may sit anywhere. Returns
  `gated_delta_rule_recurrent`'s result (with `states_BLHKV` when `return_states`)."""
  no_reset_BL = jnp.ones(real_BL.shape, jnp.int32)  # one sequence per slot: no document resets
  return gated_delta_rule_recurrent(
      q_BLHK, k_BLHK, v_BLHV, jnp.where(real_BL[..., None], log_alpha_BLH, 0.0),
      jnp.where(real_BL[..., None], beta_BLH, 0.0), no_reset_BL, state_BHKV,
      return_states=return_states)


def gated_delta_rule_chunked(q_BLHK, k_BLHK, v_BLHV, log_alpha_BLH, beta_BLH, segment_ids_BL,
                             chunk_size: int, initial_state_BHKV=None):
  """The chunked parallel form (training / prefill); same arguments and result as
  `gated_delta_rule_recurrent`, plus `chunk_size` A (clipped to L). See the module docstring
  for the math. L need not be a multiple of A: the tail is padded with positions that change
  nothing (k = v = q = 0, beta = 0, no decay) and their outputs are dropped."""
  q, k, v, log_alpha, beta = _as_f32(q_BLHK, k_BLHK, v_BLHV, log_alpha_BLH, beta_BLH)
  b, l, h, kd = q.shape
  chunk = max(1, min(chunk_size, l))
  z = -(-l // chunk)
  pad = z * chunk - l
  runs_BL = segment_runs(segment_ids_BL)
  if pad:
    zeros = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, log_alpha, beta = map(zeros, (q, k, v, log_alpha, beta))
    runs_BL = jnp.pad(runs_BL, [(0, 0), (0, pad)], mode="edge")  # padding joins the last run

  # [B, L, H, X] -> [B, Z, H, A, X]: heads before positions, for per-head A x A matrices.
  chunked = lambda x: x.reshape((b, z, chunk, h) + x.shape[3:]).swapaxes(2, 3)
  q, k, v = chunked(q), chunked(k), chunked(v)
  g_BZHA = jnp.cumsum(chunked(log_alpha), axis=-1)
  beta_BZHA = chunked(beta)
  runs_BZA = runs_BL.reshape(b, z, chunk)
  prev_run_BZ = jnp.concatenate([runs_BZA[:, :1, 0], runs_BZA[:, :-1, -1]], axis=1)
  last_run_BZ = runs_BZA[:, :, -1]

  def decay(exponent, connected):
    """exp(exponent) where `connected`, exactly 0 elsewhere (no overflow off the mask)."""
    return jnp.exp(jnp.where(connected, exponent, -jnp.inf))

  causal_RI = jnp.tril(jnp.ones((chunk, chunk), bool))
  connected_BZRI = causal_RI & (runs_BZA[:, :, :, None] == runs_BZA[:, :, None, :])
  gamma_BZHRI = decay(g_BZHA[..., :, None] - g_BZHA[..., None, :], connected_BZRI[:, :, None])
  from_start_BZHA = decay(g_BZHA, (runs_BZA == prev_run_BZ[..., None])[:, :, None])
  g_end_BZH = g_BZHA[..., -1]
  to_end_BZHA = decay(g_end_BZH[..., None] - g_BZHA,
                      (runs_BZA == last_run_BZ[..., None])[:, :, None])
  chunk_decay_BZH = decay(g_end_BZH, (last_run_BZ == prev_run_BZ)[:, :, None])

  # UT transform: one unit lower-triangular inverse per chunk and head gives U~ and W.
  kk_BZHRI = jnp.einsum("bzhrk,bzhik->bzhri", k, k, precision=HIGHEST)
  strict_RI = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
  a_BZHRI = jnp.where(strict_RI, beta_BZHA[..., :, None] * gamma_BZHRI * kk_BZHRI, 0.0)
  rhs = jnp.concatenate([beta_BZHA[..., None] * v,
                         (beta_BZHA * from_start_BZHA)[..., None] * k], axis=-1)
  solved = jnp.einsum("bzhri,bzhix->bzhrx", unit_lower_triangular_inverse(a_BZHRI), rhs,
                      precision=HIGHEST)
  vd = v.shape[-1]
  u_tilde_BZHAV, w_BZHAK = solved[..., :vd], solved[..., vd:]
  scores_BZHRI = gamma_BZHRI * jnp.einsum("bzhrk,bzhik->bzhri", q, k, precision=HIGHEST)

  def chunk_step(state_BHKV, xs):
    u_tilde, w, scores, q_c, k_c, from_start, to_end, chunk_decay = xs
    u_BHAV = u_tilde - jnp.einsum("bhak,bhkv->bhav", w, state_BHKV, precision=HIGHEST)
    o_BHAV = (from_start[..., None]
              * jnp.einsum("bhak,bhkv->bhav", q_c, state_BHKV, precision=HIGHEST)
              + jnp.einsum("bhri,bhiv->bhrv", scores, u_BHAV, precision=HIGHEST))
    state_BHKV = (chunk_decay[..., None, None] * state_BHKV
                  + jnp.einsum("bhak,bhav->bhkv", to_end[..., None] * k_c, u_BHAV,
                               precision=HIGHEST))
    return state_BHKV, o_BHAV

  chunk_major = lambda x: jnp.moveaxis(x, 1, 0)
  final_BHKV, o_ZBHAV = jax.lax.scan(
      chunk_step, _initial_state(initial_state_BHKV, q_BLHK, v_BLHV),
      tuple(map(chunk_major, (u_tilde_BZHAV, w_BZHAK, scores_BZHRI, q, k, from_start_BZHA,
                              to_end_BZHA, chunk_decay_BZH))))
  o_BLHV = jnp.moveaxis(o_ZBHAV, 0, 1).swapaxes(2, 3).reshape(b, z * chunk, h, vd)
  return o_BLHV[:, :l], final_BHKV


def gated_delta_rule(q_BLHK, k_BLHK, v_BLHV, log_alpha_BLH, beta_BLH, segment_ids_BL, *,
                     recurrent: bool, chunk_size: int):
  """The decode form (`recurrent=True`, one token at a time) or the training form (chunked);
  both compute the same outputs. Returns `(o_BLHV, final state)`."""
  if recurrent:
    return gated_delta_rule_recurrent(q_BLHK, k_BLHK, v_BLHV, log_alpha_BLH, beta_BLH,
                                      segment_ids_BL)
  return gated_delta_rule_chunked(q_BLHK, k_BLHK, v_BLHV, log_alpha_BLH, beta_BLH,
                                  segment_ids_BL, chunk_size)
