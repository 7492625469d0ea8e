"""A float model's params quantized for serving (`model.quant`), or exported as INT4.

  model_q, params_q = quantize(model, params, "w4a8", group_size=128)   # then generate / Engine
  exported = export_int4_experts(model, params)                            # after INT4 QAT

`quantize` reads which leaves a quantized model stores as integers from the quantized model's
own abstract params (`glm5_jax.quant.linear` declares them: `<name>` int8 / packed uint8 and
`<name>_scale`), so it quantizes exactly what the modules will read, in either param layout:
  int8 leaf     INT8 per output channel: the scale reduces over the axes its `_scale` has size 1
                (the kernel's input axes; an expert's own [E, 1, O])
  uint8 leaf    INT4 per group of `quant_group_size` input rows (`qat.quantize_groups`, the
                rounding INT4 QAT trains with), packed two per byte (`ops.pack_int4`)
Every other leaf is copied unchanged. A model trained with `model.qat_int4_group_size = g`
quantizes with `quant_group_size = g` to exactly the INT4 values it was trained with.
"""

import jax
import jax.numpy as jnp
import ml_collections

from glm5_jax.api import abstract_params
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.quant import ops
from glm5_jax.quant.qat import quantize_groups

_EXPERT_KERNELS = ("gate_proj", "up_proj", "down_proj")


def quantized_config(model, fmt: str, group_size: int | None = None) -> ml_collections.ConfigDict:
  """The model section (a ConfigDict) with `quant = fmt` (and `quant_group_size`), validated."""
  out = ml_collections.ConfigDict(model.to_dict())
  if out.get("quant", "none") != "none":
    raise ConfigError(f"model.quant: the model is already quantized ({out.quant!r})")
  out.quant = fmt
  if group_size is not None:
    out.quant_group_size = group_size
  qat = out.get("qat_int4_group_size", 0)
  if fmt == "w4a8" and qat and qat != out.quant_group_size:
    raise ConfigError(f"model.quant_group_size: {out.quant_group_size} differs from the group "
                      f"size the model was trained with (model.qat_int4_group_size={qat})")
  out.qat_int4_group_size = 0  # a served model runs its stored integers, not fake quantization
  ModelConfig.from_config(out)
  return out


def quantize(model, params, fmt: str, group_size: int | None = None):
  """`(model_q, params_q)`: `params` (a float model's, either layout) stored as `fmt` requires.

  Raises:
    ConfigError: naming `model.quant` / `model.quant_group_size` (an unknown format, a group size
      that does not divide the expert input dims, a group size unlike the QAT one).
  """
  model_q = quantized_config(model, fmt, group_size)
  target = abstract_params(model_q)
  flat_in = _flat(params)
  out = {}
  for path, spec in _flat(target).items():
    if path[-1].endswith("_scale") and path[:-1] + (path[-1][:-len("_scale")],) in flat_in:
      continue  # filled with its kernel below
    if spec.dtype == jnp.int8:
      scale_spec = _flat(target)[path[:-1] + (path[-1] + "_scale",)]
      q, scale = _int8(flat_in[path], scale_spec.shape)
    elif spec.dtype == jnp.uint8:
      q, scale = ops.quantize_int4_groups(flat_in[path], model_q.quant_group_size)
    else:
      _assign(out, path, flat_in[path])
      continue
    _assign(out, path, q)
    _assign(out, path[:-1] + (path[-1] + "_scale",), scale)
  return model_q, out


def export_int4_experts(model, params) -> dict[str, jax.Array]:
  """The routed-expert kernels of a model trained with INT4 QAT (`model.qat_int4_group_size`),
  as `{"<path>": packed uint8 [..., I // 2, O], "<path>_scale": float32 [..., I // g, O]}`
  (paths "/"-joined in the params' own layout), e.g. for `safetensors.numpy.save_file`.

  Raises:
    ConfigError: the model was not trained with QAT (`model.qat_int4_group_size` is 0).
  """
  group = ModelConfig.from_config(model).qat_int4_group_size
  if not group:
    raise ConfigError("model.qat_int4_group_size: 0, the model was not trained with INT4 QAT; "
                      "quantize(model, params, 'w4a8') quantizes any model after training")
  out = {}
  for path, leaf in _flat(params).items():
    if len(path) >= 2 and path[-2] == "experts" and path[-1] in _EXPERT_KERNELS:
      q, scale = quantize_groups(leaf, group)
      out["/".join(path)] = ops.pack_int4(q)
      out["/".join(path) + "_scale"] = scale
  return out


def _int8(w, scale_shape):
  """INT8 per output channel: the amax over the axes where the scale has size 1."""
  axes = tuple(a for a, n in enumerate(scale_shape) if n == 1)
  w32 = w.astype(jnp.float32)
  amax = jnp.abs(w32).max(axis=axes, keepdims=True)
  scale = jnp.where(amax > 0, amax / ops.INT8_MAX, 1.0)
  q = jnp.clip(jnp.round(w32 / scale), -ops.INT8_MAX, ops.INT8_MAX).astype(jnp.int8)
  return q, scale


def _flat(tree) -> dict:
  return {tuple(str(getattr(k, "key", k)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assign(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value
