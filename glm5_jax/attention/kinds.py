"""The attention kinds: one `AttentionKind` per pattern letter, and everything known about it.

`model.attention_pattern` holds one letter per layer. Every fact about a letter lives in its
entry of `ATTENTION_KINDS` and nowhere else (its flax module class is in
`glm5_jax.attention.modules`, the one table above the modules): the parameters it adds to its
family's, its KV-cache and recurrent-state sizes, its decode-cache layout, its attention
FLOPs, the kind the MTP layer runs after it, and whether it makes or needs a top-k selection. The config validation, the
decoder, the MTP layer, pattern conversion, the parameter statistics and the FLOPs estimate
all read it.

This module imports only `glm5_jax.layers.axes` and `glm5_jax.attention.cache_spec`, so
`glm5_jax.config` (below the attention modules, which import it) can validate patterns with it.

Notation (docs/design.md): L sequence length, H heads, K = N + R query/key head dim, V value
head dim, C kv latent, R RoPE dim, I index head dim, G KV heads (GQA), W window or conv taps,
A delta-rule chunk length.
"""

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from glm5_jax.attention.cache_spec import CacheSpec
from glm5_jax.layers import axes
from glm5_jax.layers.axes import BATCH, CACHE_LENGTH, KV_LORA

if TYPE_CHECKING:  # never runs: config.py imports this module (docs/design.md)
  from glm5_jax.config import ModelConfig

FAMILIES = ("mla", "gqa")
CACHE_BYTES_PER_NUMBER = 2  # bf16 KV cache and conv-input cache
STATE_BYTES_PER_NUMBER = 4  # fp32 delta-rule state


@dataclasses.dataclass(frozen=True)
class AttentionKind:
  """One attention kind (pattern letter).

  Attributes:
    letter: the `model.attention_pattern` letter.
    name: the kind's name (`ModelConfig.attention_kind`, conversion messages).
    family: "mla" (stores the M layer's projections, `mla_projections.MLA_PARAMS`) or "gqa".
      Layers convert within a family only (`glm5_jax.convert.attention_pattern`).
    description: what the layer computes, one paragraph.
    extra_params: children of `self_attn` only this kind has, beyond its family's (fresh
      init when a layer converts to the kind, dropped when it converts away). Names are unique
      across kinds, so a param tree says which kinds it holds.
    cache_numbers_per_token: cfg -> {cache part: numbers stored per token}, for the KV-cache
      size (`glm5_jax.param_stats`); {} for kinds without a per-token cache.
    recurrent_state_bytes: cfg -> bytes of the constant-size decoding state per sequence.
    attention_flops_per_token: (cfg, seq_len) -> forward FLOPs per token of the attention
      beyond its projections (2 per multiply-add), averaged over a causal row of seq_len.
    mtp_letter: the kind the MTP layer runs when this kind is the model's last layer.
    provides_topk: returns `topk_indices` in aux (outside the "dense" DSA stage), which a
      following `needs_prev_topk` layer reuses.
    needs_prev_topk: reuses the previous layer's selection, so that layer must provide one.
    decode_cache: (cfg, slots, max_len, max_verify) -> {name: `glm5_jax.attention.cache_spec.
      CacheSpec`}, the layer's cache for `Mode(form="decode")` for `slots` sequences of up to
      `max_len` positions, verifying up to `max_verify` tokens per call (k + 1): the module
      reads and returns exactly these arrays, leading dim slots; None while the kind has no
      decode path (`glm5_jax.infer.cache` then refuses the config).
    decode_steps: the cache is a recurrent state: decode with more than one new token also
      returns `aux["cache_steps"]` (each entry after each token, `[B, L, ...]`), and a
      rejected speculative draft is undone by picking a step (`glm5_jax.infer.rollback`);
      otherwise rejected rows are never read and rollback is a no-op.
    decode_in_stack: the decode branch writes its cache only through `decode_rows.with_rows`,
      so a scanned run hands it its layer of the stacked cache (`decode_rows.
      LayerCache`) and the new rows land in the stack in place; other kinds get the
      layer's slice and the run writes it back whole (O(cache) per layer per step: fine for a
      recurrent state, the N and L kinds).
  """

  letter: str
  name: str
  family: str
  description: str
  cache_numbers_per_token: Callable[["ModelConfig"], dict[str, int]]
  recurrent_state_bytes: Callable[["ModelConfig"], int]
  attention_flops_per_token: Callable[["ModelConfig", int], float]
  mtp_letter: str
  extra_params: frozenset[str] = frozenset()
  provides_topk: bool = False
  needs_prev_topk: bool = False
  decode_cache: Callable[["ModelConfig", int, int, int], dict[str, Any]] | None = None
  decode_steps: bool = False
  decode_in_stack: bool = False


