"""`CacheSpec`: the shape, dtype, logical axes and fill value of one decode-cache array.

Each attention kind describes its per-layer decode cache as `{name: CacheSpec}` (the
`decode_cache` field of its `glm5_jax.attention.kinds.AttentionKind`); `glm5_jax.infer.cache`
stacks those into the model's cache tree, allocates it and shards it. This module imports
nothing from `glm5_jax` (the kinds registry, which imports nothing either, builds specs).
"""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """One cache array of one layer, leading dim B (slots).

  Attributes:
    shape: e.g. `(slots, max_len, kv_lora_rank)`.
    dtype: a dtype name numpy / jnp understand ("bfloat16", "float32", "int32").
    axes: one logical axis name (`glm5_jax.layers.axes`) or None per dim.
    fill: the value of an empty cache (0; -1 for stored positions of an empty ring row).
  """

  shape: tuple[int, ...]
  dtype: str
  axes: tuple[str | None, ...]
  fill: float | int = 0

  def __post_init__(self):
    if len(self.shape) != len(self.axes):
      raise ValueError(f"CacheSpec: shape {self.shape} and axes {self.axes} differ in rank")
    if any(not isinstance(n, int) or n < 1 for n in self.shape):
      raise ValueError(f"CacheSpec: shape {self.shape} must be positive ints")

  @property
  def size(self) -> int:
    """Numbers held (all slots, all rows)."""
    return math.prod(self.shape)
