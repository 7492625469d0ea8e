"""tools/glm5_decode_width.py: the decode model has GLM-5's widths (configs/glm5_744b.py), and
its per-token FLOP count agrees with the matmuls XLA compiles for the decode step."""

import jax
import jax.numpy as jnp
import pytest

from configs import glm5_744b
from glm5_jax.planning import hlo_stats
from glm5_jax.api import init_params
from glm5_jax.infer.cache import init_cache
from glm5_jax.infer.step import _decode_step
from tools import glm5_decode_width

_REAL = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
         "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_topk", "index_n_heads",
         "index_head_dim", "moe_intermediate_size", "num_experts_per_tok", "n_shared_experts",
         "rope_theta")


@pytest.mark.parametrize("ffn", glm5_decode_width.FFNS)
def test_widths_are_glm5s(ffn):
  real = glm5_744b.get_config().model
  cfg = glm5_decode_width.glm5_width_config("D", 2, 8192, ffn)
  assert {f: getattr(cfg, f) for f in _REAL} == {f: real[f] for f in _REAL}
  assert (cfg.num_hidden_layers, cfg.attention_pattern, cfg.dsa_impl) == (2, "DD", "xla")
  if ffn == "dense":  # the MoE's active width: shared + top-8 experts of 2048
    assert (cfg.mlp_pattern, cfg.intermediate_size) == ("FF", 9 * 2048)
  else:
    assert (cfg.mlp_pattern, cfg.n_routed_experts) == ("EE", 8)


def test_flop_count_matches_the_compiled_step():
  """One D layer at S = 4096 (abstract: nothing allocated): the compiled step's matmuls are the
  layer's counted FLOPs less the router (the dense FFN has none) plus the reduced LM head.
  (A decode query padded to 8 in the sparse attention, as `map_query_blocks` once did, made
  them 2.5x the count.)"""
  context = 4096
  cfg = glm5_decode_width.glm5_width_config("D", 1, context)
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  cache = jax.eval_shape(lambda: init_cache(cfg, 1, context))
  q = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  text = _decode_step.lower(params, cache, q, q, q, cfg=cfg, dsa_stage="sparse").compile(
  ).as_text()
  compiled = hlo_stats.step_dot_flops(text)["flops"]
  flops = glm5_decode_width.layer_work(cfg, "D", context)["flops"]
  router = 2 * cfg.hidden_size * cfg.n_routed_experts
  head = 2 * cfg.hidden_size * glm5_decode_width.VOCAB
  expected = flops["constant"] + flops["context"] - router + head
  assert compiled == pytest.approx(expected, rel=1e-3)
  # The context-dependent part is what a 64K context adds: the indexer over every row.
  grown = glm5_decode_width.layer_work(cfg, "D", 16 * context)["flops"]["context"]
  assert grown - flops["context"] == 2 * 15 * context * (32 * 128 + 32)
