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

Notation (docs/design.md): B batch, L queries, S keys, D hidden, W window (clipped to L).
"""

import dataclasses

import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.attention.mla import MLA
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig


def sliding_window_keys(length: int, window: int):
  """int32 `[L, min(window, L)]`: row l lists keys l - W + 1 .. l; -1 for those before 0 (the
  empty-slot marker of a top-k selection)."""
  w = min(window, length)
  keys_LW = jnp.arange(length, dtype=jnp.int32)[:, None] - jnp.arange(w - 1, -1, -1,
                                                                      dtype=jnp.int32)[None, :]
  return jnp.where(keys_LW >= 0, keys_LW, -1)


class SlidingWindowMLA(nn.Module):
  """Same call signature and aux contract as `MLA`; returns an empty aux dict."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT=None, *,
               mode: Mode = Mode()):
    """Args as `MLA.__call__`; `prev_topk_BLT` and `mode.dsa_stage` are ignored (the window
    applies in every stage). Returns `(y_BLD, {})`."""
    del prev_topk_BLT
    b, l = segment_ids_BL.shape
    window_BLW = jnp.broadcast_to(sliding_window_keys(l, self.cfg.sliding_window)[None],
                                  (b, l, min(self.cfg.sliding_window, l)))
    mla = MLA(self.cfg, kind="dsa_shared_topk", name="mla")
    nn.share_scope(self, mla)  # the M layer's params live directly in this layer's scope
    y_BLD, _ = mla(x_BLD, positions_BL, segment_ids_BL, window_BLW,
                   mode=dataclasses.replace(mode, dsa_stage="sparse"))
    return y_BLD, {}