# --- sizes and FLOPs, as functions of the config ----------------------------------------------


def _mla_latent(cfg) -> int:
  return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def _no_cache(cfg) -> dict[str, int]:
  del cfg
  return {}


def _no_state(cfg) -> int:
  del cfg
  return 0


def _delta_rule_state_bytes(cfg) -> int:
  """fp32 `[H, K, V]` per sequence."""
  return (STATE_BYTES_PER_NUMBER * cfg.num_attention_heads * cfg.qk_head_dim
          * cfg.v_head_dim)


def _gdn_state_bytes(cfg) -> int:
  """The delta-rule state plus the bf16 conv inputs of the last `gdn_conv_size - 1` positions
  (q and k: H * K each, v: H * V)."""
  h, k, v = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
  conv = CACHE_BYTES_PER_NUMBER * (cfg.gdn_conv_size - 1) * h * (2 * k + v)
  return _delta_rule_state_bytes(cfg) + conv


def _mla_flops(cfg, keys: float) -> float:
  """QK^T and PV over `keys` keys per query: H (K + V) multiply-adds per key."""
  return 2.0 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * keys


def _dense_mla_flops(cfg, seq_len: int) -> float:
  return _mla_flops(cfg, seq_len / 2)  # a causal query sees L/2 keys on average


def _dsa_flops(cfg, seq_len: int) -> float:
  """At most `index_topk` keys (the indexer's own scores are not counted)."""
  return _mla_flops(cfg, min(seq_len / 2, cfg.index_topk))


def _swa_flops(cfg, seq_len: int) -> float:
  """Mean over positions p = 1..L of min(window, p) keys: window - window^2 / 2L when
  window < L."""
  window = cfg.sliding_window
  if window >= seq_len:
    return _dense_mla_flops(cfg, seq_len)
  return _mla_flops(cfg, window - window ** 2 / (2 * seq_len))


def _gqa_flops(cfg, seq_len: int) -> float:
  per_key = cfg.num_attention_heads * 2 * cfg.gqa_head_dim
  return 2.0 * per_key * (seq_len / 2)


def _delta_rule_flops(cfg, seq_len: int) -> float:
  """Chunked delta rule per head, chunk A = min(gdn_chunk_size, L): K K^T and Q K^T within the
  chunk (2 A K), the triangular solve for [U~ | W] (A (K + V) / 2), the intra-chunk scores
  times U (A V) and the three state products W S, Q S, K^T U (3 K V)."""
  h, k, v = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
  a = min(cfg.gdn_chunk_size, seq_len)
  return 2.0 * h * (2 * a * k + a * (k + v) / 2 + a * v + 3 * k * v)


# --- decode caches (`AttentionKind.decode_cache`) ---------------------------------------------


def _mla_decode_cache(cfg, slots: int, max_len: int, max_verify: int) -> dict:
  """The compressed latent only, row p = position p: `ckv [B, S, C]` (normed) and
  `k_rope [B, S, R]` (RoPE applied), C + R = 576 numbers per token for GLM-5; never per-head
  K / V (decode attends in the absorbed form)."""
  del max_verify  # rows are positions: a rejected draft's rows are never read
  rows = lambda width: CacheSpec((slots, max_len, width), cfg.cache_dtype,
                                 (BATCH, CACHE_LENGTH, KV_LORA))
  return {"ckv": rows(cfg.kv_lora_rank), "k_rope": rows(cfg.qk_rope_head_dim)}


def _dsa_decode_cache(cfg, slots: int, max_len: int, max_verify: int) -> dict:
  """The MLA latent plus the lightning indexer's keys `index_k [B, S, I]` (RoPE applied)."""
  return {**_mla_decode_cache(cfg, slots, max_len, max_verify),
          "index_k": CacheSpec((slots, max_len, cfg.index_head_dim), cfg.cache_dtype,
                               (BATCH, CACHE_LENGTH, None))}


def _cache_dtype(cfg) -> str:
  """The dtype of KV / latent / conv-input caches (recurrent states stay fp32)."""
  return cfg.cache_dtype


def _spec(shape, dtype, axes, fill=0):
  return CacheSpec(tuple(shape), dtype, tuple(axes), fill)


def swa_ring_rows(cfg, max_len: int, max_verify: int) -> int:
  """Rows of the S ring: the window (at most max_len) plus max_verify - 1, so that the rows a
  rejected draft overwrote never held a position still inside a later query's window."""
  return min(cfg.sliding_window, max_len) + max_verify - 1


