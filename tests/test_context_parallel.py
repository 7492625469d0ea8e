"""Context parallelism (`mesh.shape.context`): one sequence split over devices equals the
unsharded model, forward and gradients, with packed documents straddling the shards, in the
contiguous and the load-balanced striped layout; the striped layout's balance; and the errors
for what it does not support (`glm5_jax.attention.context_parallel`)."""

import numpy as np
import pytest

from glm5_jax.attention import context_parallel
from glm5_jax.attention.context_parallel import check_context_parallel
from glm5_jax.config import ConfigError
from tests.conftest import run_on_host_devices

# One subprocess, one compile per run (unsharded, contiguous, striped): a 4-layer tiny model
# with an M, a D (sparse stage on the XLA path, top-k 16 of 32 keys), a G and an S layer
# (window 8), MTP after it (an S layer), expert-parallel MoE, mesh expert 2 x context 4 (the
# MoE's tokens over both). Documents of lengths 5, 14, 13 / 20, 12 cross the 8-token shards and
# the striped layout's 4-token chunks.
_SCRIPT = r"""
import json, jax, jax.numpy as jnp, numpy as np
import glm5_jax
from glm5_jax import sharding
from glm5_jax.attention import context_parallel
from glm5_jax.attention.mode import Mode
from tests.sharded_tiny import on_mesh, packed_batch
assert jax.device_count() == 8, jax.devices()
cfg, mesh, model, params, sh_params = on_mesh(
    dict(data=1, fsdp=1, context=4, expert=2, tensor=1), num_hidden_layers=4,
    attention_pattern="MDGS", sliding_window=8, dsa_impl="xla", mtp_depths=1,
    first_k_dense_replace=1, moe_impl="expert_parallel", moe_transport="all_to_all")
rules = cfg.mesh.logical_axis_rules
tokens, positions, segments = packed_batch(model.vocab_size)
B, L = tokens.shape
weights = jax.random.normal(jax.random.key(2), (B, L, model.vocab_size))

def step(layout):
  def loss(p, t, pos, seg, w):
    out = glm5_jax.forward(model, p, t, pos, seg,
                           mode=Mode(dsa_stage="sparse", context_layout=layout))
    kl = sum(jnp.sum(a["indexer_kl"]) for a in out["aux"]["layers"].values()
             if "indexer_kl" in a)
    return (jnp.sum(out["logits"] * w) + jnp.sum(out["mtp_logits"][0] * w) + kl,
            (out["logits"], out["mtp_logits"][0]))
  return jax.value_and_grad(loss, has_aux=True)

(ref_loss, ref_logits), ref_grads = jax.jit(step("contiguous"))(
    params, tokens, positions, segments, weights)
seq = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert", "context"))
diff = lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max())
scale = lambda a: float(np.abs(np.asarray(a)).max())
result = {"ref_loss": float(ref_loss)}
for layout in ("contiguous", "striped"):
  ways = 4 if layout == "striped" else 1
  order = lambda x: context_parallel.stripe(x, ways) if ways > 1 else x
  args = [jax.device_put(order(x), seq) for x in (tokens, positions, segments, weights)]
  with sharding.activation_sharding(mesh, rules):
    compiled = jax.jit(step(layout)).lower(sh_params, *args).compile()
    (cp_loss, cp_logits), cp_grads = compiled(sh_params, *args)
  back = lambda x: context_parallel.unstripe(x, ways) if ways > 1 else x
  result[layout] = {
      "loss": float(cp_loss),
      "logits": max(diff(back(a), b) for a, b in zip(cp_logits, ref_logits)),
      "grad_rel": max(diff(a, b) / max(scale(b), 1e-30) for a, b in zip(
          jax.tree_util.tree_leaves(cp_grads), jax.tree_util.tree_leaves(ref_grads))),
      "logits_spec": [str(a) for a in cp_logits[0].sharding.spec],
      "all_gathers": compiled.as_text().count("all-gather"),
  }
print(json.dumps(result))
"""


