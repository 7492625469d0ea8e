"""The integer formats of quantized inference and their matmuls (W8A8, W4A8).

Weights (kernels in our `[..., I, O]` layout, input axis second to last):
  - INT8 per output channel: `q int8 [..., I, O]`, `scale float32 [..., 1, O] = max_I |w| / 127`.
  - INT4 per group of `group` input rows (the routed experts): values in [-8, 7] with
    `scale [..., I // group, O] = max |w| / 7` (`qat.quantize_groups`, the same rounding QAT
    trains with), stored packed two per byte along I (`pack_int4`: row 2k in the low nibble,
    row 2k + 1 in the high one), `uint8 [..., I // 2, O]`.
Activations: INT8 per token (per row of `x [..., I]`), `scale = max_I |x| / 127`, computed at run
time (dynamic), as GLM-5's serving recipe does.

Matmuls: `jax.lax.dot_general` on the int8 operands with `preferred_element_type=int32`, so the
products accumulate exactly in int32 where the backend has integer matmuls (TPU MXU, GPU
IMMA; XLA:CPU computes the same integers), then one float multiply by the two scales. With
INT4 groups the int32 partial sums are taken per group (a batched dot over groups) and each
group's sum is scaled by its own weight scale before the groups are added, which is exact
integer arithmetic inside each group. Imports only jax (bottom floor, beside `qat.py`).
"""

import jax
import jax.numpy as jnp

from glm5_jax.quant.qat import quantize_groups

INT8_MAX = 127


def quantize_int8_channels(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`w [..., I, O]` -> `(q int8 [..., I, O], scale float32 [..., 1, O])`."""
  amax = jnp.abs(w.astype(jnp.float32)).max(axis=-2, keepdims=True)
  scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
  q = jnp.clip(jnp.round(w.astype(jnp.float32) / scale), -INT8_MAX, INT8_MAX)
  return q.astype(jnp.int8), scale


def quantize_tokens(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-token (per row) INT8: `x [..., I]` -> `(q int8 [..., I], scale float32 [..., 1])`."""
  amax = jnp.abs(x.astype(jnp.float32)).max(axis=-1, keepdims=True)
  scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
  q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -INT8_MAX, INT8_MAX)
  return q.astype(jnp.int8), scale


def pack_int4(q: jax.Array) -> jax.Array:
  """int8 values in [-8, 7], `[..., I, O]` (I even) -> `uint8 [..., I // 2, O]`."""
  if q.shape[-2] % 2:
    raise ValueError(f"INT4 packing pairs input rows; input dim {q.shape[-2]} is odd")
  nibbles = (q.astype(jnp.int32) & 0xF).astype(jnp.uint8)
  return nibbles[..., 0::2, :] | (nibbles[..., 1::2, :] << 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
  """`uint8 [..., I // 2, O]` -> int8 `[..., I, O]` in [-8, 7] (sign-extended nibbles)."""
  low = (packed & 0xF).astype(jnp.int8)
  high = (packed >> 4).astype(jnp.int8)
  low = jnp.where(low > 7, low - 16, low)
  high = jnp.where(high > 7, high - 16, high)
  return jnp.stack([low, high], axis=-2).reshape(
      *packed.shape[:-2], 2 * packed.shape[-2], packed.shape[-1])


def quantize_int4_groups(w: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
  """`w [..., I, O]` -> `(packed uint8 [..., I // 2, O], scale float32 [..., I // group, O])`."""
  q, scale = quantize_groups(w, group)
  return pack_int4(q), scale


def int8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """W8A8: `x [..., I]` (float) @ INT8 weight `q [I, O]` with `scale [1, O]` -> `[..., O]` in
  `dtype`; x quantized per token, products accumulated in int32."""
  xq, xs = quantize_tokens(x)
  acc = jax.lax.dot_general(xq, q, (((xq.ndim - 1,), (0,)), ((), ())),
                            preferred_element_type=jnp.int32)
  return (acc.astype(jnp.float32) * xs * scale[0]).astype(dtype)


def int4_matmul(x: jax.Array, packed: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """W4A8: `x [M, I]` @ INT4 weight (`packed [I // 2, O]`, `scale [I // group, O]`) -> `[M, O]`;
  int32 sums per group, each scaled by its group's weight scale, then summed."""
  q = unpack_int4(packed)
  i, o = q.shape
  groups = scale.shape[0]
  xq, xs = quantize_tokens(x)
  xg = xq.reshape(x.shape[0], groups, i // groups)
  qg = q.reshape(groups, i // groups, o)
  acc_GMO = jax.lax.dot_general(xg, qg, (((2,), (1,)), ((1,), (0,))),
                                preferred_element_type=jnp.int32)
  y = jnp.einsum("gmo,go->mo", acc_GMO.astype(jnp.float32), scale)
  return (y * xs).astype(dtype)