def _gqa_cache(cfg, slots, max_len, max_verify):
  """K and V per position (row p = position p), RoPE applied to K."""
  del max_verify
  shape = (slots, max_len, cfg.num_key_value_heads, cfg.gqa_head_dim)
  spec = lambda: _spec(shape, _cache_dtype(cfg),
                       (axes.BATCH, axes.CACHE_LENGTH, axes.KV_HEADS, None))
  return {"k": spec(), "v": spec()}


def _swa_cache(cfg, slots, max_len, max_verify):
  """A ring of MLA latent rows (`ckv` normed, `k_rope` rotated) and the position each holds
  (-1 = empty); position p lives in row p mod rows."""
  rows = swa_ring_rows(cfg, max_len, max_verify)
  dtype = _cache_dtype(cfg)
  return {"ckv": _spec((slots, rows, cfg.kv_lora_rank), dtype, (axes.BATCH, None, axes.KV_LORA)),
          "k_rope": _spec((slots, rows, cfg.qk_rope_head_dim), dtype, (axes.BATCH, None, None)),
          "pos": _spec((slots, rows), "int32", (axes.BATCH, None), fill=-1)}


def _delta_rule_cache(cfg, slots, max_len, max_verify):
  """The fp32 delta-rule state `[H, K, V]` per slot."""
  del max_len, max_verify
  h, k, v = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
  return {"state": _spec((slots, h, k, v), "float32", (axes.BATCH, axes.HEADS, None, None))}


def _gdn_cache(cfg, slots, max_len, max_verify):
  """The delta-rule state and the last `gdn_conv_size - 1` inputs of each conv (q, k, v before
  the conv, oldest first)."""
  h, k, v, taps = (cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim,
                   cfg.gdn_conv_size - 1)
  conv = lambda x: _spec((slots, taps, h, x), _cache_dtype(cfg), (axes.BATCH, None, axes.HEADS,
                                                                  None))
  return {**_delta_rule_cache(cfg, slots, max_len, max_verify),
          "conv_q": conv(k), "conv_k": conv(k), "conv_v": conv(v)}


# --- the registry ------------------------------------------------------------------------------

ATTENTION_KINDS: dict[str, AttentionKind] = {k.letter: k for k in (
    AttentionKind(
        letter="M", name="mla", family="mla",
        description="dense multi-head latent attention (docs/reference.md section 2, MLA)",
        cache_numbers_per_token=lambda cfg: {"mla_latent": _mla_latent(cfg)},
        recurrent_state_bytes=_no_state, attention_flops_per_token=_dense_mla_flops,
        mtp_letter="M", decode_cache=_mla_decode_cache, decode_in_stack=True),
    AttentionKind(
        letter="D", name="dsa", family="mla",
        description="DSA: MLA restricted to the top-k keys chosen by this layer's lightning "
                    "indexer; `model.dsa_impl` picks how the sparse stage runs",
        extra_params=frozenset({"indexer"}),
        cache_numbers_per_token=lambda cfg: {"mla_latent": _mla_latent(cfg),
                                             "dsa_indexer_keys": cfg.index_head_dim},
        recurrent_state_bytes=_no_state, attention_flops_per_token=_dsa_flops,
        mtp_letter="D", provides_topk=True, decode_cache=_dsa_decode_cache,
        decode_in_stack=True),
    AttentionKind(
        letter="R", name="dsa_shared_topk", family="mla",
        description="DSA that reuses the previous layer's top-k selection and has no indexer "
                    "of its own (HF `indexer_types = \"shared\"`)",
        cache_numbers_per_token=lambda cfg: {"mla_latent": _mla_latent(cfg)},
        recurrent_state_bytes=_no_state, attention_flops_per_token=_dsa_flops,
        # The MTP pass has no previous DSA layer: after an R layer it gets an indexer.
        mtp_letter="D", provides_topk=True, needs_prev_topk=True,
        decode_cache=_mla_decode_cache, decode_in_stack=True),
    AttentionKind(
        letter="G", name="gqa", family="gqa",
        description="grouped-query attention with `num_key_value_heads` KV heads of "
                    "`gqa_head_dim` (the GQA-8 baseline)",
        cache_numbers_per_token=lambda cfg: {
            "gqa_kv": 2 * cfg.num_key_value_heads * cfg.gqa_head_dim},
        recurrent_state_bytes=_no_state, attention_flops_per_token=_gqa_flops,
        mtp_letter="G", decode_cache=_gqa_cache, decode_in_stack=True),
    AttentionKind(
        letter="S", name="swa", family="mla",
        description="sliding-window MLA: the M layer's params and math, each query sees its "
                    "`sliding_window` latest keys (itself included). It runs as a shared-top-k "
                    "DSA layer handed the window as its selection, so `model.dsa_impl` also "
                    "picks how S layers attend: \"dense_mask\" masks a dense [L, S] attention, "
                    "\"xla\" / \"pallas\" gather the W window rows per query (O(L x W))",
        # The latent of the last `sliding_window` tokens only: bytes per token while the
        # context fits the window, constant beyond. (The decode ring adds max_verify - 1 rows
        # and an int32 position per row, `_swa_cache`; not counted here.)
        cache_numbers_per_token=lambda cfg: {"swa_latent": _mla_latent(cfg)},
        recurrent_state_bytes=_no_state, attention_flops_per_token=_swa_flops,
        mtp_letter="S", decode_cache=_swa_cache, decode_in_stack=True),
    AttentionKind(
        letter="N", name="gdn", family="mla",
        description="Gated DeltaNet (arXiv 2412.06464) on the M layer's q/k/v/o projections: "
                    "short causal convs, data-dependent decay and update gates, gated output "
                    "norm",
        extra_params=frozenset({"q_conv1d", "k_conv1d", "v_conv1d", "a_proj", "b_proj",
                                "A_log", "dt_bias", "g_proj", "o_norm"}),
        cache_numbers_per_token=_no_cache, recurrent_state_bytes=_gdn_state_bytes,
        attention_flops_per_token=_delta_rule_flops, mtp_letter="N", decode_cache=_gdn_cache,
        decode_steps=True),
    AttentionKind(
        letter="L", name="simple_gdn", family="mla",
        description="SimpleGDN: the gated delta rule directly on the M layer's q/k/v/o, no "
                    "conv, per-head gates fixed (`simple_gdn_gates=\"fixed\"`) or two learned "
                    "scalars per head (\"learned\", the only case with extra params)",
        extra_params=frozenset({"decay_rate_log", "beta_logit"}),
        cache_numbers_per_token=_no_cache, recurrent_state_bytes=_delta_rule_state_bytes,
        attention_flops_per_token=_delta_rule_flops, mtp_letter="L",
        decode_cache=_delta_rule_cache, decode_steps=True),
)}

