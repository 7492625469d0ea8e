"""Sharded decode on 8 simulated CPU devices equals single-device decode: `infer.generate` with
a mesh places params and cache by the logical-axis rules and gives the same tokens and log-probs,
greedy and sampled."""

import pytest

from tests.conftest import run_on_host_devices

_SCRIPT = r"""
import json, jax, numpy as np
from configs import tiny
import glm5_jax
from glm5_jax import infer, sharding
from glm5_jax.config import ModelConfig

assert jax.device_count() == 8, jax.devices()
cfg = tiny.get_config()
# D | D (MoE) | R | M, index_topk 4: top-k active past 4 tokens, experts sharded, heads split.
cfg.model.update(num_hidden_layers=4, attention_pattern="DDRM", index_topk=4, mtp_depths=1)
cfg.mesh.shape.update(data=2, fsdp=2, expert=1, tensor=2)
rules = cfg.mesh.logical_axis_rules
mesh = sharding.make_mesh(cfg.mesh)
model = ModelConfig.from_config(cfg.model)
params = glm5_jax.init_params(model, jax.random.key(0))
# 5 prompts over 4 slots (the batch axes data x fsdp x expert = 4 ways): a slot is refilled.
prompts = [[5, 17, 3, 99, 42, 7, 8], [11], [250, 3, 3, 9], [5, 17, 3, 99, 42, 7, 8], [1, 2, 3]]
engine = infer.Engine(model, params, slots=4, max_len=16, mesh=mesh, rules=rules,
                      page_size=None)
paged = infer.Engine(model, params, slots=4, max_len=16, mesh=mesh, rules=rules, page_size=4)
out = {"param_devices": len(engine.params["lm_head"].sharding.device_set),
       "cache_specs": sorted({str(x.sharding.spec) for x in jax.tree.leaves(engine.cache)}),
       "pool_specs": sorted({str(x.sharding.spec) for x in jax.tree.leaves(paged.cache)})}
for temperature in (0.0, 1.0):
  kw = dict(max_new_tokens=6, temperature=temperature, top_p=0.9 if temperature else 1.0,
            seed=7, slots=4, max_len=16, prefill_chunk=4)
  ref = infer.generate(model, params, prompts, **kw)
  got = infer.generate(model, params, prompts, mesh=mesh, rules=rules, **kw)
  diff = lambda a, b: max(float(np.abs(np.subtract(x, y)).max()) for x, y in zip(a, b))
  out[str(temperature)] = dict(
      same_tokens=ref.tokens == got.tokens, distinct=len({tuple(t) for t in ref.tokens}),
      logprobs=diff(ref.logprobs, got.logprobs), raw=diff(ref.raw_logprobs, got.raw_logprobs))
print(json.dumps(out))
"""


@pytest.mark.slow  # a subprocess with 8 host devices
def test_sharded_generate_matches_single_device():
  result = run_on_host_devices(_SCRIPT, timeout=900)
  assert result["param_devices"] == 8, result
  # Every contiguous cache array splits its slots over the batch axes; a paged pool's pages
  # belong to no slot: replicated over the batch axes, the latent axis still split.
  assert all("('data', 'fsdp', 'expert')" in spec for spec in result["cache_specs"]), result
  assert result["pool_specs"] == ["P(None, None, None, ('fsdp', 'context'))",
                                  "P(None, None, None, None)"], (
      result)
  for temperature in ("0.0", "1.0"):
    r = result[temperature]
    assert r["same_tokens"] and r["distinct"] >= 4, result
    assert r["logprobs"] < 1e-5 and r["raw"] < 1e-5, result
