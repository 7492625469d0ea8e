"""The fused, chunked LM head + cross-entropy (`train.ce_chunk`, `glm5_jax.train.fused_ce`)
against the logits path: statistics, gradients, the whole loss of the tiny model, and no
`[B, L, Y]` array in the compiled program.

Notation: B batch, L sequence, D hidden, Y vocab.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.train import fused_ce, losses
from glm5_jax.train.step import StepConfig, loss_and_grads
from tests.inputs import packed_batch


def relative_error(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_head_statistics_and_gradients_match_the_logits_path():
  """Odd sizes, a chunk that does not divide L: log Z, the target logit and the argmax equal
  those of the whole fp32 logits (same bf16 operands); the gradients of CE + z-loss in h and W
  are within the bf16 cotangent's rounding of the fp32 cotangent's."""
  b, l, d, y, chunk = 2, 7, 16, 37, 3
  kh, kw, kt, kg = jax.random.split(jax.random.key(0), 4)
  h_BLD = jax.random.normal(kh, (b, l, d)).astype(jnp.bfloat16)
  w_DY = (jax.random.normal(kw, (d, y)) * 0.5).astype(jnp.bfloat16)
  t_BL = jax.random.randint(kt, (b, l), 0, y)
  weights_BL = (jax.random.uniform(kg, (b, l)) > 0.3).astype(jnp.float32)

  logits_BLY = jnp.einsum("bld,dy->bly", h_BLD, w_DY, preferred_element_type=jnp.float32)
  log_z, target, argmax = fused_ce.head_statistics(h_BLD, w_DY, t_BL, chunk)
  np.testing.assert_allclose(log_z, jax.nn.logsumexp(logits_BLY, -1), rtol=1e-6)
  np.testing.assert_allclose(target, jnp.take_along_axis(logits_BLY, t_BL[..., None], -1)[..., 0],
                             rtol=1e-6)
  np.testing.assert_array_equal(argmax, jnp.argmax(logits_BLY, -1))

  def logits_loss(h, w):
    logits = jnp.einsum("bld,dy->bly", h, w, preferred_element_type=jnp.float32)
    return losses.cross_entropy(logits, t_BL, weights_BL, 0.1)["loss"]

  def fused_loss(h, w):
    return losses.fused_cross_entropy(h, w, t_BL, weights_BL, 0.1, chunk=chunk)["loss"]

  value, grads = jax.value_and_grad(logits_loss, argnums=(0, 1))(h_BLD, w_DY)
  fused_value, fused_grads = jax.value_and_grad(fused_loss, argnums=(0, 1))(h_BLD, w_DY)
  np.testing.assert_allclose(fused_value, value, rtol=1e-6)
  for fused, reference in zip(fused_grads, grads):
    assert fused.dtype == reference.dtype
    assert relative_error(fused, reference) < 1e-2


def _vocab_arrays(hlo_text: str, vocab: int):
  """Element counts of the arrays in `hlo_text` with a `vocab`-sized dimension, divided by it."""
  rows = []
  for dims in re.findall(r"(?:f32|bf16)\[([\d,]+)\]", hlo_text):
    shape = [int(x) for x in dims.split(",")]
    if vocab in shape:
      rows.append(int(np.prod(shape)) // vocab)
  return rows


def test_tiny_model_loss_and_grads_match_and_no_whole_logits_are_compiled(helpers):
  """The tiny model (MTP 2 depths, z-loss): `ce_chunk` 5 gives the logits path's loss terms and
  gradients to rounding, and its compiled gradient program holds no array with a vocab axis
  larger than one chunk's `[B, 5, Y]` or the kernel's `[D, Y]` (the logits path's has `[B, L-1,
  Y]`)."""
  model = helpers.config(num_hidden_layers=1, first_k_dense_replace=1, mtp_depths=2,
                         attention_pattern="M")
  params = helpers.random_params(model)
  batch = packed_batch(model.vocab_size, b=4)
  results = {}
  for chunk in (0, 5):
    step_cfg = StepConfig(z_loss_weight=0.01, ce_chunk=chunk)
    # The train step's loss and gradients (the eval-only outputs compiled away).
    compiled = jax.jit(loss_and_grads, static_argnums=(0, 1)).lower(
        model, step_cfg, params, batch).compile()
    metrics, _, grads = compiled(params, batch)
    results[chunk] = metrics, grads, _vocab_arrays(compiled.as_text(), model.vocab_size)
  (metrics0, grads0, rows0), (metrics5, grads5, rows5) = results[0], results[5]
  for name in ("loss", "lm_loss", "z_loss", "accuracy", "mtp_loss", "mtp1_loss", "mtp2_accuracy"):
    np.testing.assert_allclose(metrics5[name], metrics0[name], rtol=1e-5, err_msg=name)
  flat0 = dict(jax.tree_util.tree_leaves_with_path(grads0))
  for path, g5 in jax.tree_util.tree_leaves_with_path(grads5):
    g0 = flat0[path]
    if np.linalg.norm(np.asarray(g0)) > 0:
      assert relative_error(g5, g0) < 2e-2, (jax.tree_util.keystr(path), relative_error(g5, g0))
  whole = 4 * 23  # [B, L - 1, Y]
  assert max(rows0) >= whole
  assert max(rows5) <= max(4 * 5, model.hidden_size), rows5
