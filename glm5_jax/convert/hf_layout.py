"""Where each parameter comes from in an HF GLM-5 checkpoint: the load plan.

A plan entry is `(destination path in params, HF tensor names it reads, build(read, dtype))`;
destinations are unrolled-layout paths (`layers_{i}/...`; `glm5_jax.layer_runs` places them in
the scanned layout). Routed-expert entries (`expert_sliceable(dest)`) also take
`build(read, dtype, experts=slice)` and read only those experts, so a streaming importer can
fill one device's shard of a `[E, ...]` kernel without reading the other experts.
HF linears store `[out, in]`; our kernels are `[in, out]` with per-head axes split out (see the
layer docstrings for each kernel's layout). Both expert layouts are planned: per-expert
`mlp.experts.{e}.{gate,up,down}_proj.weight` (the released files) and fused
`mlp.experts.gate_up_proj [E, 2F, D]` / `mlp.experts.down_proj [E, D, F]` (what recent
transformers writes). The MTP layer is `model.layers.{num_hidden_layers}.*`.
"""

from typing import Callable

import numpy as np

from glm5_jax.config import ModelConfig

# The helpers below return a `Source`: the names a parameter is made from and how.

# `read(name)` -> the whole tensor; `read(name, rows)` -> `tensor[rows]` (rows: a slice of its
# first axis), read lazily from the file.
Build = Callable[..., np.ndarray]
Source = tuple[list[str], Build]


def _linear(name: str) -> Source:
  """HF `[out, in]` -> our `[in, out]`."""
  return [name], lambda read, dtype: np.ascontiguousarray(read(name).T, dtype=dtype)


def _copy(name: str) -> Source:
  return [name], lambda read, dtype: np.asarray(read(name), dtype=dtype)


def _per_head_in(name: str, heads: int) -> Source:
  """HF `[H * K, in]` -> `[in, H, K]`."""
  def build(read, dtype):
    w = read(name)
    return np.ascontiguousarray(w.reshape(heads, -1, w.shape[-1]).transpose(2, 0, 1), dtype)
  return [name], build


def _kv_b(name: str, heads: int, nope: int, value: bool) -> Source:
  """HF `kv_b_proj [H * (N + V), C]` (per head: N key rows, then V value rows) -> `[C, H, N|V]`."""
  def build(read, dtype):
    w = read(name)
    w = w.reshape(heads, -1, w.shape[-1])
    w = w[:, nope:] if value else w[:, :nope]
    return np.ascontiguousarray(w.transpose(2, 0, 1), dtype)
  return [name], build


def _o_proj(name: str, heads: int) -> Source:
  """HF `o_proj [D, H * V]` -> `[H, V, D]`."""
  def build(read, dtype):
    w = read(name)
    return np.ascontiguousarray(w.reshape(w.shape[0], heads, -1).transpose(1, 2, 0), dtype)
  return [name], build


def _stacked_experts(names: list[str]) -> Source:
  """Per-expert HF `[out, in]` -> `[E, in, out]`, filled expert by expert."""
  def build(read, dtype, experts: slice = slice(None)):
    chosen = names[experts]
    if not chosen:
      raise ValueError(f"experts {experts} selects none of {len(names)} ({names[0]})")
    first = read(chosen[0])
    out = np.empty((len(chosen),) + first.shape[::-1], dtype)
    out[0] = first.T
    for e, name in enumerate(chosen[1:], start=1):
      out[e] = read(name).T
    return out
  return names, build


def _fused_gate_up(name: str, up: bool) -> Source:
  """Fused HF `gate_up_proj [E, 2F, D]` (gate rows first) -> `[E, D, F]`."""
  def build(read, dtype, experts: slice = slice(None)):
    w = read(name, experts)
    f = w.shape[1] // 2
    return np.ascontiguousarray((w[:, f:] if up else w[:, :f]).transpose(0, 2, 1), dtype)
  return [name], build


def _fused_down(name: str) -> Source:
  """Fused HF `down_proj [E, D, F]` -> `[E, F, D]`."""
  def build(read, dtype, experts: slice = slice(None)):
    return np.ascontiguousarray(read(name, experts).transpose(0, 2, 1), dtype)
  return [name], build


def expert_sliceable(dest: tuple) -> bool:
  """Whether `dest` is a routed-expert kernel `[E, ...]` whose build takes `experts=`."""
  return len(dest) >= 2 and dest[-2] == "experts"


