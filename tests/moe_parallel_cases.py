"""Worker for tests/test_moe_parallel.py: needs 8 host devices, so it runs in a subprocess.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/moe_parallel_cases.py MODE ARG

MODE `cases`, ARG a JSON list of `{"mesh": {axis: size}, "bias": "none"|"skewed", "batch":
[B, L], "matmul": model.moe_matmul, "transport": model.moe_transport, "chunks":
model.moe_dispatch_chunks}`: per case, the largest
differences between `moe_impl="expert_parallel"` (transport "all_to_all" unless given, sharded
on the mesh) and the unsharded `moe_impl="ragged"` reference, for the output, the aux values,
and the gradients w.r.t. the input and every parameter. The "ragged_all_to_all" transport runs
on `exact_ragged_all_to_all` (XLA:CPU cannot compile the collective).
MODE `capacity`: the capacity factor's drops against the rule, computed in numpy, on both
transports; and the two transports' gradients w.r.t. the tokens and the router weights.
MODE `ragged_transport`: lowers the "ragged_all_to_all" transport and tries to compile it.
MODE `model`: the tiny model's loss and gradients, expert-parallel on a mesh vs ragged.
MODE `hlo`: expert-weight all-gathers and all-to-alls in the compiled layer, per impl.
MODE `quantized`: W4A8 experts expert-parallel vs the unsharded quantized dispatch, and the
expert-weight all-gathers on the mesh.
Each prints one JSON line.
"""

import contextlib
import dataclasses
import functools
import json
import math
import re
import sys
from unittest import mock

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


def exact_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                            recv_sizes, *, axis_name, axis_index_groups=None):
  """`jax.lax.ragged_all_to_all` from all-gathers, which XLA:CPU compiles: source i's chunk for
  this device (`send_sizes` rows from its `input_offsets`) lands at the offset source i gave
  (`output_offsets`); every other row keeps `output`'s value, which the expert-parallel combine
  relies on (it receives into a used buffer)."""
  del recv_sizes
  assert axis_index_groups is None
  me = jax.lax.axis_index(axis_name)
  gather = lambda a: jax.lax.all_gather(a, axis_name)
  sources = gather(operand)  # [n, rows in, ...]
  start_N, size_N, from_N = (gather(a)[:, me] for a in (output_offsets, send_sizes,
                                                         input_offsets))
  t = jnp.arange(output.shape[0])
  inside_NT = (t >= start_N[:, None]) & (t < (start_N + size_N)[:, None])
  source_T = jnp.argmax(inside_NT, 0)
  row_T = jnp.clip(from_N[source_T] + t - start_N[source_T], 0, operand.shape[0] - 1)
  hit = inside_NT.any(0).reshape(-1, *(1,) * (output.ndim - 1))
  return jnp.where(hit, sources[source_T, row_T], output)


@contextlib.contextmanager
def exact_ragged_transport():
  """While active, `jax.lax.ragged_all_to_all` is `exact_ragged_all_to_all`, and the buffers the
  expert-parallel exchanges write into uninitialized (`moe_parallel._allocate`; zeros on
  CPU) are NaN: a row no message wrote that reached a result or a gradient would show, and so
  would a grouped matmul that read the received buffer's rows past its groups."""
  from glm5_jax import moe_parallel  # pylint: disable=g-import-not-at-top
  nan_buffer = lambda shape, dtype: jnp.full(shape, jnp.nan, dtype)
  with mock.patch.object(jax.lax, "ragged_all_to_all", exact_ragged_all_to_all), \
       mock.patch.object(moe_parallel, "_allocate", nan_buffer):
    yield


def shard_like(tree, logical, mesh, rules):
  shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
  return jax.device_put(tree, sharding.param_shardings(shapes, logical, mesh, rules))


def _put(x, batch_sharding):
  """`x` batch-sharded; replicated when its batch does not divide over the batch shards (the
  layer then pads its tokens itself, which is what such a case tests)."""
  axes = batch_sharding.spec[0]
  axes = (axes,) if isinstance(axes, str) else axes or ()
  shards = math.prod(batch_sharding.mesh.shape[a] for a in axes)
  if x.shape[0] % shards:
    batch_sharding = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
  return jax.device_put(x, batch_sharding)


