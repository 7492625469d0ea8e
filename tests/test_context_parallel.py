"""Context parallelism (`mesh.shape.context`): one sequence split over devices equals the
unsharded model, forward and gradients, with packed documents straddling the shards; and the
errors for what it does not support (`glm5_jax.attention.context_parallel`)."""

import pytest

from glm5_jax.attention.context_parallel import check_context_parallel
from glm5_jax.config import ConfigError
from tests.conftest import run_on_host_devices

# One subprocess, one compile per side: a 3-layer tiny model with an M, a D (sparse stage on
# the XLA path, top-k 16 of 32 keys) and an S layer (window 8), MTP after it (an S layer),
# expert-parallel MoE, mesh expert 2 x context 4 (the MoE's tokens over both). Documents of
# lengths 5, 14, 13 / 20, 12 cross the 8-token shards.
_SCRIPT = r"""
import json, jax, jax.numpy as jnp, numpy as np
from configs import tiny
import glm5_jax
from glm5_jax import sharding
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
assert jax.device_count() == 8, jax.devices()
cfg = tiny.get_config()
cfg.model.update(num_hidden_layers=3, attention_pattern="MDS", sliding_window=8,
                 dsa_impl="xla", mtp_depths=1, first_k_dense_replace=1,
                 moe_impl="expert_parallel", moe_transport="all_to_all")
cfg.mesh.shape.update(data=1, fsdp=1, context=4, expert=2, tensor=1)
rules = cfg.mesh.logical_axis_rules
mesh = sharding.make_mesh(cfg.mesh)
model = ModelConfig.from_config(cfg.model)
params = glm5_jax.init_params(cfg.model, jax.random.key(0))
B, L = 2, 32
tokens = jax.random.randint(jax.random.key(1), (B, L), 0, model.vocab_size)
lengths = [[5, 14, 13], [20, 12]]
segments = jnp.asarray([np.repeat(np.arange(1, len(r) + 1), r) for r in lengths], jnp.int32)
positions = jnp.asarray([np.concatenate([np.arange(n) for n in r]) for r in lengths], jnp.int32)
weights = jax.random.normal(jax.random.key(2), (B, L, model.vocab_size))

def loss(p, t, pos, seg):
  out = glm5_jax.forward(model, p, t, pos, seg, mode=Mode(dsa_stage="sparse"))
  kl = sum(jnp.sum(a["indexer_kl"]) for a in out["aux"]["layers"].values() if "indexer_kl" in a)
  return (jnp.sum(out["logits"] * weights) + jnp.sum(out["mtp_logits"][0] * weights) + kl,
          out["logits"])

step = jax.value_and_grad(loss, has_aux=True)
(ref_loss, ref_logits), ref_grads = jax.jit(step)(params, tokens, positions, segments)
shapes, axes = glm5_jax.abstract_params_and_axes(cfg.model)
sh_params = jax.device_put(params, sharding.param_shardings(shapes, axes, mesh, rules))
seq = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert", "context"))
args = [jax.device_put(x, seq) for x in (tokens, positions, segments)]
with sharding.activation_sharding(mesh, rules):
  lowered = jax.jit(step).lower(sh_params, *args)
  (cp_loss, cp_logits), cp_grads = lowered.compile()(sh_params, *args)
text = lowered.compile().as_text()
diff = lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max())
scale = lambda a: float(np.abs(np.asarray(a)).max())
grad_err = max(diff(a, b) / max(scale(b), 1e-30) for a, b in zip(
    jax.tree_util.tree_leaves(cp_grads), jax.tree_util.tree_leaves(ref_grads)))
print(json.dumps({
    "loss": [float(ref_loss), float(cp_loss)], "logits": diff(cp_logits, ref_logits),
    "grad_rel": grad_err, "logits_spec": [str(a) for a in cp_logits.sharding.spec],
    "all_gathers": text.count("all-gather"),
}))
"""


@pytest.mark.slow  # a subprocess with 8 host devices compiling a tiny forward + backward
def test_context_parallel_matches_the_unsharded_model():
  result = run_on_host_devices(_SCRIPT, timeout=600)
  ref_loss, cp_loss = result["loss"]
  assert abs(ref_loss - cp_loss) <= 1e-5 * max(1.0, abs(ref_loss)), result
  assert result["logits"] < 1e-5, result
  assert result["grad_rel"] < 1e-5, result
  # The sequence stays split over context to the output: nothing gathered the activations.
  assert result["logits_spec"][1] == "context", result
  assert result["all_gathers"] > 0, result  # the key state does travel


def test_unsupported_kinds_are_refused_naming_the_context_axis():
  for pattern, kind in (("MG", "gqa"), ("DN", "gdn"), ("ML", "simple_gdn")):
    with pytest.raises(ConfigError, match=rf"mesh.shape.context=4.*'{kind}'"):
      check_context_parallel(pattern, 4, 64, "data.seq_len")
  check_context_parallel("MG", 1, 63, "data.seq_len")  # no context axis: anything goes
  check_context_parallel("MDRS", 4, 64, "data.seq_len")


def test_indivisible_sequence_is_refused_naming_the_field():
  with pytest.raises(ConfigError, match=r"data.seq_len=30 does not split over "
                                        r"mesh.shape.context=4"):
    check_context_parallel("MD", 4, 30, "data.seq_len")


def test_validate_config_checks_the_context_axis():
  from configs import tiny
  from glm5_jax.config_validation import validate_config
  cfg = tiny.get_config()
  cfg.mesh.shape.update(data=1, context=4)
  cfg.data.seq_len = 258
  with pytest.raises(ConfigError, match=r"config.data.seq_len=258"):
    validate_config(cfg)
  cfg.data.seq_len = 256
  cfg.model.attention_pattern = "G"
  with pytest.raises(ConfigError, match=r"mesh.shape.context=4.*'gqa'"):
    validate_config(cfg)

