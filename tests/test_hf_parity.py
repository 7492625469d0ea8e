"""Numerical parity with HF transformers' `GlmMoeDsaForCausalLM` (torch, CPU, fp32).

Tiny random HF models of several shapes (odd sizes, top-k < sequence) are saved in the layouts
`load_hf` must read, loaded, and compared logit by logit. ReLU makes exact index-score ties
common and torch's top-k breaks them arbitrarily while ours takes the earlier position, so each
case picks token inputs with no tie at any top-k boundary instead of loosening tolerances.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import glm5_jax  # noqa: E402
from glm5_jax import layer_runs  # noqa: E402
from glm5_jax.config import ModelConfig  # noqa: E402
from glm5_jax.convert.hf import CheckpointError  # noqa: E402

BASE = dict(
    vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=6, num_experts_per_tok=3, kv_lora_rank=20, q_lora_rank=28,
    qk_rope_head_dim=6, v_head_dim=10, qk_nope_head_dim=14, index_topk=7, index_head_dim=10,
    index_n_heads=8, first_k_dense_replace=1, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
)
CASES = {
    # The released layout: per-expert tensors, one file.
    "per_expert": dict(hf=dict(), layout="per_expert", shards=1, seq=23),
    # Fused experts as recent transformers holds them, sharded with an index, 2 shared experts.
    "fused_sharded": dict(hf=dict(n_shared_experts=2, num_hidden_layers=4, first_k_dense_replace=2,
                                  v_head_dim=16, index_topk=5),
                          layout="fused", shards=3, seq=19),
    # Cross-layer top-k sharing, group-limited routing, attention biases, an MTP layer.
    "shared_topk_groups_bias_mtp": dict(
        hf=dict(index_topk_pattern="FSF", n_group=2, topk_group=1, n_routed_experts=8,
                attention_bias=True, num_experts_per_tok=2, hidden_size=40),
        layout="per_expert", shards=2, seq=21, mtp=True),
}


def _hf_model(hf_overrides, seed, num_layers=None):
  kwargs = {**BASE, **hf_overrides}
  if num_layers is not None:
    kwargs["num_hidden_layers"] = num_layers
  config = transformers.GlmMoeDsaConfig(**kwargs)
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = transformers.GlmMoeDsaForCausalLM(config).eval()
  with torch.no_grad():  # larger than HF's 0.02 init, so every path moves the logits
    for name, p in model.named_parameters():
      p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    for buffer_name, b in model.named_buffers():
      if buffer_name.endswith("e_score_correction_bias"):
        b.copy_(0.3 * torch.randn_like(b))
  return model


def _per_expert_state(state):
  """Fused `experts.gate_up_proj`/`down_proj` -> the released per-expert names."""
  out = {}
  for name, t in state.items():
    if name.endswith("mlp.experts.gate_up_proj"):
      prefix, f = name[: -len("gate_up_proj")], t.shape[1] // 2
      for e in range(t.shape[0]):
        out[f"{prefix}{e}.gate_proj.weight"] = t[e, :f].clone()
        out[f"{prefix}{e}.up_proj.weight"] = t[e, f:].clone()
    elif name.endswith("mlp.experts.down_proj"):
      prefix = name[: -len("down_proj")]
      for e in range(t.shape[0]):
        out[f"{prefix}{e}.down_proj.weight"] = t[e].clone()
    else:
      out[name] = t.contiguous()
  return out


def _mtp_state(case, seed, num_layers):
  """An MTP layer `model.layers.{num_layers}.*` taken from a deeper random model, plus the
  MTP-only tensors and the duplicate embedding/head some exports carry."""
  hf = dict(case["hf"])
  if "index_topk_pattern" in hf:  # the extra layer runs its own indexer
    hf["index_topk_pattern"] += "F"
  deeper = _hf_model(hf, seed + 1, num_layers + 1)
  prefix = f"model.layers.{num_layers}."
  state = {k: v for k, v in deeper.state_dict().items() if k.startswith(prefix)}
  d = deeper.config.hidden_size
  gen = torch.Generator().manual_seed(seed)
  state[prefix + "eh_proj.weight"] = 0.15 * torch.randn(d, 2 * d, generator=gen)
  for norm in ("enorm", "hnorm", "shared_head.norm"):
    state[prefix + norm + ".weight"] = 1 + 0.2 * torch.randn(d, generator=gen)
  state[prefix + "embed_tokens.weight"] = deeper.model.embed_tokens.weight.detach().clone()
  state[prefix + "shared_head.head.weight"] = deeper.lm_head.weight.detach().clone()
  return state, deeper.model.layers[num_layers]


def _write_checkpoint(path, model, state, layout, shards):
  os.makedirs(path, exist_ok=True)
  model.config.to_json_file(os.path.join(path, "config.json"))
  if layout == "per_expert":
    state = _per_expert_state(state)
  names = sorted(state)
  if shards == 1:
    safetensors_torch.save_file(state, os.path.join(path, "model.safetensors"))
    return
  weight_map = {}
  for i, chunk in enumerate(np.array_split(np.array(names), shards)):
    file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    safetensors_torch.save_file({n: state[n] for n in chunk}, os.path.join(path, file))
    weight_map.update({n: file for n in chunk})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _topk_boundary_margin(out, k):
  """Smallest gap between the k-th and (k+1)-th visible index score over all DSA queries."""
  margins = [np.inf]
  auxes = list(out["aux"]["layers"].values()) + list(out["aux"]["mtp"])
  for aux in auxes:
    if "index_scores" not in aux:
      continue
    scores = np.sort(np.asarray(aux["index_scores"]), axis=-1)[..., ::-1]
    visible = np.isfinite(scores).sum(-1)
    rows = visible > k
    if rows.any():
      margins.append(float((scores[rows, k - 1] - scores[rows, k]).min()))
  return min(margins)


def _tie_free_tokens(config, params, batch, seq, vocab):
  for seed in range(200):
    tokens = np.random.RandomState(seed).randint(0, vocab, (batch, seq))
    out = glm5_jax.forward(config, params, jnp.asarray(tokens))
    if _topk_boundary_margin(out, config.index_topk) > 1e-4:
      return tokens
  raise AssertionError("no tie-free input found in 200 seeds")


def _hf_mtp_depth1_logits(hf_model, mtp_layer, mtp_state, tokens, num_layers):
  """Independent torch MTP depth 1 (docs/reference.md section 2) on the HF main model."""
  prefix = f"model.layers.{num_layers}."
  ids = torch.tensor(tokens)
  with torch.no_grad():
    h0 = hf_model.model(ids).last_hidden_state  # after the final norm
    next_ids = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    emb = hf_model.model.embed_tokens(next_ids)
    x = torch.cat([_rms(emb, mtp_state[prefix + "enorm.weight"], hf_model),
                   _rms(h0, mtp_state[prefix + "hnorm.weight"], hf_model)], dim=-1)
    x = x @ mtp_state[prefix + "eh_proj.weight"].T
    seq = ids.shape[1]
    positions = torch.arange(seq)[None]
    rope = hf_model.model.rotary_emb(x, positions)
    mask = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)[None, None]
    mask = mask.expand(ids.shape[0], 1, seq, seq)
    x, _ = mtp_layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
    x = _rms(x, mtp_state[prefix + "shared_head.norm.weight"], hf_model)
    return hf_model.lm_head(x).numpy()


def _rms(x, weight, hf_model):
  var = x.pow(2).mean(-1, keepdim=True)
  return weight * (x * torch.rsqrt(var + hf_model.config.rms_norm_eps))


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_logits_match_hf(case_name, tmp_path):
  case = CASES[case_name]
  hf_model = _hf_model(case["hf"], seed=len(case_name))
  num_layers = hf_model.config.num_hidden_layers
  state = dict(hf_model.state_dict())
  if case.get("mtp"):
    mtp_state, mtp_layer = _mtp_state(case, len(case_name), num_layers)
    state.update(mtp_state)
  _write_checkpoint(str(tmp_path), hf_model, state, case["layout"], case["shards"])

  config, params = glm5_jax.load_hf(str(tmp_path))  # the scanned layout, the model's default
  assert config.dtype == "float32" and config.param_dtype == "float32"
  assert config.num_nextn_predict_layers == int(bool(case.get("mtp")))
  vocab = hf_model.config.vocab_size
  tokens = _tie_free_tokens(config, params, 2, case["seq"], vocab)

  with torch.no_grad():
    ref = hf_model(torch.tensor(tokens)).logits.numpy()
  ours = np.asarray(glm5_jax.logits(config, params, tokens))
  scale = np.abs(ref).max()
  diff = np.abs(ours - ref).max()
  print(f"{case_name}: max |logit diff| = {diff:.3g} (logit scale {scale:.3g})")
  assert scale > 1.0
  assert diff < 5e-5 * scale, diff

  if case.get("mtp"):
    ref_mtp = _hf_mtp_depth1_logits(hf_model, mtp_layer, mtp_state, tokens, num_layers)
    ours_mtp = np.asarray(glm5_jax.forward(config, params, jnp.asarray(tokens))["mtp_logits"][0])
    mtp_diff = np.abs(ours_mtp - ref_mtp).max()
    print(f"{case_name}: MTP depth 1 max |logit diff| = {mtp_diff:.3g}")
    assert mtp_diff < 5e-5 * np.abs(ref_mtp).max(), mtp_diff


def test_bf16_checkpoint_loads_its_exact_values(tmp_path):
  """A checkpoint stored in bfloat16 (as GLM-5 is released): params come back as exactly the
  stored bf16 values (bf16 leaves; the router kernel, its bias and the indexer's weights_proj in
  fp32, widened exactly), equal to the same values stored in fp32 and loaded as bf16; in fp32
  compute the logits match torch's fp32 model of those values as tightly as the fp32 parity
  test, and in bf16 compute within bf16 rounding."""
  hf_model = _hf_model({}, seed=11)
  state = dict(hf_model.state_dict())  # weights and router biases (not RoPE's inv_freq)
  with torch.no_grad():  # make every value bf16-representable, so fp32 and bf16 files agree
    for t in state.values():
      t.copy_(t.to(torch.bfloat16).to(t.dtype))
  _write_checkpoint(str(tmp_path / "bf16"), hf_model,
                    {k: v.to(torch.bfloat16) for k, v in state.items()}, "per_expert", 2)
  _write_checkpoint(str(tmp_path / "fp32"), hf_model, state, "per_expert", 1)

  config, params = glm5_jax.load_hf(str(tmp_path / "bf16"))
  assert config.param_dtype == "bfloat16" and config.dtype == "bfloat16"
  _, from_fp32 = glm5_jax.load_hf(str(tmp_path / "fp32"), param_dtype="bfloat16")
  leaves = jax.tree_util.tree_leaves_with_path(params)
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(from_fp32)
  fp32_names = set()
  for (path, got), want in zip(leaves, jax.tree_util.tree_leaves(from_fp32)):
    name = jax.tree_util.keystr(path)
    assert got.dtype == want.dtype, name
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                  err_msg=name)
    if got.dtype == jnp.float32:
      fp32_names.add(path[-1].key)
    else:
      assert got.dtype == jnp.bfloat16, name
  assert fp32_names == {"gate", "e_score_correction_bias", "weights_proj"}
  # The stored values themselves, for tensors read back without a layout change.
  stored = lambda name: state[name].to(torch.float32).numpy()
  unrolled = layer_runs.as_unrolled(params, ModelConfig.from_config(config))
  np.testing.assert_array_equal(unrolled["layers_1"]["mlp"]["e_score_correction_bias"],
                                stored("model.layers.1.mlp.gate.e_score_correction_bias"))
  np.testing.assert_array_equal(np.asarray(params["embed_tokens"], np.float32),
                                stored("model.embed_tokens.weight"))

  cfg32, params32 = glm5_jax.load_hf(str(tmp_path / "bf16"), dtype="float32",
                                     param_dtype="float32")
  tokens = _tie_free_tokens(cfg32, params32, 2, 17, hf_model.config.vocab_size)
  with torch.no_grad():
    ref = hf_model(torch.tensor(tokens)).logits.numpy()
  scale = np.abs(ref).max()
  assert np.abs(np.asarray(glm5_jax.logits(cfg32, params32, tokens)) - ref).max() < 5e-5 * scale
  # bf16 compute: keep top-k >= sequence so bf16 index scores cannot change the selection.
  short = tokens[:, :hf_model.config.index_topk]
  with torch.no_grad():
    ref_short = hf_model(torch.tensor(short)).logits.numpy()
  # bf16 rounding can flip one token's expert choice (an O(10%) change at that position and
  # after it), so the bound is per position: most within bf16 rounding of the fp32 model.
  ours = np.asarray(glm5_jax.logits(config, params, short), np.float32)
  position_error = np.abs(ours - ref_short).max(-1) / np.abs(ref_short).max()
  print(f"bf16 compute: per-position max |logit diff| / scale {np.round(position_error, 3)}")
  assert np.mean(position_error < 3e-2) >= 0.75, position_error
  assert np.median(position_error) < 2e-2, position_error


def test_missing_and_unknown_tensors_are_listed(tmp_path):
  hf_model = _hf_model({}, seed=0)
  state = _per_expert_state(dict(hf_model.state_dict()))
  del state["model.layers.1.self_attn.kv_b_proj.weight"]
  state["model.layers.1.self_attn.surprise.weight"] = torch.zeros(2)
  _write_checkpoint(str(tmp_path), hf_model, state, "keep", 1)
  with pytest.raises(CheckpointError) as err:
    glm5_jax.load_hf(str(tmp_path))
  assert "model.layers.1.self_attn.kv_b_proj.weight" in str(err.value)
  assert "model.layers.1.self_attn.surprise.weight" in str(err.value)


def test_non_finite_weights_are_named(tmp_path, caplog):
  hf_model = _hf_model({}, seed=0)
  state = _per_expert_state(dict(hf_model.state_dict()))
  state["model.layers.0.self_attn.q_a_proj.weight"][0, :3] = float("nan")
  state["model.layers.0.self_attn.q_a_proj.weight"][1, 0] = float("inf")
  _write_checkpoint(str(tmp_path), hf_model, state, "keep", 1)
  with pytest.raises(CheckpointError, match=r"q_a_proj.weight has 4 non-finite values .* "
                     "allow_nonfinite=True"):
    glm5_jax.load_hf(str(tmp_path))
  glm5_jax.load_hf(str(tmp_path), allow_nonfinite=True)  # loads, with a warning naming it
  warnings = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
  assert len(warnings) == 1 and "4 non-finite values (NaN/inf) in " in warnings[0], warnings
  assert "model.layers.0.self_attn.q_a_proj.weight" in warnings[0]


def test_wrong_shape_names_the_tensor(tmp_path):
  hf_model = _hf_model({}, seed=0)
  state = _per_expert_state(dict(hf_model.state_dict()))
  state["model.layers.0.self_attn.q_a_proj.weight"] = torch.zeros(5, 48)
  _write_checkpoint(str(tmp_path), hf_model, state, "keep", 1)
  with pytest.raises(CheckpointError, match="q_a_proj.weight"):
    glm5_jax.load_hf(str(tmp_path))


def test_bad_directory_errors(tmp_path):
  with pytest.raises(CheckpointError, match="config.json"):
    glm5_jax.load_hf(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  with pytest.raises(CheckpointError, match="glm_moe_dsa"):
    glm5_jax.load_hf(str(tmp_path))
  for bad in ({"scoring_func": "softmax"}, {"rope_scaling": {"type": "yarn", "factor": 4}},
              {"quantization_config": {"quant_method": "gptq"}}, {"hidden_act": "gelu"}):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", **bad}))
    with pytest.raises(CheckpointError, match=next(iter(bad))):
      glm5_jax.load_hf(str(tmp_path))
  # Sizes: required (never the 744B defaults), and of the right type.
  sizes = dict(model_type="glm_moe_dsa", vocab_size=64, hidden_size=48, num_hidden_layers=2,
               num_attention_heads=2)
  for bad, match in ((dict(hidden_size=None), r"config.json: no hidden_size; "),
                     (dict(hidden_size="48"), r"config.json: hidden_size is '48' \(str\); "
                      "expected an integer >= 0"),
                     (dict(attention_bias=1), r"attention_bias is 1 \(int\); expected true"),
                     (dict(rms_norm_eps="x"), r"rms_norm_eps is 'x' \(str\); expected a number")):
    config = {k: v for k, v in {**sizes, **bad}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
      glm5_jax.load_hf(str(tmp_path))


@pytest.mark.slow  # two subprocesses running the conversion CLI
def test_convert_hf_cli_roundtrip(tmp_path):
  import subprocess
  import sys

  from glm5_jax.convert.converted import load_converted

  hf_model = _hf_model({}, seed=3)
  _write_checkpoint(str(tmp_path / "hf"), hf_model, dict(hf_model.state_dict()), "per_expert", 2)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "converted"
  cmd = [sys.executable, os.path.join(root, "tools", "convert_hf.py"),
         f"--hf_dir={tmp_path / 'hf'}", f"--out_dir={out}", "--param_dtype=bfloat16"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "wrote" in proc.stdout

  config, params = load_converted(str(out))
  ref_config, ref_params = glm5_jax.load_hf(str(tmp_path / "hf"), param_dtype="bfloat16")
  assert config.to_dict() == ref_config.to_dict()
  flat, ref_flat = jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref_params)
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(ref_params)
  for a, b in zip(flat, ref_flat):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  unrolled = layer_runs.as_unrolled(params, ModelConfig.from_config(config))
  assert unrolled["layers_1"]["mlp"]["gate"].dtype == jnp.float32  # router stays fp32
  again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert again.returncode != 0 and "already exists" in again.stderr
