"""Logical axis names (glm5_jax.layers.axes): a misspelled name is an error, never a silently
replicated weight; every parameter of every attention kind, MoE and MTP uses known names, and
every name the default rules list exists."""

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn

import glm5_jax
from glm5_jax.sharding import default_logical_axis_rules
from glm5_jax.layers import axes
from glm5_jax.layers.params import constrain, param


class _Typo(nn.Module):
  @nn.compact
  def __call__(self):
    return param(self, "w", (2, 3), ("embd", axes.MLP), jnp.float32, nn.initializers.zeros)


def test_misspelled_axis_name_is_refused():
  with pytest.raises(ValueError, match=r"parameter w: unknown logical axis names \['embd'\]"):
    _Typo().init(jax.random.key(0))
  with pytest.raises(ValueError, match=r"activation constraint: unknown .*\['lenght'\]"):
    constrain(jnp.zeros((1, 2, 3)), (axes.BATCH, "lenght", axes.EMBED))


def test_every_param_uses_known_axis_names(helpers):
  cfg = helpers.config(attention_pattern="DRGS", first_k_dense_replace=1)
  specs = jax.tree_util.tree_leaves(glm5_jax.param_logical_axes(cfg),
                                    is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  used = {name for spec in specs for name in spec if name is not None}
  assert used <= axes.ALL
  assert {axes.EMBED, axes.HEADS, axes.KV_HEADS, axes.INDEX_HEADS, axes.EXPERT} <= used
  assert {name for name, _ in default_logical_axis_rules()} <= axes.ALL
