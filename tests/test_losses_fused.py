"""The fused, chunked LM head + cross-entropy (`train.ce_chunk`, `glm5_jax.train.fused_ce`), and
its form with the gradients made in the forward pass (`train.ce_grad_in_forward`), against the
logits path: statistics, gradients, the whole loss of the tiny model (gradient accumulation
included), and no `[B, L, Y]` array in the compiled program.

Notation: B batch, L sequence, D hidden, Y vocab.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.train import losses
from glm5_jax.train.step import StepConfig, loss_and_grads
from tests.conftest import run_on_host_devices
from tests.inputs import packed_batch


def relative_error(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_gradients_in_forward_match_the_logits_path():
  """Main head (z-loss on) and 2 MTP depths sharing the kernel, loss-mask holes and padding
  (zero weights), a chunk that divides no head's length: for the `ce_chunk` path
  (`fused_ce.head_statistics`) and the gradients-in-forward path, the objective, each head's
  CE, z-loss and accuracy equal the logits path's (same bf16 operands, fp32 logits), and the
  gradients in every head input and the kernel (of 3 x the objective, so the scalar cotangent
  counts) are within the bf16 cotangent's rounding of the logits path's fp32 cotangent's."""
  b, l, d, y, chunk, z = 2, 24, 16, 37, 5, 0.1
  kh, kw = jax.random.split(jax.random.key(1))
  h_UBLD = jax.random.normal(kh, (3, b, l, d)).astype(jnp.bfloat16)
  w_DY = (jax.random.normal(kw, (d, y)) * 0.5).astype(jnp.bfloat16)
  batch = packed_batch(y, b=b, l=l)
  coefficients = (1.0, 0.15, 0.15)

  def heads(path, h_UBLD, w_DY):
    if path == "logits":
      logits_UBLY = jnp.einsum("ubld,dy->ubly", h_UBLD, w_DY, preferred_element_type=jnp.float32)
      out = {"logits": logits_UBLY[0], "mtp_logits": logits_UBLY[1:]}
    else:
      out = {"head_inputs": h_UBLD[0], "mtp_head_inputs": h_UBLD[1:], "head_kernel": w_DY}
    if path == "in_forward":
      return losses.head_losses_with_gradients(out, batch, coefficients, z, chunk=chunk)
    ce_chunk = chunk if path == "ce_chunk" else 0
    results = ([losses.lm_losses(out, batch, z_loss_weight=z, chunk=ce_chunk)]
               + losses.mtp_losses(out, batch, chunk=ce_chunk))
    return sum(c * r["loss"] for c, r in zip(coefficients, results)), results

  @functools.partial(jax.jit, static_argnums=0)
  def run(path, h_UBLD, w_DY):
    def tripled(*args):
      objective, results = heads(path, *args)
      return 3.0 * objective, results
    return jax.value_and_grad(tripled, argnums=(0, 1), has_aux=True)(h_UBLD, w_DY)

  (want, want_results), want_grads = run("logits", h_UBLD, w_DY)
  assert want_results[0]["z_loss"] > 0 and len(want_results) == 3
  assert all(0 < r["weight"] < b * (l - 1 - k) for k, r in enumerate(want_results))
  for path in ("ce_chunk", "in_forward"):
    (got, results), grads = run(path, h_UBLD, w_DY)
    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=path)
    for k, (r, r_want) in enumerate(zip(results, want_results)):
      for name in ("loss", "ce", "z_loss", "accuracy", "weight"):
        np.testing.assert_allclose(r[name], r_want[name], rtol=1e-6, err_msg=(path, k, name))
    for g, g_want in zip(grads, want_grads):
      assert g.dtype == g_want.dtype
      assert relative_error(g, g_want) < 1e-2, (path, relative_error(g, g_want))


