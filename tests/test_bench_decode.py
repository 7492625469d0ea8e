"""tools/bench_decode.py: every section runs and its cache figures are the kinds' layouts (GLM-5:
576 latent values + 128 indexer keys per token per layer, against GQA-8's 2048)."""

from configs import glm5_744b, tiny
from tools import bench_decode


def test_glm5_cache_per_token_against_gqa8():
  model = glm5_744b.get_config().model
  out = bench_decode.cache_section(model, kv_heads=8)
  layer = out["layers"]["layers_0"]
  assert layer["arrays"] == {"ckv": 512, "k_rope": 64, "index_k": 128}, layer
  assert layer["bytes"] == 2 * 704  # bf16 cache
  assert len(out["layers"]) == 1  # all 78 layers alike: printed once
  assert out["gqa"]["values"] == 2048 and out["gqa"]["kv_heads"] == 8, out["gqa"]


def test_bench_runs_on_a_one_layer_tiny_model():
  model = bench_decode.keep_layers(tiny.get_config().model, 1)
  assert model.num_hidden_layers == 1 and model.attention_pattern == "D"
  params = bench_decode.random_params(bench_decode.ModelConfig.from_config(model), seed=0)
  out = bench_decode.run_bench(
      model, params, batch_sizes=[1, 2], prompt_len=16, prefill_chunk=8, decode_steps=2,
      speculative_steps=[], mtp_cache=[], spec_prompts=1, spec_new_tokens=2, gqa_kv_heads=8, seed=0)
  assert out["model"]["layers"] == 1 and out["cache"]["layers"]["layers_0"]["values"] == 88
  assert out["cache"]["gqa"]["kv_heads"] == 2  # 8 KV heads do not fit the tiny model's 4
  for row in out["throughput"].values():
    assert row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0
  assert out["throughput"][1]["decode_speedup"] == 1.0
  assert "speculative" not in out
