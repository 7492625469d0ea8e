"""The public model API: `init_params`, `logits`, `forward`, and parameter metadata.

`config` everywhere is the model section of an experiment config (`get_config().model`, the
same ConfigDict `glm5_jax.load_hf` returns) or an already-built `ModelConfig`.
"""

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.config import ModelConfig
from glm5_jax.model import GLM5

_INIT_SHAPE = (1, 2)  # smallest input that traces every layer (MoE, DSA, MTP)


def build_model(config) -> GLM5:
  return GLM5(ModelConfig.from_config(config))


def _boxed_init(model: GLM5, rng):
  tokens = jnp.zeros(_INIT_SHAPE, jnp.int32)
  return model.init(rng, tokens)["params"]


def init_params(config, rng):
  """Randomly initialized params (HF's scheme: N(0, initializer_range) kernels, unit norms).

  Returns:
    a plain nested dict of arrays (no partitioning boxes).
  """
  return _init_params(ModelConfig.from_config(config), rng)


@functools.partial(jax.jit, static_argnums=0)  # compiled once per distinct config
def _init_params(cfg: ModelConfig, rng):
  return nn.meta.unbox(_boxed_init(GLM5(cfg), rng))


def abstract_params_and_axes(config):
  """`(shapes, logical_axes)` of the params from one shape-only trace, nothing allocated.

  Returns:
    shapes: tree of `jax.ShapeDtypeStruct`, the structure of `init_params`'s result.
    logical_axes: the same tree of `PartitionSpec`s of logical axis names (for
      `glm5_jax.sharding.param_shardings`).
  """
  model = build_model(config)
  boxed = jax.eval_shape(functools.partial(_boxed_init, model), jax.random.key(0))
  return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


def abstract_params(config):
  """`jax.ShapeDtypeStruct` tree of the params, computed without allocating anything."""
  return abstract_params_and_axes(config)[0]


def param_logical_axes(config):
  """Tree (same structure as params) of `PartitionSpec`s of logical axis names."""
  return abstract_params_and_axes(config)[1]


def forward(config, params, tokens_BL, positions_BL=None, segment_ids_BL=None, *,
            absorbed=False, mtp=True, dsa_stage="sparse"):
  """Full model outputs (main logits, MTP logits, final hidden state, aux); see `GLM5`."""
  model = build_model(config)
  return model.apply({"params": params}, tokens_BL, positions_BL, segment_ids_BL,
                     absorbed=absorbed, mtp=mtp, dsa_stage=dsa_stage)


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg: ModelConfig, params, tokens_BL):
  return forward(cfg, params, tokens_BL, mtp=False)["logits"]


def logits(config, params, tokens_BL):
  """Main-head logits, float32 `[batch, seq, vocab]`, for int tokens `[batch, seq]`."""
  return _logits(ModelConfig.from_config(config), params, jnp.asarray(tokens_BL, jnp.int32))
