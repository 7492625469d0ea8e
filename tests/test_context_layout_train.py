"""The trainer's striped context layout (`mesh.context_layout="striped"`): a train step's loss,
metrics and gradients equal the contiguous layout's on 8 simulated devices (fp32), and the
field is validated (`glm5_jax.train.step.compute_loss`)."""

import pytest

from glm5_jax.config import ConfigError
from glm5_jax.config_validation import validate_config
from tests.conftest import load_config_module, run_on_host_devices

# One subprocess, two compiles: the loss and gradients of `loss_and_grads` (the trainer's) in
# each layout on mesh data 2 x context 4, a tiny model with a D layer on the XLA sparse path
# (its indexer KL in the loss), an M layer and one MTP depth, packed documents crossing the
# shards and the striped layout's 4-token chunks, a loss mask hiding some targets.
_SCRIPT = r"""
import json, jax, jax.numpy as jnp, numpy as np
from glm5_jax import sharding
from glm5_jax.train.step import StepConfig, compute_loss, loss_and_grads
from tests.sharded_tiny import on_mesh, packed_batch
assert jax.device_count() == 8, jax.devices()
cfg, mesh, model, _, sh_params = on_mesh(
    dict(data=2, fsdp=1, context=4, expert=1, tensor=1), num_hidden_layers=2,
    attention_pattern="MD", dsa_impl="xla", mtp_depths=1, first_k_dense_replace=1,
    dtype="float32")
rules = cfg.mesh.logical_axis_rules
tokens, positions, segments = packed_batch(model.vocab_size)
B, L = tokens.shape
batch = {"tokens": tokens, "segment_ids": segments, "positions": positions,
         "loss_mask": jnp.asarray(np.random.default_rng(0).random((B, L)) > 0.2, jnp.float32)}
seq = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "context"))
sh_batch = jax.device_put(batch, seq)
out = {}
for layout in ("contiguous", "striped"):
  step_cfg = StepConfig(dsa_stage="sparse", context_layout=layout)
  def run(p, b):
    metrics, _, grads = loss_and_grads(model, step_cfg, p, b)
    _, (_, _, predictions, nll) = compute_loss(model, step_cfg, p, b)
    return metrics, grads, predictions, nll
  with sharding.activation_sharding(mesh, rules):
    out[layout] = jax.jit(run)(sh_params, sh_batch)
diff = lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max())
scale = lambda a: max(float(np.abs(np.asarray(a)).max()), 1e-30)
(m0, g0, p0, n0), (m1, g1, p1, n1) = out["contiguous"], out["striped"]
print(json.dumps({
    "metrics": {k: [float(m0[k]), float(m1[k])] for k in m0},
    "grad_rel": max(diff(a, b) / scale(b) for a, b in zip(jax.tree_util.tree_leaves(g1),
                                                          jax.tree_util.tree_leaves(g0))),
    "predictions_equal": bool(np.array_equal(np.asarray(p0), np.asarray(p1))),
    "nll": diff(n0, n1)}))
"""


@pytest.mark.slow
def test_striped_train_step_equals_the_contiguous_one():
  result = run_on_host_devices(_SCRIPT, timeout=900)
  for name, (contiguous, striped) in result["metrics"].items():
    assert abs(contiguous - striped) <= 1e-5 * max(1.0, abs(contiguous)), (name, result)
  assert result["metrics"]["indexer_kl"][0] > 0, result  # the D layer's KL is in the loss
  assert result["metrics"]["mtp_loss"][0] > 0, result
  assert result["grad_rel"] < 1e-5, result
  assert result["predictions_equal"], result
  assert result["nll"] < 1e-5, result


def _tiny_config(**mesh_shape):
  config = load_config_module("configs/tiny.py").get_config()
  config.mesh.shape.update(mesh_shape)
  return config


def test_context_layout_is_validated_naming_the_field():
  config = _tiny_config()
  config.mesh.context_layout = "interleaved"
  with pytest.raises(ConfigError, match=r"mesh\.context_layout"):
    validate_config(config)


def test_striped_layout_needs_two_chunks_per_device():
  config = _tiny_config(data=1, context=4)
  config.mesh.context_layout = "striped"
  config.data.seq_len = 4 * 65  # splits over 4 devices, not into 8 chunks
  config.model.max_position_embeddings = max(config.model.max_position_embeddings, 260)
  with pytest.raises(ConfigError, match=r"data\.seq_len=260 does not split over the 8 chunks"):
    validate_config(config)
  config.mesh.context_layout = "contiguous"
  validate_config(config)
