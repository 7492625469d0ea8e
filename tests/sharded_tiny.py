"""The tiny model on a host-device mesh and a batch of packed documents: the shared prefix of the
8-device scripts (tests/test_context_parallel.py, test_context_layout_train.py,
test_dsa_sharding.py, test_sharding.py), which import it in their subprocess
(`run_on_host_devices` puts the repository root on PYTHONPATH, so `from tests.sharded_tiny
import ...`)."""

import jax
import jax.numpy as jnp
import numpy as np

import glm5_jax
from configs import tiny
from glm5_jax import sharding
from glm5_jax.config import ModelConfig

# Documents per row (each row 32 tokens): on context 4 they cross the 8-token shards and the
# striped layout's 4-token chunks.
LENGTHS = ((5, 14, 13), (20, 12))


def _layout(mesh_shape: dict, model_overrides: dict):
  """configs/tiny.py with `model_overrides` on a mesh of `mesh_shape`: (config, mesh, param
  shapes, their shardings by the config's logical-axis rules)."""
  cfg = tiny.get_config()
  cfg.model.update(model_overrides)
  cfg.mesh.shape.update(mesh_shape)
  mesh = sharding.make_mesh(cfg.mesh)
  shapes, axes = glm5_jax.abstract_params_and_axes(cfg.model)
  return cfg, mesh, shapes, sharding.param_shardings(shapes, axes, mesh,
                                                     cfg.mesh.logical_axis_rules)


def on_mesh(mesh_shape: dict, **model_overrides):
  """configs/tiny.py with `model_overrides` on a mesh of `mesh_shape` (every axis named).

  Returns (config, mesh, ModelConfig, params from key 0, the same params placed by the
  config's logical-axis rules on the mesh).
  """
  cfg, mesh, _, shardings = _layout(mesh_shape, model_overrides)
  params = glm5_jax.init_params(cfg.model, jax.random.key(0))
  return cfg, mesh, ModelConfig.from_config(cfg.model), params, jax.device_put(params, shardings)


def abstract_on_mesh(mesh_shape: dict, **model_overrides):
  """`on_mesh` without arrays, for compiling only: (config, mesh, ModelConfig, the params as
  ShapeDtypeStructs carrying their shardings)."""
  cfg, mesh, shapes, shardings = _layout(mesh_shape, model_overrides)
  params = jax.tree_util.tree_map(
      lambda s, x: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=x), shapes, shardings)
  return cfg, mesh, ModelConfig.from_config(cfg.model), params


def packed_batch(vocab_size: int, lengths=LENGTHS):
  """Rows packed with documents of `lengths`: (tokens (random, key 1), positions (restarting at
  0 in each document), segment ids (1, 2, ... per document)), each [B, L] int32."""
  segments = jnp.asarray([np.repeat(np.arange(1, len(r) + 1), r) for r in lengths], jnp.int32)
  positions = jnp.asarray([np.concatenate([np.arange(n) for n in r]) for r in lengths],
                          jnp.int32)
  tokens = jax.random.randint(jax.random.key(1), segments.shape, 0, vocab_size)
  return tokens, positions, segments