KINDS_BY_NAME: dict[str, AttentionKind] = {k.name: k for k in ATTENTION_KINDS.values()}


def _check_registry():
  for kind in ATTENTION_KINDS.values():
    if kind.family not in FAMILIES or kind.mtp_letter not in ATTENTION_KINDS:
      raise ValueError(f"AttentionKind {kind.letter}: family {kind.family!r} or mtp_letter "
                       f"{kind.mtp_letter!r} unknown")
    if ATTENTION_KINDS[kind.mtp_letter].needs_prev_topk:
      raise ValueError(f"AttentionKind {kind.letter}: the MTP layer has no previous layer, so "
                       "its kind cannot need a previous top-k")
  extras = [n for k in ATTENTION_KINDS.values() for n in k.extra_params]
  if len(set(extras)) != len(extras):
    raise ValueError("ATTENTION_KINDS: two attention kinds share an extra param name")


_check_registry()


def layer_kind(pattern: str, layer: int) -> AttentionKind:
  """The kind of `layer` in an expanded per-layer `pattern`; `layer == len(pattern)` is the MTP
  layer, which runs its last layer's `mtp_letter`."""
  if layer == len(pattern):
    return ATTENTION_KINDS[ATTENTION_KINDS[pattern[-1]].mtp_letter]
  return ATTENTION_KINDS[pattern[layer]]


def pattern_error(pattern: str) -> str | None:
  """Why an expanded per-layer `pattern` is impossible, or None: unknown letters, or a layer
  that reuses a previous top-k selection where the previous layer makes none."""
  unknown = sorted(set(pattern) - set(ATTENTION_KINDS))
  if unknown:
    allowed = {letter: k.name for letter, k in ATTENTION_KINDS.items()}
    return f"unknown letters {unknown}; allowed: {allowed}"
  for i, letter in enumerate(pattern):
    if not ATTENTION_KINDS[letter].needs_prev_topk:
      continue
    if i == 0:
      return (f"layer 0 is {letter!r} (reuse the previous layer's top-k) but has no previous "
              "layer")
    if not ATTENTION_KINDS[pattern[i - 1]].provides_topk:
      providers = "".join(k.letter for k in ATTENTION_KINDS.values() if k.provides_topk)
      return (f"layer {i} is {letter!r} but layer {i - 1} is {pattern[i - 1]!r}, not a layer "
              f"that selects top-k keys (one of {providers!r})")
  return None