def _vocab_arrays(hlo_text: str, vocab: int):
  """Element counts of the arrays in `hlo_text` with a `vocab`-sized dimension, divided by it."""
  rows = []
  for dims in re.findall(r"(?:f32|bf16)\[([\d,]+)\]", hlo_text):
    shape = [int(x) for x in dims.split(",")]
    if vocab in shape:
      rows.append(int(np.prod(shape)) // vocab)
  return rows


def test_tiny_model_loss_and_grads_match_and_no_whole_logits_are_compiled(helpers):
  """The tiny model (MTP 2 depths, z-loss): `ce_chunk` 5 with the gradients in the forward,
  accumulated over 2 microbatches of unequal target counts, gives the logits path's one-batch
  loss terms and gradients to rounding, and its compiled gradient program holds no array with a
  vocab axis larger than one chunk's `[B / 2, 5, Y]` or the kernel's `[D, Y]` (the logits
  path's has `[B, L-1, Y]`)."""
  model = helpers.config(num_hidden_layers=1, first_k_dense_replace=1, mtp_depths=2,
                         attention_pattern="M")
  params = helpers.random_params(model)
  batch = packed_batch(model.vocab_size, b=4)
  results = {}
  for chunk, microbatches in ((0, 1), (5, 2)):
    step_cfg = StepConfig(z_loss_weight=0.01, ce_chunk=chunk, ce_grad_in_forward=chunk > 0,
                          microbatches=microbatches)
    # The train step's loss and gradients (the eval-only outputs compiled away).
    compiled = jax.jit(loss_and_grads, static_argnums=(0, 1)).lower(
        model, step_cfg, params, batch).compile()
    metrics, _, grads = compiled(params, batch)
    results[chunk] = metrics, grads, _vocab_arrays(compiled.as_text(), model.vocab_size)
  (metrics0, grads0, rows0), (metrics5, grads5, rows5) = results[0], results[5]
  for name in ("loss", "lm_loss", "z_loss", "accuracy", "mtp_loss", "mtp1_loss", "mtp2_accuracy",
               "target_tokens"):
    np.testing.assert_allclose(metrics5[name], metrics0[name], rtol=1e-5, err_msg=name)
  flat0 = dict(jax.tree_util.tree_leaves_with_path(grads0))
  for path, g5 in jax.tree_util.tree_leaves_with_path(grads5):
    g0 = flat0[path]
    if np.linalg.norm(np.asarray(g0)) > 0:
      assert relative_error(g5, g0) < 2e-2, (jax.tree_util.keystr(path), relative_error(g5, g0))
  whole = 4 * 23  # [B, L - 1, Y]
  assert max(rows0) >= whole
  assert max(rows5) <= max(2 * 5, model.hidden_size), rows5


_SHARDED_LOSS = r"""
import json, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from configs import tiny
from glm5_jax import sharding
from glm5_jax.planning import hlo_loops, hlo_stats
from glm5_jax.train import fused_ce

cfg = tiny.get_config()
cfg.mesh.shape.update(data=1, fsdp=2, expert=2, tensor=2)
rules, mesh = cfg.mesh.logical_axis_rules, sharding.make_mesh(cfg.mesh)
keys = jax.random.split(jax.random.key(0), 8)
b, d, y, chunk = 8, 16, 40, 4
heads = []
for i, l in enumerate((12, 11)):  # a main head and a shorter MTP depth (11 divides no mesh axis)
  heads.append((jax.random.normal(keys[2 * i], (b, l, d)).astype(jnp.bfloat16),
                jax.random.randint(keys[2 * i + 1], (b, l), 0, y),
                jax.random.uniform(keys[4 + i], (b, l)) / (b * l), jnp.full((b, l), 1e-3)))
w = (0.3 * jax.random.normal(keys[7], (d, y))).astype(jnp.bfloat16)

def in_forward(hs, w, rest):  # train.ce_grad_in_forward
  return fused_ce.loss_with_gradients([(h,) + r for h, r in zip(hs, rest)], w, chunk)

def recomputing(hs, w, rest):  # train.ce_chunk alone: the backward recomputes the logits
  stats = [fused_ce.head_statistics(h, w, t, chunk) for h, (t, *_) in zip(hs, rest)]
  loss = sum(((log_z - target) * a + log_z ** 2 * z).sum()
             for (log_z, target, _), (_, a, z) in zip(stats, rest))
  return loss, stats

err = lambda a, b: float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max()
                         / max(np.abs(np.asarray(b, np.float32)).max(), 1e-30))
hs, rest = [h for h, *_ in heads], [tuple(r) for _, *r in heads]
put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
result = {}
for objective in (in_forward, recomputing):
  grad = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)
  (want, want_stats), want_grads = jax.jit(grad)(hs, w, rest)
  with sharding.activation_sharding(mesh, rules):
    args = ([put(h, P(("data", "fsdp", "expert"))) for h in hs], put(w, P("fsdp", None)), rest)
    compiled = jax.jit(grad).lower(*args).compile()
    (got, got_stats), got_grads = compiled(*args)
  module = hlo_loops.parse_module(compiled.as_text())
  runs = module.executions()
  result[objective.__name__] = {
      "loss": [float(got), float(want)],
      "stats": max(err(g, w_) for g, w_ in zip(jax.tree.leaves(got_stats),
                                               jax.tree.leaves(want_stats))),
      "dh": max(err(g, w_) for g, w_ in zip(got_grads[0], want_grads[0])),
      "dw": err(got_grads[1], want_grads[1]),
      "collectives_in_loops": [i.op for c, instrs in module.computations.items()
                               if runs.get(c, 0) > 1 for i in instrs
                               if i.op.removesuffix("-start") in hlo_stats.OPS],
      "kernel_reductions": sorted({f"{i.op.removesuffix('-start')} {i.result_type.split('{')[0]}"
                                   for instrs in module.computations.values() for i in instrs
                                   if i.op.removesuffix("-start") in ("all-reduce", "reduce-scatter")
                                   and f",{y}]" in i.result_type})}
print(json.dumps(result))
"""


@pytest.mark.slow  # a subprocess with 8 host devices (~15 s)
def test_the_fused_head_on_a_mesh_reduces_the_kernel_gradient_once():
  """`loss_with_gradients` and `head_statistics`' recomputing backward on a mesh (batch over fsdp x expert, two heads, one of a length no
  axis divides) equals the unsharded loss, statistics and gradients, and its chunk loops hold
  no collective: the kernel is gathered once and the rows' dW reduced once (left to XLA's
  partitioner, each chunk gathered the kernel and all-reduced an fp32 `[D, Y]`), reduce-scattered
  over the kernel's own D split."""
  for name, result in run_on_host_devices(_SHARDED_LOSS, timeout=600).items():
    assert result["loss"][0] == pytest.approx(result["loss"][1], rel=1e-5), (name, result)
    assert result["stats"] < 1e-5 and result["dh"] < 1e-2 and result["dw"] < 1e-2, (name, result)
    assert result["collectives_in_loops"] == [], (name, result)
    # dW [16, 40] reduce-scattered over fsdp, the kernel's own D split ([8, 40] a device), and
    # all-reduced over expert: never reduced whole, nor scattered over every row axis
    assert any(r.startswith("reduce-scatter") for r in result["kernel_reductions"]), result
    assert all(r.endswith("[8,40]") for r in result["kernel_reductions"]), (name, result)
