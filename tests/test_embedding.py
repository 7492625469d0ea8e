"""`glm5_jax.layers.embedding.embed_tokens`: the lookup under a mesh (its table split over D by
fsdp and over the vocabulary by tensor) gives `jnp.take`'s rows and gradient, zero rows for ids
outside the vocabulary, and moves no collective the size of the table."""

from tests.conftest import run_on_host_devices

_SCRIPT = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np
from flax import linen as nn
from glm5_jax import sharding
from glm5_jax.layers.embedding import embed_tokens

cfg = sharding.mesh_config()
cfg.shape.update(dict(fsdp=2, expert=2, tensor=2))
mesh = sharding.make_mesh(cfg)
y, d, b, l = 24, 16, 8, 6
rng = np.random.default_rng(0)
table = jnp.asarray(rng.standard_normal((y, d)), jnp.float32)
tokens = jnp.asarray(rng.integers(0, y, (b, l)), jnp.int32)
tokens = tokens.at[0, 0].set(-1).at[1, 2].set(y).at[3, 5].set(y + 7)  # outside: zero rows
cotangent = jnp.asarray(rng.standard_normal((b, l, d)), jnp.float32)
valid = (tokens >= 0) & (tokens < y)


def plain(table):
  rows = jnp.take(table, jnp.where(valid, tokens, 0), axis=0)
  return jnp.where(valid[..., None], rows, 0).astype(jnp.bfloat16)


def loss(lookup, table):
  return jnp.sum(lookup(table).astype(jnp.float32) * cotangent)


want_rows = plain(table)
want_grad = jax.grad(lambda t: loss(plain, t))(table)
with jax.set_mesh(mesh), nn.logical_axis_rules(cfg.logical_axis_rules):
  spec = jax.sharding.PartitionSpec(*nn.logical_to_mesh_axes(("vocab", "embed")))
  placed = jax.device_put(table, jax.NamedSharding(mesh, spec))
  sharded = lambda t: embed_tokens(t, tokens, jnp.bfloat16)
  rows = jax.jit(sharded)(placed)
  grad_fn = jax.jit(jax.grad(lambda t: loss(sharded, t)))
  grad = grad_fn(placed)
  hlo = grad_fn.lower(placed).compile().as_text()
sizes = [int(np.prod([int(n) for n in dims.split(",") if n] or [1]))
         for dims in re.findall(r"= \(?\w+\[([\d,]*)\][^=]*? (?:all-reduce|all-gather|all-to-all|"
                                r"reduce-scatter|collective-permute)(?:-start)?\(", hlo)]
print(json.dumps({"spec": str(tuple(spec)), "rows": float(jnp.abs(rows.astype(jnp.float32)
                                                           - want_rows.astype(jnp.float32)).max()),
                  "zero_rows": float(jnp.abs(rows[~valid].astype(jnp.float32)).max()),
                  "grad": float(jnp.abs(grad - want_grad).max()),
                  "grad_scale": float(jnp.abs(want_grad).max()),
                  "largest_collective": max(sizes), "table": y * d}))
"""


def test_sharded_lookup_matches_take_and_keeps_the_table_local():
  got = run_on_host_devices(_SCRIPT)
  assert got["spec"] == "('tensor', ('fsdp', 'context'))", got
  assert got["rows"] == 0.0 and got["zero_rows"] == 0.0, got
  assert got["grad"] <= 1e-6 * got["grad_scale"], got
  # the largest collective is a shard's gradient summed over `expert` ([Y / 2, D / 2]), or the
  # rows of the tokens: never the whole table
  assert got["largest_collective"] <= got["table"] // 4, got
