"""Worker for tests/test_moe_parallel.py: needs 8 host devices, so it runs in a subprocess.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/moe_parallel_cases.py CASES

CASES is a JSON list of `{"mesh": {axis: size}, "bias": "none"|"skewed", "batch": [B, L]}`.
Prints one JSON line: per case, the largest differences between `moe_impl="expert_parallel"`
(transport "all_to_all", sharded on the mesh) and the unsharded `moe_impl="ragged"` reference,
for the output, the aux values, and the gradients w.r.t. the input and every parameter.
"""

import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from glm5_jax import sharding
from glm5_jax.moe import MoE
from tests.conftest import tiny_model_config

# 16 experts, top-4: with expert=8 each device holds 2 experts, fewer than a token's X, so
# the worst-case slot m * min(X, E/n) is exercised below m * X.
MODEL = dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32)


def moe_loss(cfg, params, x_BLD, valid_BL, probe_BLD):
  y_BLD, aux = MoE(cfg).apply({"params": params}, x_BLD, valid_BL)
  loss = (y_BLD * probe_BLD).sum() + aux["sequence_balance_loss"]
  return loss, (y_BLD, aux)


def shard_like(tree, logical, mesh, rules):
  shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
  return jax.device_put(tree, sharding.param_shardings(shapes, logical, mesh, rules))


def run_case(case, transport="all_to_all"):
  ref_cfg = tiny_model_config(**MODEL)
  ep_cfg = dataclasses.replace(ref_cfg, moe_impl="expert_parallel", moe_transport=transport)
  b, l = case.get("batch", (4, 24))
  d = ref_cfg.hidden_size
  keys = jax.random.split(jax.random.key(case.get("seed", 0)), 4)
  x_BLD = jax.random.normal(keys[0], (b, l, d))
  probe_BLD = jax.random.normal(keys[1], (b, l, d))
  valid_BL = jax.random.uniform(keys[2], (b, l)) > 0.2
  boxed = MoE(ref_cfg).init(keys[3], x_BLD, valid_BL)["params"]
  logical = nn.get_partition_spec(boxed)
  params = nn.meta.unbox(boxed)
  if case.get("bias") == "skewed":  # nearly every token picks experts 3 and 11
    bias = jnp.zeros(ref_cfg.n_routed_experts).at[3].set(10.0).at[11].set(9.0)
    params = dict(params, e_score_correction_bias=bias)

  grad_fn = lambda cfg: jax.jit(jax.grad(functools.partial(moe_loss, cfg), argnums=(0, 1),
                                         has_aux=True))
  (ref_gp, ref_gx), (ref_y, ref_aux) = grad_fn(ref_cfg)(params, x_BLD, valid_BL, probe_BLD)

  mesh = sharding.make_mesh(sharding.mesh_config(**case["mesh"]))
  rules = sharding.default_logical_axis_rules()
  batch = sharding.batch_sharding(mesh, rules, 3)
  sharded = shard_like(params, logical, mesh, rules)
  args = (sharded, jax.device_put(x_BLD, batch),
          jax.device_put(valid_BL, sharding.batch_sharding(mesh, rules)),
          jax.device_put(probe_BLD, batch))
  with sharding.activation_sharding(mesh, rules):
    (gp, gx), (y, aux) = grad_fn(ep_cfg)(*args)
    lowered = grad_fn(ep_cfg).lower(*args).as_text()

  diff = lambda a, r: float(np.abs(np.asarray(a) - np.asarray(r)).max())
  flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_gp))
  grads = {jax.tree_util.keystr(k): diff(v, flat_ref[k])
           for k, v in jax.tree_util.tree_leaves_with_path(gp)}
  counts = np.asarray(ref_aux["expert_counts"])
  return {
      "y": diff(y, ref_y), "y_scale": float(np.abs(np.asarray(ref_y)).max()),
      "counts_equal": bool((np.asarray(aux["expert_counts"]) == counts).all()),
      "max_count_share": float(counts.max() / counts.sum()),
      "balance": diff(aux["sequence_balance_loss"], ref_aux["sequence_balance_loss"]),
      "grad_x": diff(gx, ref_gx), "grads": grads,
      "all_to_all_lowered": "all_to_all" in lowered,
      "expert_grad_sharding": str(gp["experts"]["gate_proj"].sharding.spec),
  }


if __name__ == "__main__":
  assert jax.device_count() == 8, jax.devices()
  print(json.dumps([run_case(case) for case in json.loads(sys.argv[1])]))