def run_case(case):
  transport = case.get("transport", "all_to_all")
  if transport == "ragged_all_to_all":
    with exact_ragged_transport():
      return _run_case(case, transport)
  return _run_case(case, transport)


def _run_case(case, transport):
  ref_cfg = tiny_model_config(**MODEL)
  ep_cfg = dataclasses.replace(ref_cfg, moe_impl="expert_parallel", moe_transport=transport,
                               moe_matmul=case.get("matmul", "auto"),
                               moe_dispatch_chunks=case.get("chunks", 1))
  b, l = case.get("batch", (8, 12))
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
  batch, batch_2d = sharding.batch_sharding(mesh, rules, 3), sharding.batch_sharding(mesh, rules)
  sharded = shard_like(params, logical, mesh, rules)
  args = (sharded, _put(x_BLD, batch), _put(valid_BL, batch_2d), _put(probe_BLD, batch))
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


def capacity():
  """`capacity_factor` 1.0 on expert=8 with skewed routing: the dropped pairs are exactly those
  the rule names (each destination takes its sources in order, each source's rows in expert
  order, in groups of 16, up to ceil(c * m * X / 16) + E/n groups), and the output equals the dropless reference
  with those pairs' weights zeroed. A large factor drops nothing. The ragged transport (on
  `exact_ragged_all_to_all`) drops the same pairs and gives the same output and gradients (the
  dropped pairs' rows of its combine buffer hold the tokens' inputs until masked); the
  gradients in the tokens and the router weights are the reference's with those weights
  zeroed."""
  from glm5_jax import moe_parallel  # pylint: disable=g-import-not-at-top
  from glm5_jax.moe import dispatch_experts  # pylint: disable=g-import-not-at-top
  n, e, x, d, f, m_total = 8, 16, 4, 8, 16, 64
  ks = jax.random.split(jax.random.key(3), 5)
  x_MD = jax.random.normal(ks[0], (m_total, d))
  logits = jax.random.normal(ks[1], (m_total, e)).at[:, :4].add(3.0)  # experts 0-3: device 0, 1
  experts_MX = jax.lax.top_k(logits, x)[1].astype(jnp.int32)
  weights_MX = jax.random.uniform(ks[2], (m_total, x))
  w = [jax.random.normal(k, s) * 0.3 for k, s in zip(jax.random.split(ks[3], 3),
                                                      ((e, d, f), (e, d, f), (e, f, d)))]
  mesh = sharding.make_mesh(sharding.mesh_config(data=1, expert=n))
  rules = sharding.default_logical_axis_rules()
  dispatch = lambda c, transport: functools.partial(
      moe_parallel.expert_parallel_dispatch, transport=transport, capacity_factor=c,
      mesh=mesh, rules=rules)
  run = lambda c: (lambda y, dropped_S, _: (y, dropped_S.sum()))(
      *jax.jit(dispatch(c, "all_to_all"))(x_MD, weights_MX, experts_MX, *w))
  probe = jax.random.normal(ks[4], (m_total, d))

  def probed(xm, wm, transport):
    y, dropped_S, _ = dispatch(1.0, transport)(xm, wm, experts_MX, *w)
    return jnp.vdot(y, probe), (y, dropped_S.sum())

  # (y, dropped), (token and router-weight gradients) at capacity 1.0
  run_grads = lambda transport: (lambda out: (out[0][1], out[1]))(jax.jit(jax.value_and_grad(
      probed, argnums=(0, 1), has_aux=True), static_argnums=2)(x_MD, weights_MX, transport))
  (y, dropped), grads_dense = run_grads("all_to_all")
  y_big, dropped_big = run(8.0)
  with exact_ragged_transport():
    (y_ragged, dropped_ragged), grads_ragged = run_grads("ragged_all_to_all")
  # The rule, in numpy: shard i holds tokens [i*m, (i+1)*m); device k holds experts 2k, 2k+1.
  # Rows travel in groups of 16, each (source, expert) segment padded to whole groups; a
  # destination takes ceil(c * m * X / 16) + E/n groups, its sources in order, each source's
  # segments in expert order, whole groups (a segment cut keeps the pairs in its kept groups).
  m = m_total // n
  cap_groups = -(-math.ceil(1.0 * m * x) // 16) + e // n
  ex = np.asarray(experts_MX)
  keep = np.ones_like(ex, bool)
  filled = np.zeros(n, int)
  for i in range(n):
    flat = ex[i * m:(i + 1) * m].reshape(-1)
    for expert in range(e):
      pairs = np.flatnonzero(flat == expert)  # in token order: the stable sort's
      k = expert // (e // n)
      kept_groups = min(-(-len(pairs) // 16), cap_groups - filled[k])
      filled[k] += kept_groups
      for p in pairs[16 * kept_groups:]:
        keep[i * m + p // x, p % x] = False
  ref, _ = dispatch_experts(x_MD, weights_MX * keep, experts_MX, *w)
  full, _ = dispatch_experts(x_MD, weights_MX, experts_MX, *w)
  # The reference's gradients with the dropped pairs' weights zeroed (theirs are then zero too).
  ref_grads = jax.grad(lambda xm, wm: jnp.vdot(dispatch_experts(xm, wm * keep, experts_MX, *w)[0],
                                               probe), argnums=(0, 1))(x_MD, weights_MX)
  return {"dropped": float(dropped), "expected_dropped": float((~keep).mean()),
          "y_diff": float(np.abs(np.asarray(y) - np.asarray(ref)).max()),
          "big_dropped": float(dropped_big),
          "big_diff": float(np.abs(np.asarray(y_big) - np.asarray(full)).max()),
          "ragged_dropped": float(dropped_ragged),
          "ragged_y_diff": float(np.abs(np.asarray(y_ragged) - np.asarray(ref)).max()),
          "ragged_grad_diffs": [float(np.abs(np.asarray(a) - np.asarray(b)).max())
                                for a, b in zip(grads_ragged, grads_dense)],
          "ref_grad_diffs": [float(np.abs(np.asarray(a) - np.asarray(b)).max())
                             for a, b in zip(grads_dense, ref_grads)],
          "dropped_weight_grad": float(np.abs(np.asarray(grads_dense[1])[~keep]).max())}


def ragged_transport():
  """The production transport lowers (forward + backward) to `ragged_all_to_all`; XLA:CPU
  refuses to compile it."""
  cfg = tiny_model_config(**MODEL, moe_impl="expert_parallel",
                          moe_transport="ragged_all_to_all")
  mesh = sharding.make_mesh(sharding.mesh_config(data=1, expert=8))
  rules = sharding.default_logical_axis_rules()
  x_BLD = jnp.ones((8, 4, cfg.hidden_size))
  params = nn.meta.unbox(MoE(cfg).init(jax.random.key(0), x_BLD)["params"])
  loss = lambda p, x: MoE(cfg).apply({"params": p}, x)[0].sum()
  with sharding.activation_sharding(mesh, rules):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x_BLD)
    try:
      lowered.compile()
      error = ""
    except Exception as e:  # pylint: disable=broad-except
      error = f"{type(e).__name__}: {e}"
  return {"ragged_all_to_all": lowered.as_text().count("ragged_all_to_all"), "error": error}


def model():
  """Loss and gradients of the tiny model: expert-parallel on expert=2 x data=2 x fsdp=2 vs the
  unsharded ragged reference."""
  import glm5_jax  # pylint: disable=g-import-not-at-top
  from tests.conftest import random_params  # pylint: disable=g-import-not-at-top
  ref_cfg = tiny_model_config(scan_layers=False)
  ep_cfg = dataclasses.replace(ref_cfg, moe_impl="expert_parallel", moe_transport="all_to_all")
  params = random_params(ref_cfg)
  tokens_BL = jax.random.randint(jax.random.key(1), (8, 32), 0, ref_cfg.vocab_size)

  def loss(cfg, p, t):
    out = glm5_jax.forward(cfg, p, t)
    logp = jax.nn.log_softmax(out["logits"][:, :-1])
    return -jnp.take_along_axis(logp, t[:, 1:, None], -1).mean()

  step = lambda cfg: jax.jit(jax.value_and_grad(functools.partial(loss, cfg)))
  ref_loss, ref_grads = step(ref_cfg)(params, tokens_BL)
  mesh = sharding.make_mesh(sharding.mesh_config(data=2, fsdp=2, expert=2))
  rules = sharding.default_logical_axis_rules()
  shapes, logical = glm5_jax.abstract_params_and_axes(ref_cfg)
  sharded = jax.device_put(params, sharding.param_shardings(shapes, logical, mesh, rules))
  with sharding.activation_sharding(mesh, rules):
    ep_loss, ep_grads = step(ep_cfg)(sharded, jax.device_put(
        tokens_BL, sharding.batch_sharding(mesh, rules)))
    text = step(ep_cfg).lower(sharded, tokens_BL).as_text()
  grad_diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                  for a, b in zip(jax.tree.leaves(ep_grads), jax.tree.leaves(ref_grads)))
  return {"loss": float(ref_loss), "loss_diff": abs(float(ep_loss) - float(ref_loss)),
          "grad_diff": grad_diff, "all_to_all_lowered": "all_to_all" in text}


def hlo():
  """Per impl: expert-weight all-gathers and all-to-alls of the compiled layer (forward +
  backward) on expert=4 x fsdp=2, tokens over data, fsdp and expert."""
  from glm5_jax.planning import hlo_stats  # pylint: disable=g-import-not-at-top
  from tools.moe_collectives import (compile_moe_layer,  # pylint: disable=g-import-not-at-top
                                     expert_weight_gathers)
  cfg = tiny_model_config(**MODEL, n_shared_experts=0, moe_transport="all_to_all")
  mesh = sharding.make_mesh(sharding.mesh_config(data=1, fsdp=2, expert=4))
  rules = [(name, ("data", "fsdp", "expert") if name == "batch" else target)
           for name, target in sharding.default_logical_axis_rules()]
  result = {}
  for impl in ("ragged", "expert_parallel"):
    found = hlo_stats.collectives(compile_moe_layer(
        dataclasses.replace(cfg, moe_impl=impl), mesh, rules, batch=8, seq=12))
    result[impl] = {
        "expert_weight_gathers": [list(c.shape) for c in
                                  expert_weight_gathers(found, cfg.n_routed_experts)],
        "all_gathers": [list(c.shape) for c in found if c.op == "all-gather"],
        "weight_reductions": sorted([c.op, list(c.shape)] for c in found
                                    if c.op in ("all-reduce", "reduce-scatter")
                                    and len(c.shape) == 3),
        "all_to_alls": sum(c.op == "all-to-all" for c in found)}
  # The backward's rerun of the layer under a remat policy: the count exchange (the int32
  # all-to-all and all-gather) reruns unless the policy keeps its results.
  for policy in ("full", "save_selections"):
    text = compile_moe_layer(dataclasses.replace(cfg, moe_impl="expert_parallel",
                                                 remat_policy=policy),
                             mesh, rules, batch=8, seq=12, compiled=False)
    result[f"int32 exchanges, remat {policy}"] = {
        op: len(re.findall(rf"stablehlo\.{op}.*\n?.*-> tensor<[0-9x]*xi32>", text))
        for op in ("all_to_all", "all_gather")}
    # The router weights sent with the rows (fp32 `[n, slots, 16]`): the rerun sends them again
    # unless the policy keeps them (`moe_exchanged_weights`). The rows end in the hidden size,
    # so the pattern tells them apart only while that is not 16.
    assert cfg.hidden_size != 16, cfg.hidden_size
    result[f"weight exchanges, remat {policy}"] = len(
        re.findall(r"stablehlo\.all_to_all.*\n?.*-> tensor<[0-9x]*x16xf32>", text))
  # The shared experts' kernels (gathered) pass one barrier with the dispatch's token rows
  # (`SwiGLU(gathered_before=...)`): in the forward, in the rerun, and the cotangents' in the
  # backward.
  shared_cfg = dataclasses.replace(cfg, n_shared_experts=1, moe_impl="expert_parallel",
                                   remat_policy="save_selections")
  batch, seq, d, f = 8, 12, cfg.hidden_size, cfg.moe_intermediate_size
  kernels_and_rows = (f"tensor<{f}x{d}xf32>, tensor<{d}x{f}xf32>, tensor<{d}x{f}xf32>, "
                      f"tensor<{batch * seq}x{d}xf32>")
  text = compile_moe_layer(shared_cfg, mesh, rules, batch=batch, seq=seq, compiled=False)
  result["shared kernel barriers, remat save_selections"] = sum(
      line.endswith(": " + kernels_and_rows) for line in text.splitlines()
      if "stablehlo.optimization_barrier" in line)
  return result


def quantized():
  """Per mesh: the largest difference between W4A8 experts run expert-parallel on the mesh and
  the unsharded quantized dispatch (forward), and the compiled layer's expert-weight
  all-gathers."""
  from glm5_jax.planning import hlo_stats  # pylint: disable=g-import-not-at-top
  from tools.moe_collectives import expert_weight_gathers  # pylint: disable=g-import-not-at-top
  rules = sharding.default_logical_axis_rules()
  x_BLD = jax.random.normal(jax.random.key(0), (8, 12, 64))
  result = {}
  for fmt in ("w4a8",):  # W8A8 takes the same path with one scale group
    cfg = tiny_model_config(**MODEL, quant=fmt, quant_group_size=16)
    boxed = MoE(cfg).init(jax.random.key(1), x_BLD)["params"]
    logical, params = nn.get_partition_spec(boxed), nn.meta.unbox(boxed)
    rng = np.random.default_rng(2)
    draw = {jnp.uint8: lambda a: rng.integers(0, 256, a.shape).astype(np.uint8),
            jnp.int8: lambda a: rng.integers(-127, 128, a.shape).astype(np.int8)}
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: draw[a.dtype.type](a) if a.dtype.type in draw else
        rng.uniform(0.01, 0.02, a.shape).astype(np.float32)
        if jax.tree_util.keystr(path).endswith("_scale']") else a, params)
    apply = lambda c: jax.jit(lambda p, x: MoE(c).apply({"params": p}, x)[0])
    ref_y = apply(cfg)(params, x_BLD)
    for mesh_shape in ({"data": 1, "expert": 8}, {"data": 1, "fsdp": 2, "expert": 4}):
      mesh = sharding.make_mesh(sharding.mesh_config(**mesh_shape))
      args = (shard_like(params, logical, mesh, rules),
              _put(x_BLD, sharding.batch_sharding(mesh, rules, 3)))
      c = dataclasses.replace(cfg, moe_impl="expert_parallel", moe_transport="all_to_all")
      with sharding.activation_sharding(mesh, rules):
        y = apply(c)(*args)
        lowered = apply(c).lower(*args)
        text = lowered.compile().as_text()
      row = {"y": float(np.abs(np.asarray(y) - np.asarray(ref_y)).max()),
             "expert_weight_gathers": len(expert_weight_gathers(hlo_stats.collectives(text),
                                                                cfg.n_routed_experts)),
             "all_to_all_lowered": "all_to_all" in lowered.as_text()}
      row["y_scale"] = float(np.abs(np.asarray(ref_y)).max())
      result[f"{fmt} {mesh_shape}"] = row
  return result


if __name__ == "__main__":
  assert jax.device_count() == 8, jax.devices()
  mode = sys.argv[1]
  if mode == "cases":
    print(json.dumps([run_case(case) for case in json.loads(sys.argv[2])]))
  else:
    print(json.dumps({"ragged_transport": ragged_transport, "model": model, "hlo": hlo,
                      "quantized": quantized, "capacity": capacity}[mode]()))
