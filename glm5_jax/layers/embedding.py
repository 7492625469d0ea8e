"""The token embedding lookup, laid out by its table's own sharding.

The table `[Y, D]` is split over D (`mesh.logical_axis_rules`: EMBED over fsdp, and context)
and the tokens over the batch. XLA partitions `jnp.take(table, tokens)` there by gathering the
whole fp32 table onto every device (an all-gather over fsdp), and its transpose by a
scatter-add into a whole fp32 `[Y, D]` gradient on every device followed by an all-reduce of
it over all devices: on the 744B headline step an fp32 `[154,880, 6,144]` (3.8 GB) all-gathered
and all-reduced over all 1,024 chips (TPU compiler, docs/scaling.md). `embed_tokens` runs the
lookup under `jax.shard_map` instead:

  1. the tokens gathered over the G devices that split the table's D (ints, a few KB);
  2. each device's `[Y / T, D / G]` shard of the table read at all of them (a vocab split over
     T devices: rows outside a device's shard are zero there, summed over the T);
  3. an all-to-all over the G devices: each gets its own tokens' rows, every D.

Its backward (autodiff through the shard_map) is the all-to-all back, a scatter-add into the
local shard, and the sum over the mesh axes that replicate the table: the sum every replicated
parameter's gradient takes. Where the table's D is not split, or a dimension does not divide
over its mesh axes, the lookup is `jnp.take` under XLA's partitioning (the same values).

Notation (docs/design.md): B batch, L sequence, Y vocabulary, D hidden size.
"""

import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec

from glm5_jax.layers import axes as axes_lib
from glm5_jax.layers.axes import BATCH, EMBED, LENGTH, VOCAB
from pallas_kernels.blocking import varying_axes


def _rows(table_YD, tokens_BL, first_row: int | jax.Array, dtype):
  """Rows `tokens - first_row` of `table_YD` in `dtype`; zero where that is outside the table."""
  local_BL = tokens_BL - first_row
  inside_BL = (local_BL >= 0) & (local_BL < table_YD.shape[0])
  rows_BLD = jnp.take(table_YD, jnp.where(inside_BL, local_BL, 0), axis=0)
  return jnp.where(inside_BL[..., None], rows_BLD, 0).astype(dtype)


def _divides(shape, spec, mesh) -> bool:
  return all(size % math.prod(mesh.shape[a] for a in axes_lib.spec_axes(axes)) == 0
             for size, axes in zip(shape, spec))


def embed_tokens(embedding_YD, tokens_BL, dtype):
  """`[B, L, D]` in `dtype`: row `tokens_BL[b, l]` of `embedding_YD`, the zero vector for an id
  outside `[0, Y)` (module docstring for the layout under a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return _rows(embedding_YD, tokens_BL, 0, dtype)
  table_spec = nn.logical_to_mesh_axes((VOCAB, EMBED))
  token_spec = nn.logical_to_mesh_axes((BATCH, LENGTH))
  vocab_axes, embed_axes = (axes_lib.spec_axes(a) for a in table_spec)
  if (not embed_axes or not _divides(embedding_YD.shape, table_spec, mesh)
      or not _divides(tokens_BL.shape, token_spec, mesh)):
    return _rows(embedding_YD, tokens_BL, 0, dtype)

  def lookup(table_yd, tokens_bl):
    # Tokens replicated over an axis of D's group (a size-1 axis, or one the batch does not
    # use) are gathered as copies: right, only redundant.
    missing = tuple(a for a in embed_axes if a not in varying_axes(tokens_bl))
    tokens_bl = jax.lax.pcast(tokens_bl, missing, to="varying") if missing else tokens_bl
    group_GBL = jax.lax.all_gather(tokens_bl, embed_axes, axis=0)
    first_row = jax.lax.axis_index(vocab_axes) * table_yd.shape[0] if vocab_axes else 0
    rows_GBLd = _rows(table_yd, group_GBL, first_row, dtype)
    if vocab_axes:
      rows_GBLd = jax.lax.psum(rows_GBLd, vocab_axes)
    return jax.lax.all_to_all(rows_GBLd, embed_axes, 0, 3, tiled=True)[0]

  return jax.shard_map(lookup, mesh=mesh, in_specs=(PartitionSpec(*table_spec),
                                                    PartitionSpec(*token_spec)),
                       out_specs=PartitionSpec(*token_spec, None))(embedding_YD, tokens_BL)
