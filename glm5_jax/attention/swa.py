"""Sliding-window MLA (letter S): the M layer with each query restricted to its latest keys.

docs/reference.md section 3 ("Long-context ablation"): SWA layers interleaved with full
attention, or placed by a layer search. Key s is visible to query l iff

  l - window < s <= l   and   s, l lie in the same packed document,

i.e. `common.causal_segment_mask(segment_ids, window=sliding_window)`. Everything else is the M
layer: the same parameters under the same names (a trained M layer converts to S with nothing
new), the same expanded and absorbed forms. With window >= L the layer is exactly M.

How: a fixed sparse selection is what a shared-top-k DSA layer ("dsa_shared_topk") applies, so
this module runs `MLA(kind="dsa_shared_topk")` in its own parameter scope (`nn.share_scope`,
so no extra nesting level) with the selection "the last `window` positions" instead of a
previous layer's top-k, in every DSA stage. MLA intersects the selection with its causal
same-document mask, which gives exactly the mask above. The selection is not returned in aux:
it must not feed a following 'R' layer (validation forbids S -> R anyway).

So `model.dsa_impl` drives S layers exactly as it drives R layers: "dense_mask" masks a dense
`[B, L, S]` attention, "xla" / "pallas" gather the W window rows of the latent per query and
never build anything `[B, L, S]`-shaped (O(L x W); `pallas_kernels.sparse_mla_*`, absorbed
form). All three give the same outputs (tests/test_attention_variants.py).

Decode (`Mode(form="decode")`): the cache is a ring of `window + max_verify - 1` latent rows
(`ckv` normed, `k_rope` rotated, as MLA caches them) with the position each row holds (-1 =
empty), position p in row p mod rows (`kinds._swa_cache`). A call attends over the ring as it
was before the call (rows at positions before the slot's first new token) together with the
new tokens' own rows, with the training window: key position s is visible to the query at p
iff p - window < s <= p. So a prefill chunk may be longer than the ring. Then the last `rows`
new real tokens are written. A speculative call of at most max_verify tokens starting at p
overwrites only rows of positions <= p - window, which no later query (at > p) sees, and rows a
rejected draft wrote hold positions >= the next call's first one, which that call ignores and
overwrites: rolling back a draft is a no-op. Stale rows of an earlier request in the slot are
never visible either (each row <= p of the window was rewritten by the current sequence).

Notation (docs/design.md): B batch, L queries, S keys, D hidden, W window (clipped to L), H
heads, C kv latent, N nope head dim, R rope dim, V value head dim.
"""

import dataclasses

import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.attention import context_parallel, decode_rows
from glm5_jax.attention.mla import MLA, _absorbed_attention, _Latents
from glm5_jax.attention.mla_projections import mla_latents, mla_output
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.layers.params import dtypes
from glm5_jax.layers.rope import apply_interleaved_rope, rope_angles

CACHE_KEYS = ("ckv", "k_rope", "pos")


def sliding_window_keys(length: int, window: int, q_index_L=None):
  """int32 `[L, min(window, L)]`: row l lists keys q - W + 1 .. q for the query's sequence
  index q (`q_index_L[l]`, default l: context parallelism's striped layout passes its own);
  -1 for those before 0 (the empty-slot marker of a top-k selection)."""
  w = min(window, length)
  if q_index_L is None:
    q_index_L = jnp.arange(length, dtype=jnp.int32)
  keys_LW = q_index_L[:, None] - jnp.arange(w - 1, -1, -1, dtype=jnp.int32)[None, :]
  return jnp.where(keys_LW >= 0, keys_LW, -1)