@pytest.mark.slow  # a subprocess with 8 host devices compiling a tiny forward + backward x 3
def test_context_parallel_matches_the_unsharded_model():
  result = run_on_host_devices(_SCRIPT, timeout=900)
  ref_loss = result["ref_loss"]
  for layout in ("contiguous", "striped"):
    got = result[layout]
    assert abs(got["loss"] - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (layout, result)
    assert got["logits"] < 1e-5, (layout, result)  # main and MTP logits
    assert got["grad_rel"] < 1e-5, (layout, result)
    # The sequence stays split over context to the output: nothing gathered the activations.
    assert got["logits_spec"][1] == "context", (layout, result)
    assert got["all_gathers"] > 0, (layout, result)  # the key state does travel


def test_striped_layout_balances_the_causal_work():
  # One document per row: contiguous, the last device attends 6.6x the first one's pairs;
  # striped, exactly the same on every device. Packed rows: closer than contiguous.
  one_doc = np.ones((2, 64), np.int32)
  contiguous = context_parallel.causal_work(one_doc, 4, "contiguous")
  striped = context_parallel.causal_work(one_doc, 4, "striped")
  assert contiguous.sum() == striped.sum() == 2 * 64 * 65 // 2
  assert contiguous.tolist() == [272, 784, 1296, 1808]
  assert striped.tolist() == [1040] * 4
  packed = np.repeat([[1, 2, 3]], [20, 24, 20], axis=1)
  ratio = lambda w: w.max() / w.min()
  assert ratio(context_parallel.causal_work(packed, 4, "striped")) < ratio(
      context_parallel.causal_work(packed, 4, "contiguous"))


def test_stripe_order_and_its_inverse():
  order = context_parallel.stripe_order(16, 4)
  # Device i (4 slots) holds chunks i and 7 - i of 2 tokens.
  assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
  x = np.arange(32).reshape(2, 16)
  np.testing.assert_array_equal(np.asarray(context_parallel.stripe(x, 4)), x[:, order])
  np.testing.assert_array_equal(
      np.asarray(context_parallel.unstripe(context_parallel.stripe(x, 4), 4)), x)
  assert context_parallel.stripe_order(6, 1).tolist() == list(range(6))


def test_unsupported_kinds_are_refused_naming_the_context_axis():
  for pattern, kind in (("MN", "gdn"), ("DN", "gdn"), ("ML", "simple_gdn")):
    with pytest.raises(ConfigError, match=rf"mesh.shape.context=4.*'{kind}'"):
      check_context_parallel(pattern, 4, 64, "data.seq_len")
  check_context_parallel("MN", 1, 63, "data.seq_len")  # no context axis: anything goes
  check_context_parallel("MDRSG", 4, 64, "data.seq_len")


def test_indivisible_sequence_is_refused_naming_the_field():
  with pytest.raises(ConfigError, match=r"data.seq_len=30 does not split over "
                                        r"mesh.shape.context=4"):
    check_context_parallel("MD", 4, 30, "data.seq_len")
  # The striped layout cuts the sequence into 2 x context chunks.
  with pytest.raises(ConfigError, match=r"data.seq_len=36 does not split over the 8 chunks of "
                                        r"the striped layout over mesh.shape.context=4"):
    check_context_parallel("MD", 4, 36, "data.seq_len", "striped")
  check_context_parallel("MD", 4, 36, "data.seq_len")


def test_validate_config_checks_the_context_axis():
  from configs import tiny
  from glm5_jax.config_validation import validate_config
  cfg = tiny.get_config()
  cfg.mesh.shape.update(data=1, context=4)
  cfg.data.seq_len = 258
  with pytest.raises(ConfigError, match=r"config.data.seq_len=258"):
    validate_config(cfg)
  cfg.data.seq_len = 256
  cfg.model.attention_pattern = "N"
  with pytest.raises(ConfigError, match=r"mesh.shape.context=4.*'gdn'"):
    validate_config(cfg)



def test_validate_config_refuses_a_stage_longer_than_the_positions():
  from configs import tiny
  from glm5_jax.config_validation import validate_config
  cfg = tiny.get_config()
  cfg.model.max_position_embeddings = cfg.data.seq_len - 1
  with pytest.raises(ConfigError, match=rf"config.data.seq_len: {cfg.data.seq_len} tokens per "
                                        r"sequence exceed model.max_position_embeddings="):
    validate_config(cfg)
