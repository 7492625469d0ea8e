"""A Hadamard-based rotation of the residual stream folded into the weights (QuaRot-style), so
the full-precision model computes the same logits while its activations lose their outlier
channels before quantization (GLM-5 report: W4A8 serving with QuaRot rotations).

With an orthogonal `Q [D, D]` (Q Q^T = I) every tensor on the residual stream becomes `x Q`:
  embed_tokens [Y, D]           <- embed_tokens Q
  a kernel reading a normed residual `[D, ...]`  <- Q^T diag(gamma) kernel, the norm's scale
                                   gamma folded in and set to 1: RMSNorm without a scale commutes
                                   with Q (rms(x Q) = rms(x)), so RMSNorm(x Q) = RMSNorm(x) Q.
                                   input_layernorm feeds q_a_proj, kv_a_proj_with_mqa and the
                                   indexer's wk, weights_proj; post_attention_layernorm feeds
                                   the dense MLP's / shared and routed experts' gate, up and the
                                   router (`mlp/gate`); the final norm feeds lm_head.
  a kernel writing the residual `[..., D]`       <- kernel Q (o_proj, its bias, down_proj)
Q = diag(s) (H_{2^k} / 2^{k/2} (x) O_r) for D = 2^k r: a Sylvester Hadamard matrix (Kronecker) a
random orthogonal r x r block (r = 1 for powers of two; GLM-5's D = 6144 = 2^11 * 3), with random
signs s. Exact in exact arithmetic; in fp32 the logits move by rounding only
(tests/test_quant.py holds them to 1e-5).

Supported: MLA / DSA layers (pattern letters M, D, R) without an MTP layer (the MTP layer's
norms `enorm` / `shared_head_norm` share the LM head with the final norm, and one lm_head cannot
absorb two different scales); anything else is a ValueError naming it.
"""

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import layer_runs
from glm5_jax.config import ModelConfig

ROTATABLE_KINDS = ("mla", "dsa", "dsa_shared_topk")


def hadamard_rotation(d: int, seed: int = 0) -> np.ndarray:
  """An orthogonal `[d, d]` float64 matrix: random signs times Hadamard (x) random orthogonal."""
  k = (d & -d).bit_length() - 1  # the largest power of two dividing d
  r = d >> k
  h = np.ones((1, 1))
  for _ in range(k):
    h = np.block([[h, h], [h, -h]])
  rng = np.random.default_rng(seed)
  o = np.linalg.qr(rng.standard_normal((r, r)))[0] if r > 1 else np.ones((1, 1))
  signs = rng.choice([-1.0, 1.0], size=d)
  return signs[:, None] * np.kron(h / np.sqrt(2.0 ** k), o)


def rotate(config, params, seed: int = 0):
  """`params` (either layout) with the rotation folded in; same tree, same dtypes.

  Raises:
    ValueError: an MTP layer, or a layer kind without MLA's projections (`ROTATABLE_KINDS`).
  """
  cfg = ModelConfig.from_config(config)
  if cfg.num_nextn_predict_layers:
    raise ValueError("rotate: the model has an MTP layer (model.num_nextn_predict_layers="
                     f"{cfg.num_nextn_predict_layers}); its norms share lm_head with the final "
                     "norm, so the rotation cannot be folded")
  for i in range(cfg.num_hidden_layers):
    if cfg.attention_kind(i) not in ROTATABLE_KINDS:
      raise ValueError(f"rotate: layer {i} is {cfg.attention_kind(i)!r} "
                       f"(model.attention_pattern); only {ROTATABLE_KINDS} are rotated")
  q = jnp.asarray(hadamard_rotation(cfg.hidden_size, seed), jnp.float32)
  unrolled = layer_runs.as_unrolled(params, cfg)
  out = dict(unrolled)
  out["embed_tokens"] = _cast(unrolled["embed_tokens"].astype(jnp.float32) @ q,
                              unrolled["embed_tokens"])
  out["lm_head"], out["norm"] = _fold_read(q, unrolled["lm_head"], unrolled["norm"])
  for i in range(cfg.num_hidden_layers):
    out[f"layers_{i}"] = _rotate_layer(q, unrolled[f"layers_{i}"])
  return layer_runs.as_layout_of(cfg, out) if cfg.scan_layers else out


def _rotate_layer(q, layer: dict) -> dict:
  layer = jax.tree_util.tree_map(lambda x: x, layer)  # a copy of the nesting
  attn, mlp = dict(layer["self_attn"]), dict(layer["mlp"])
  gamma1 = layer["input_layernorm"]["scale"]
  for name in ("q_a_proj", "kv_a_proj_with_mqa"):
    attn[name] = _read(q, gamma1, attn[name])
  if "indexer" in attn:
    indexer = dict(attn["indexer"])
    for name in ("wk", "weights_proj"):
      indexer[name] = _read(q, gamma1, indexer[name])
    attn["indexer"] = indexer
  attn["o_proj"] = _write(q, attn["o_proj"])
  if "o_proj_bias" in attn:
    attn["o_proj_bias"] = _write(q, attn["o_proj_bias"])
  gamma2 = layer["post_attention_layernorm"]["scale"]
  if "experts" in mlp:
    mlp["gate"] = _read(q, gamma2, mlp["gate"])
    mlp["experts"] = _swiglu(q, gamma2, mlp["experts"])
    if "shared_experts" in mlp:
      mlp["shared_experts"] = _swiglu(q, gamma2, mlp["shared_experts"])
  else:
    mlp = _swiglu(q, gamma2, mlp)
  layer["self_attn"], layer["mlp"] = attn, mlp
  layer["input_layernorm"] = {"scale": jnp.ones_like(gamma1)}
  layer["post_attention_layernorm"] = {"scale": jnp.ones_like(gamma2)}
  return layer


def _swiglu(q, gamma, ffn: dict) -> dict:
  return {**ffn, "gate_proj": _read(q, gamma, ffn["gate_proj"]),
          "up_proj": _read(q, gamma, ffn["up_proj"]), "down_proj": _write(q, ffn["down_proj"])}


def _fold_read(q, kernel, norm: dict):
  return _read(q, norm["scale"], kernel), {"scale": jnp.ones_like(norm["scale"])}


def _read(q, gamma, w):
  """`Q^T diag(gamma) w` over w's D axis (the last but one of `[..., D, out]`)."""
  w32 = w.astype(jnp.float32) * gamma.astype(jnp.float32)[:, None]
  return _cast(jnp.einsum("de,...dk->...ek", q, w32, precision="highest"), w)


def _write(q, w):
  """`w Q` over w's last axis (D)."""
  return _cast(jnp.einsum("...d,de->...e", w.astype(jnp.float32), q, precision="highest"), w)


def _cast(x, like):
  return x.astype(like.dtype)