def _layer_plan(cfg: ModelConfig, hf_layer: int, dest: tuple, attention_kind: str, moe: bool,
                available) -> list:
  p = f"model.layers.{hf_layer}."
  h = cfg.num_attention_heads
  plan = [
      (dest + ("input_layernorm", "scale"), _copy(p + "input_layernorm.weight")),
      (dest + ("post_attention_layernorm", "scale"), _copy(p + "post_attention_layernorm.weight")),
  ]
  a, ad = p + "self_attn.", dest + ("self_attn",)
  plan += [
      (ad + ("q_a_proj",), _linear(a + "q_a_proj.weight")),
      (ad + ("q_a_layernorm", "scale"), _copy(a + "q_a_layernorm.weight")),
      (ad + ("q_b_proj",), _per_head_in(a + "q_b_proj.weight", h)),
      (ad + ("kv_a_proj_with_mqa",), _linear(a + "kv_a_proj_with_mqa.weight")),
      (ad + ("kv_a_layernorm", "scale"), _copy(a + "kv_a_layernorm.weight")),
      (ad + ("k_b_proj",), _kv_b(a + "kv_b_proj.weight", h, cfg.qk_nope_head_dim, False)),
      (ad + ("v_b_proj",), _kv_b(a + "kv_b_proj.weight", h, cfg.qk_nope_head_dim, True)),
      (ad + ("o_proj",), _o_proj(a + "o_proj.weight", h)),
  ]
  if cfg.attention_bias:
    plan += [(ad + (f"{n}_bias",), _copy(a + f"{n}.bias"))
             for n in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")]
  if attention_kind == "dsa":
    i, idd = a + "indexer.", ad + ("indexer",)
    plan += [
        (idd + ("wq_b",), _per_head_in(i + "wq_b.weight", cfg.index_n_heads)),
        (idd + ("wk",), _linear(i + "wk.weight")),
        (idd + ("k_norm", "scale"), _copy(i + "k_norm.weight")),
        (idd + ("k_norm", "bias"), _copy(i + "k_norm.bias")),
        (idd + ("weights_proj",), _linear(i + "weights_proj.weight")),
    ]
  m, md = p + "mlp.", dest + ("mlp",)
  if not moe:
    return plan + [(md + (n,), _linear(m + f"{n}.weight"))
                   for n in ("gate_proj", "up_proj", "down_proj")]
  plan += [
      (md + ("gate",), _linear(m + "gate.weight")),
      (md + ("e_score_correction_bias",), _copy(m + "gate.e_score_correction_bias")),
  ]
  ed = md + ("experts",)
  if m + "experts.gate_up_proj" in available:
    plan += [
        (ed + ("gate_proj",), _fused_gate_up(m + "experts.gate_up_proj", up=False)),
        (ed + ("up_proj",), _fused_gate_up(m + "experts.gate_up_proj", up=True)),
        (ed + ("down_proj",), _fused_down(m + "experts.down_proj")),
    ]
  else:
    plan += [(ed + (n,), _stacked_experts(
        [m + f"experts.{e}.{n}.weight" for e in range(cfg.n_routed_experts)]))
             for n in ("gate_proj", "up_proj", "down_proj")]
  if cfg.n_shared_experts:
    plan += [(md + ("shared_experts", n), _linear(m + f"shared_experts.{n}.weight"))
             for n in ("gate_proj", "up_proj", "down_proj")]
  return plan


def load_plan(cfg: ModelConfig, available) -> list:
  """[(dest, [hf names], build)] for every parameter of `cfg`."""
  plan = [
      (("embed_tokens",), _copy("model.embed_tokens.weight")),
      (("norm", "scale"), _copy("model.norm.weight")),
      (("lm_head",), _linear("lm_head.weight")),
  ]
  for i in range(cfg.num_hidden_layers):
    plan += _layer_plan(cfg, i, (f"layers_{i}",), cfg.attention_kind(i), cfg.is_moe_layer(i),
                        available)
  if cfg.num_nextn_predict_layers:
    n = cfg.num_hidden_layers
    p = f"model.layers.{n}."
    plan += _layer_plan(cfg, n, ("mtp", "layer"), cfg.attention_kind(n),
                        cfg.is_moe_layer(n), available)
    plan += [
        (("mtp", "eh_proj"), _linear(p + "eh_proj.weight")),
        (("mtp", "enorm", "scale"), _copy(p + "enorm.weight")),
        (("mtp", "hnorm", "scale"), _copy(p + "hnorm.weight")),
        (("mtp", "shared_head_norm", "scale"), _copy(p + "shared_head.norm.weight")),
    ]
  return [(dest, names, build) for dest, (names, build) in plan]


def ignorable_tensors(cfg: ModelConfig, names) -> list[str]:
  """Known tensors we deliberately skip: the MTP layer's copies of the embedding and LM head
  (DeepSeek-style exports; the model uses its main ones) and cached RoPE frequencies."""
  mtp = f"model.layers.{cfg.num_hidden_layers}."
  skip = (mtp + "embed_tokens.weight", mtp + "shared_head.head.weight")
  return [n for n in names if n in skip or n.endswith("rotary_emb.inv_freq")]
