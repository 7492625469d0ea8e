"""Random inputs that several test files build alike: batches of packed documents for the loss
and train-step tests, operands of the sparse MLA kernels.

Notation (docs/design.md): B batch, L queries (tokens), S keys, H heads, C latent dim, R rope
dim, T top-k slots.
"""

import jax.numpy as jnp
import numpy as np


def packed_batch(vocab: int, b: int = 2, l: int = 24, *, split: int = 10, padding: int = 5,
                 mask_holes: bool = True, seed: int = 0) -> dict:
  """A train batch (`tokens`, `positions`, `segment_ids`, `loss_mask`, each `[b, l]`) of two
  documents per row, the second starting at position `split`, the last `padding` positions of
  row 1 padding (segment 0); with `mask_holes`, ~20% of the loss mask zeroed at random
  besides the padding."""
  rng = np.random.default_rng(seed)
  segments_BL = np.where(np.arange(l) < split, 1, 2)[None].repeat(b, 0)
  segments_BL[1, -padding:] = 0
  positions_BL = np.where(segments_BL == 2, np.arange(l) - split, np.arange(l)) * (
      segments_BL != 0)
  tokens_BL = rng.integers(1, vocab, (b, l))
  loss_mask_BL = segments_BL != 0
  if mask_holes:
    loss_mask_BL &= rng.random((b, l)) > 0.2
  return {"tokens": jnp.asarray(tokens_BL, jnp.int32),
          "positions": jnp.asarray(positions_BL, jnp.int32),
          "segment_ids": jnp.asarray(segments_BL, jnp.int32),
          "loss_mask": jnp.asarray(loss_mask_BL, jnp.float32)}


def sparse_mla_inputs(b=2, l=11, s=29, h=3, c=16, r=4, t=13, dtype=jnp.float32, seed=0):
  """`[q_BLHC, q_rope_BLHR, kv_BSC, k_rope_BSR, topk_BLT]`: random q / kv and a selection of
  distinct rows per query with -1 slots scattered in it (~25%); query (0, 0) selects nothing
  (zero output, lse -inf)."""
  rng = np.random.default_rng(seed)
  arrays = [jnp.asarray(rng.standard_normal(shape), dtype)
            for shape in ((b, l, h, c), (b, l, h, r), (b, s, c), (b, s, r))]
  topk_BLT = np.stack([rng.permutation(s)[:t] for _ in range(b * l)]).reshape(b, l, t)
  topk_BLT = np.where(rng.random((b, l, t)) < 0.25, -1, topk_BLT)
  topk_BLT[0, 0] = -1
  return arrays + [jnp.asarray(topk_BLT, jnp.int32)]