class SlidingWindowMLA(nn.Module):
  """Same call signature and aux contract as `MLA`; returns an empty aux dict (decode:
  `{"cache": ...}`)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT=None, *,
               mode: Mode = Mode(), cache=None):
    """Args as `MLA.__call__`; `prev_topk_BLT` and `mode.dsa_stage` are ignored (the window
    applies in every stage). Returns `(y_BLD, {})`."""
    del prev_topk_BLT
    decode_rows.check_cache("SlidingWindowMLA", mode.form, cache, CACHE_KEYS)
    if mode.form == "decode":
      return _ring_decode(self, self.cfg, x_BLD, positions_BL, segment_ids_BL, cache)
    b, l = segment_ids_BL.shape
    q_index_L = context_parallel.query_index(1, l, mode.context_layout)[0]
    window_BLW = jnp.broadcast_to(
        sliding_window_keys(l, self.cfg.sliding_window, q_index_L)[None],
        (b, l, min(self.cfg.sliding_window, l)))
    mla = MLA(self.cfg, kind="dsa_shared_topk", name="mla")
    nn.share_scope(self, mla)  # the M layer's params live directly in this layer's scope
    y_BLD, _ = mla(x_BLD, positions_BL, segment_ids_BL, window_BLW,
                   mode=dataclasses.replace(mode, dsa_stage="sparse"))
    return y_BLD, {}


def _ring_decode(module, c, x_BLD, positions_BL, segment_ids_BL, cache):
  """The decode branch on `module`'s params (the M layer's, in the scope `MLA` shares): absorbed
  attention over the ring and the new rows, then the ring update. Returns
  `(y_BLD, {"cache": new cache})`."""
  dtype, _ = dtypes(c)
  n, r = c.qk_nope_head_dim, c.qk_rope_head_dim
  q_BLHK, _, ckv_BLC, k_rope_BLR, w_kb_CHN, w_vb_CHV = mla_latents(module, c,
                                                                   x_BLD.astype(dtype))
  cos, sin = rope_angles(positions_BL, r, c.rope_theta)
  q_rope_BLHR = apply_interleaved_rope(q_BLHK[..., n:], cos, sin)
  # Rounded through the cache dtype now, as later calls will read them: chunking-independent.
  as_cached = lambda x, key: x.astype(cache[key].dtype).astype(dtype)
  ckv_BLC = as_cached(ckv_BLC, "ckv")
  k_rope_BLR = as_cached(apply_interleaved_rope(k_rope_BLR, cos, sin), "k_rope")

  real_BL = decode_rows.real_tokens(segment_ids_BL)
  big = jnp.iinfo(jnp.int32).max
  start_B = jnp.min(jnp.where(real_BL, positions_BL, big), axis=1)
  # Ring rows at or after the first new position are superseded (a rejected draft's).
  ring_pos_BS = jnp.where(cache["pos"] < start_B[:, None], cache["pos"], -1)
  key_pos_BS = jnp.concatenate([ring_pos_BS, jnp.where(real_BL, positions_BL, -1)], axis=1)
  offset_BLS = positions_BL[:, :, None] - key_pos_BS[:, None, :]  # p - s
  visible_BLS = ((key_pos_BS >= 0)[:, None, :] & (offset_BLS >= 0)
                 & (offset_BLS < c.sliding_window))
  latents = _Latents(q_BLHK[..., :n], q_rope_BLHR,
                     jnp.concatenate([cache["ckv"].astype(dtype), ckv_BLC], axis=1),
                     jnp.concatenate([cache["k_rope"].astype(dtype), k_rope_BLR], axis=1),
                     w_kb_CHN, w_vb_CHV)
  out_BLHV, _ = _absorbed_attention(latents, visible_BLS, c.qk_head_dim ** -0.5)

  rows = cache["pos"].shape[1]
  last_B = jnp.max(jnp.where(real_BL, positions_BL, -1), axis=1)
  keep_BL = real_BL & (positions_BL > last_B[:, None] - rows)  # distinct rows mod `rows`
  row_BL = positions_BL % rows
  new = decode_rows.with_rows(cache, "ckv", ckv_BLC, row_BL, keep_BL)
  new = decode_rows.with_rows(new, "k_rope", k_rope_BLR, row_BL, keep_BL)
  new = decode_rows.with_rows(new, "pos", positions_BL, row_BL, keep_BL)
  return mla_output(module, c, out_BLHV), {"cache": new}
