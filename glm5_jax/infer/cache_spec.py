"""`CacheSpec`: the shape, dtype, logical axes and initial value of one decode-cache array.

Each attention kind states its per-layer cache as `{name: CacheSpec}`
(`glm5_jax.attention.kinds.AttentionKind.decode_cache`); the engine allocates the arrays from
it (filled with `fill`) and shards them by `axes`. This module imports nothing of `glm5_jax`,
so the kind registry can name it without an import cycle.
"""

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """One cache array of one layer.

  Attributes:
    shape: the full shape, leading dim the slots (B).
    dtype: anything `jnp.dtype` accepts ("bfloat16", "float32", "int32", ...).
    axes: one logical axis name (`glm5_jax.layers.axes`) or None per dim.
    fill: the value of an empty cache (0, or -1 for "no position stored").
  """

  shape: tuple
  dtype: Any
  axes: tuple
  fill: Any
