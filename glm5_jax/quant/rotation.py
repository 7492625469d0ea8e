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

With an MTP layer, the final norm and the MTP layer's `shared_head_norm` both feed the one shared
lm_head, which cannot absorb two different scales; and the MTP layer reads the final norm's
output (scale included) as its `h^0`. So with MTP, lm_head takes `Q^T lm_head` alone and each of
the two norms keeps its scale as a `[D, D]` matrix `mix = Q^T diag(gamma) Q` after it
(`model.head_norm_mix`): RMSNorm(x Q) mix = (RMSNorm(x) diag(gamma)) Q, exact as above, for one
D x D matmul per token. The MTP layer's `enorm` / `hnorm` scales fold into the two halves of
`eh_proj`'s input rows, its output columns and its decoder layer rotate like any layer's.

Supported: MLA / DSA layers (pattern letters M, D, R, the MTP layer's kind included); anything
else is a ValueError naming it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
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


def rotate(model, params, seed: int = 0):
  """`(model_r, params_r)`: `params` (either layout) with the rotation folded in, same dtypes, and
  the model they run with (a copy of `model`, a ConfigDict or a `ModelConfig` as given; with an
  MTP layer `head_norm_mix=True`, and the two head norms gain a `mix` leaf: module docstring).

  Raises:
    ValueError: a layer kind without MLA's projections (`ROTATABLE_KINDS`); a model already
      rotated (`model.head_norm_mix`).
  """
  cfg = ModelConfig.from_config(model)
  if cfg.head_norm_mix:
    raise ValueError("rotate: model.head_norm_mix is set, the model is already rotated")
  kinds = [(f"layer {i}", cfg.attention_kind(i)) for i in range(cfg.num_hidden_layers)]
  if cfg.num_nextn_predict_layers:
    kinds.append(("the MTP layer", cfg.attention_kind(cfg.num_hidden_layers)))
  for where, kind in kinds:
    if kind not in ROTATABLE_KINDS:
      raise ValueError(f"rotate: {where} is {kind!r} (model.attention_pattern / mtp_letter); "
                       f"only {ROTATABLE_KINDS} are rotated")
  q = jnp.asarray(hadamard_rotation(cfg.hidden_size, seed), jnp.float32)
  unrolled = layer_runs.as_unrolled(params, cfg)
  out = dict(unrolled)
  out["embed_tokens"] = _cast(unrolled["embed_tokens"].astype(jnp.float32) @ q,
                              unrolled["embed_tokens"])
  for i in range(cfg.num_hidden_layers):
    out[f"layers_{i}"] = _rotate_layer(q, unrolled[f"layers_{i}"])
  mix = bool(cfg.num_nextn_predict_layers)
  if mix:
    out["lm_head"] = _read(q, None, unrolled["lm_head"])
    out["norm"] = _mixed_norm(q, unrolled["norm"])
    out["mtp"] = _rotate_mtp(q, unrolled["mtp"])
  else:
    out["lm_head"], out["norm"] = _fold_read(q, unrolled["lm_head"], unrolled["norm"])
  if isinstance(model, ModelConfig):
    model_r = dataclasses.replace(model, head_norm_mix=mix)
  else:
    model_r = ml_collections.ConfigDict(model.to_dict())
    model_r.head_norm_mix = mix
    ModelConfig.from_config(model_r)
  return model_r, (layer_runs.as_layout_of(cfg, out) if cfg.scan_layers else out)


def _rotate_mtp(q, mtp: dict) -> dict:
  """enorm / hnorm folded into `eh_proj`'s two halves of input rows `[2D, D]`, its output
  rotated; the decoder layer as any layer; `shared_head_norm` keeps its scale as a mix."""
  w = mtp["eh_proj"]
  d = q.shape[0]
  halves = [_rotated_rows(q, mtp[norm]["scale"], w[k * d:(k + 1) * d])
            for k, norm in enumerate(("enorm", "hnorm"))]
  eh = jnp.einsum("id,de->ie", jnp.concatenate(halves), q, precision="highest")
  return {**mtp, "eh_proj": _cast(eh, w), "layer": _rotate_layer(q, mtp["layer"]),
          "enorm": {"scale": jnp.ones_like(mtp["enorm"]["scale"])},
          "hnorm": {"scale": jnp.ones_like(mtp["hnorm"]["scale"])},
          "shared_head_norm": _mixed_norm(q, mtp["shared_head_norm"])}


def _mixed_norm(q, norm: dict) -> dict:
  """`{"scale": 1, "mix": Q^T diag(gamma) Q}`: RMSNorm(x Q) mix = (RMSNorm(x) gamma) Q."""
  gamma = norm["scale"]
  mix = jnp.einsum("ed,d,df->ef", q.T, gamma.astype(jnp.float32), q, precision="highest")
  return {"scale": jnp.ones_like(gamma), "mix": mix.astype(gamma.dtype)}


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
  """`Q^T diag(gamma) w` over w's D axis (the last but one of `[..., D, out]`); gamma None: 1."""
  return _cast(_rotated_rows(q, gamma, w), w)


def _rotated_rows(q, gamma, w):
  """`_read` in float32, before the cast back to w's dtype."""
  w32 = w.astype(jnp.float32)
  if gamma is not None:
    w32 = w32 * gamma.astype(jnp.float32)[:, None]
  return jnp.einsum("de,...dk->...ek", q, w32, precision="highest")


def _write(q, w):
  """`w Q` over w's last axis (D)."""
  return _cast(jnp.einsum("...d,de->...e", w.astype(jnp.float32), q, precision="highest"), w)


def _cast(x, like):
  return x.astype(like.dtype)
