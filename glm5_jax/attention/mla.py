"""Multi-head latent attention (MLA) as in GLM-5, optionally sparse (DSA).

docs/reference.md section 2 ("MLA"):

  cq      = RMSNorm(x W_qa)                              [Q]   (also feeds the DSA indexer)
  q       = cq W_qb                                      [H, N + R]  (per head: nope | rope)
  c, kr   = split(x W_kva, [C, R]);  c = RMSNorm(c)      [C], [R]  (kr: one RoPE key head)
  k_nope  = c W_kb,  v = c W_vb                          [H, N], [H, V]
  q_rope, kr get interleaved RoPE; scores use scale (N + R)^-0.5; output o_proj over [H, V].

Expanded form (training / prefill) materializes per-head keys and values. Absorbed form (decode)
folds W_kb into the query and W_vb after attention, so attention runs over the C + R = 576-wide
latent that a KV cache stores; both give the same output.

DSA's sparse stage with `model.dsa_impl` "xla" or "pallas*" runs the absorbed form where it
gathers: all heads of a token share its T selected latent rows (MQA), so the op gathers T rows
of C + R values per query instead of T x H per-head keys, and nothing `[B, L, S]`-shaped is
built (`pallas_kernels.sparse_mla_*`). Over every key (`model.dsa_attention_keys`) nothing is
gathered, and on the Pallas TPU kernels it runs the expanded form where that does fewer FLOPs
(`_expanded_dense_keys`). "dense_mask" masks the dense attention of either form.
`model.attention_impl` "cudnn" runs the expanded form's dense attention (dense MLA, the DSA
warm-up stage, "dense_mask") as cuDNN flash attention (`common.attend_flash`).

Kernels are stored per head, 3-D: `q_b_proj [Q, H, N + R]`, `k_b_proj [C, H, N]`,
`v_b_proj [C, H, V]`, `o_proj [H, V, D]`, so an optimizer can treat each head's slice alone.

Notation (docs/design.md): B batch, L queries, S keys, D hidden, H heads, Q q latent, C kv
latent, N nope head dim, R rope dim, K = N + R, V value head dim, J index heads, I index head
dim, T top-k.
"""

import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

import pallas_kernels
from glm5_jax import routing_replay
from glm5_jax.attention import context_parallel, dsa_kl_fused
from glm5_jax.attention.common import attend, attend_flash, causal_segment_mask, MASKED_LOGIT
from glm5_jax.attention.dsa import (LightningIndexer, indexer_kl_per_query,
                                    restrict_topk_to_visible, topk_mask)
from glm5_jax.attention.mla_decode import decode_attention
from glm5_jax.attention.mla_projections import mla_latents, mla_output
from glm5_jax.attention.mesh_shards import per_shard
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.layers.axes import BATCH, HEADS, LENGTH
from glm5_jax.layers.params import context_split, dtypes
from glm5_jax.layers.rope import apply_interleaved_rope, rope_angles
from pallas_kernels.blocking import platform


class MLA(nn.Module):
  """MLA; `kind` "mla" is dense, "dsa" selects keys with its own lightning indexer, and
  "dsa_shared_topk" reuses the previous layer's selection (`prev_topk_BLT`)."""

  cfg: ModelConfig
  kind: str = "mla"

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT=None, *,
               mode: Mode = Mode(), cache=None, recorded_topk_BLT=None):
    """Args:
      x_BLD: normalized layer input.
      positions_BL: int positions (RoPE).
      segment_ids_BL: int document ids; attention never crosses them.
      prev_topk_BLT: the previous DSA layer's selection, for kind "dsa_shared_topk".
      mode: `mode.form` "absorbed" runs the latent (decode) computation instead of the
        expanded one; `mode.dsa_stage` is how DSA kinds attend ("dense": plain MLA, the
        indexer does not run; "warmup": the indexer runs and learns, attention stays dense;
        "sparse": attention restricted to the top-k keys). See `glm5_jax.attention.mode`.
        `mode.form` "decode": the L tokens are new ones at absolute positions (segment id 0 =
        padding) attending over `cache` (`glm5_jax.attention.mla_decode`).
      cache: decode form only: this layer's `{"ckv", "k_rope"[, "index_k"]}` (`[B, S, ...]`).
      recorded_topk_BLT: kind "dsa", expanded / absorbed forms: a recorded selection (key
        positions, -1 rows choose their own) used instead of the indexer's top-k
        (`glm5_jax.routing_replay`); the indexer still runs (its KL is over the selection used).
    Returns:
      `(y_BLD, aux)`; for DSA kinds outside "dense" aux holds `topk_indices [B, L, T]`
      (int32, -1 = empty slot), and when this layer ran its indexer `indexer_kl [B, L]`:
      KL(main attention || softmax(index scores)) per query, over the visible keys in "warmup"
      and over the selected keys in "sparse"; and `index_scores [B, L, S]` (fp32) except in the
      "sparse" stage with `dsa_impl` "xla" / "pallas", which never builds that matrix.
      Decode form: aux holds `cache` (updated) and, for DSA kinds outside "dense",
      `topk_indices` (cache rows); nothing else.
    """
    c = self.cfg
    if self.is_initializing():
      # Init needs shapes only: it traces the backend-free paths (same params), so a model set
      # to the GPU / TPU kernels or cuDNN is built and counted on any host.
      c = dataclasses.replace(c, attention_impl="xla", dsa_impl=(
          "xla" if c.dsa_impl in pallas_kernels.PALLAS_IMPLS else c.dsa_impl))
    dtype, pdtype = dtypes(c)
    n, r, k = c.qk_nope_head_dim, c.qk_rope_head_dim, c.qk_head_dim
    x_BLD = x_BLD.astype(dtype)
    q_BLHK, cq_BLQ, ckv_BSC, k_rope_BSR, w_kb_CHN, w_vb_CHV = mla_latents(self, c, x_BLD)

    cos, sin = rope_angles(positions_BL, r, c.rope_theta)
    q_nope_BLHN = q_BLHK[..., :n]
    q_rope_BLHR = apply_interleaved_rope(q_BLHK[..., n:], cos, sin)
    k_rope_BSR = apply_interleaved_rope(k_rope_BSR, cos, sin)

    if self.kind not in ("mla", "dsa", "dsa_shared_topk"):
      raise ValueError(f"MLA got unknown kind {self.kind!r}")
    selects = self.kind != "mla" and mode.dsa_stage != "dense"
    decode = mode.form == "decode"
    if decode != (cache is not None):
      raise ValueError("MLA: a cache is given exactly in Mode(form='decode'), got form "
                       f"{mode.form!r} with cache {'given' if cache is not None else 'None'}")
    if recorded_topk_BLT is not None and (self.kind != "dsa" or decode):
      raise ValueError(f"MLA: recorded_topk_BLT replays a 'dsa' layer's own selection outside "
                       f"decode; got kind {self.kind!r}, form {mode.form!r}")
    index_qkw, given_topk_BLT = None, None
    if self.kind == "dsa" and (selects or self.is_initializing()):
      indexer = LightningIndexer(c.index_n_heads, c.index_head_dim, r, c.indexer_norm_eps,
                                 c.initializer_range, dtype, pdtype, name="indexer")
      # The indexer learns only from its own KL loss: its inputs are detached so that loss
      # never reaches the main model, and top-k passes no LM-loss gradient back to it.
      index_qkw = indexer(jax.lax.stop_gradient(x_BLD), jax.lax.stop_gradient(cq_BLQ), cos, sin)
    elif self.kind == "dsa_shared_topk" and selects:
      if prev_topk_BLT is None:
        raise ValueError("a dsa_shared_topk layer needs the previous DSA layer's top-k")
      given_topk_BLT = prev_topk_BLT

    order = None
    if not decode:
      # Context parallelism: queries stay on their devices; the per-token key state (latent,
      # RoPE key, indexer key: C + R + I numbers) and its document ids are gathered over the
      # sequence's devices, in sequence order (the striped layout's rows put back), and each
      # query carries its sequence index. Without a context axis: the arrays as they are.
      layout = mode.context_layout
      keys = functools.partial(context_parallel.whole_sequence, layout=layout)
      order = _Order(context_parallel.query_index(*segment_ids_BL.shape, layout),
                     keys(segment_ids_BL))
      ckv_BSC, k_rope_BSR = keys(ckv_BSC), keys(k_rope_BSR)
      if index_qkw is not None:
        index_qkw = (index_qkw[0], keys(index_qkw[1]), index_qkw[2])
    latents = _Latents(q_nope_BLHN, q_rope_BLHR, ckv_BSC, k_rope_BSR, w_kb_CHN, w_vb_CHV)
    scale = k ** -0.5
    if decode:
      out_BLHV, aux = decode_attention(c, latents, scale, positions_BL, segment_ids_BL,
                                       index_qkw, given_topk_BLT, cache, mode.dsa_stage,
                                       _absorbed_attention)
    elif selects and mode.dsa_stage == "sparse" and c.dsa_impl != "dense_mask":
      out_BLHV, aux = _sparse_stage_attention(c, latents, scale, segment_ids_BL, order, index_qkw,
                                              given_topk_BLT, recorded_topk_BLT)
    else:
      out_BLHV, aux = _dense_attention(c, latents, scale, segment_ids_BL, order, index_qkw,
                                       given_topk_BLT, mode, recorded_topk_BLT)
    return mla_output(self, c, out_BLHV), aux


class _Order(typing.NamedTuple):
  """Where the local queries sit in the sequence (`glm5_jax.attention.context_parallel`)."""

  q_index_BL: jax.Array  # int32 sequence index of each query
  key_segment_ids_BS: jax.Array  # the whole sequence's document ids, in sequence order


class _Latents(typing.NamedTuple):
  """What attention needs from `mla_latents`, RoPE applied."""

  q_nope_BLHN: jax.Array
  q_rope_BLHR: jax.Array
  ckv_BSC: jax.Array
  k_rope_BSR: jax.Array
  w_kb_CHN: jax.Array
  w_vb_CHV: jax.Array


def _dense_attention(c, latents: _Latents, scale, segment_ids_BL, order: _Order, index_qkw,
                     given_topk_BLT, mode: Mode, recorded_topk_BLT=None):
  """`dsa_impl="dense_mask"`, the warm-up stage and dense MLA: attention over a `[B, L, S]` mask
  (the top-k selection folded into it in the sparse stage).

  Args:
    order: the queries' sequence indices and the keys' document ids (`_Order`).
    index_qkw: this layer's indexer projections `(q_BLJI, k_BSI, weights_BLJ)`, or None.
    given_topk_BLT: a selection made elsewhere (the previous layer's, a sliding window), or
      None.
    recorded_topk_BLT: a replayed selection that replaces the indexer's (`MLA.__call__`).
  Returns:
    `(out_BLHV, aux)`, aux with the DSA entries documented in `MLA.__call__`.
  """
  aux = {}
  visible_BLS = causal_segment_mask(segment_ids_BL, q_index_BL=order.q_index_BL,
                                    key_segment_ids_BS=order.key_segment_ids_BS)
  topk_BLT = given_topk_BLT
  if index_qkw is not None:
    index_scores_BLS = pallas_kernels.indexer_scores_reference(
        *index_qkw, order.q_index_BL, segment_ids_BL, order.key_segment_ids_BS,
        scale=c.index_head_dim ** -0.5)
    topk_BLT, _ = pallas_kernels.select_topk(index_scores_BLS, c.index_topk)
    if recorded_topk_BLT is not None:
      topk_BLT = routing_replay.replay(topk_BLT, recorded_topk_BLT)
    aux["index_scores"] = index_scores_BLS
  if topk_BLT is not None:
    aux["topk_indices"] = topk_BLT
    if mode.dsa_stage == "sparse":
      visible_BLS = visible_BLS & topk_mask(topk_BLT, visible_BLS.shape[-1])
  q_nope_BLHN, q_rope_BLHR, ckv_BSC, k_rope_BSR, w_kb_CHN, w_vb_CHV = latents
  if mode.form == "absorbed":
    out_BLHV, probs_BLS = _absorbed_attention(latents, visible_BLS, scale)
  else:
    r = k_rope_BSR.shape[-1]
    k_nope_BSHN = jnp.einsum("bsc,chn->bshn", ckv_BSC, w_kb_CHN)
    v_BSHV = jnp.einsum("bsc,chv->bshv", ckv_BSC, w_vb_CHV)
    k_rope_BSHR = jnp.broadcast_to(k_rope_BSR[:, :, None, :], k_nope_BSHN.shape[:3] + (r,))
    q_BLHK = jnp.concatenate([q_nope_BLHN, q_rope_BLHR], axis=-1)
    k_BSHK = jnp.concatenate([k_nope_BSHN, k_rope_BSHR], axis=-1)
    if c.attention_impl == "cudnn":
      _check_cudnn(c)
      out_BLHV = attend_flash(q_BLHK, k_BSHK, v_BSHV, visible_BLS, scale, "cudnn")
      # cuDNN returns no probabilities; the indexer KL's (detached) target recomputes them in
      # XLA, forward only (the warm-up stage builds `[B, L, S]` index scores anyway).
      probs_BLS = None if index_qkw is None else jax.lax.stop_gradient(
          attend(q_BLHK, k_BSHK, v_BSHV, visible_BLS, scale)[1])
    else:
      out_BLHV, probs_BLS = attend(q_BLHK, k_BSHK, v_BSHV, visible_BLS, scale)
  if index_qkw is not None:
    aux["indexer_kl"] = indexer_kl_per_query(
        aux["index_scores"], jax.lax.stop_gradient(probs_BLS), visible_BLS)
  return out_BLHV, aux


def _check_cudnn(c):
  """`model.attention_impl="cudnn"` needs a GPU and a 16-bit `model.dtype` (cuDNN's flash
  attention takes bf16 / fp16), checked when the attention is traced."""
  where = platform()
  if where != "gpu":
    raise ConfigError(f"config.model.attention_impl: 'cudnn' (cuDNN flash attention) runs on "
                      f"GPU only, and this computation is for {where!r}; use 'xla' there")
  if c.dtype not in ("bfloat16", "float16"):
    raise ConfigError(f"config.model.attention_impl: 'cudnn' needs model.dtype 'bfloat16' or "
                      f"'float16' (cuDNN flash attention), got {c.dtype!r}")


def _sparse_stage_attention(c, latents: _Latents, scale, segment_ids_BL, order: _Order,
                            index_qkw, given_topk_BLT, recorded_topk_BLT=None):
  """The sparse stage on `pallas_kernels` (`dsa_impl` "xla" | "pallas" | "pallas_interpret"),
  O(L x T) throughout.

    1. top-k from the indexer's projections (scores per block of queries), or the given
       selection restricted to causally visible same-document keys;
    2. absorbed sparse attention over the selected latent rows -> output and log-sum-exp;
    3. indexer KL on the selected keys: I at the selection (differentiable, reaches only the
       indexer, whose inputs are detached) against the main attention's head-mean probability
       there, detached: from step 2's own probabilities where the op can give them (the Pallas
       kernels' forward, `DSAOps.sparse_mla_with_probs`; "xla" partitioned by XLA,
       `sparse_mla_xla_with_kl_target`), else recomputed from the log-sum-exp by
       `sparse_mla_head_mean_probs` (a second pass over the gathered rows).
  Args as `_dense_attention`. Returns `(out_BLHV, aux)`: aux holds `topk_indices` and, with an
  indexer, `indexer_kl` (no `index_scores`: that would be the `[B, L, S]` matrix this path
  exists to avoid).
  """
  q_nope_BLHN, q_rope_BLHR, ckv_BSC, k_rope_BSR, w_kb_CHN, w_vb_CHV = latents
  index_scale = c.index_head_dim ** -0.5
  visible = lambda topk_BLT: restrict_topk_to_visible(topk_BLT, segment_ids_BL, *order)
  if index_qkw is not None:
    topk_BLT, _ = _indexer_topk_on_mesh(c.dsa_impl, topk=c.index_topk, scale=index_scale)(
        *index_qkw, order.q_index_BL, segment_ids_BL, order.key_segment_ids_BS)
    if recorded_topk_BLT is not None:  # a record from elsewhere: keep only visible keys
      topk_BLT = visible(routing_replay.replay(topk_BLT, recorded_topk_BLT))
    aux = {"topk_indices": topk_BLT}
  else:  # a selection made elsewhere (previous layer, sliding window): drop invisible keys
    aux = {"topk_indices": given_topk_BLT}
    topk_BLT = visible(given_topk_BLT)
  # Names for `model.remat_policy` "save_attn_lse" (glm5_jax.layers.remat): with the sparse
  # kernels' out / lse residuals kept, the backward reruns none of the selection, the sparse
  # forward or the KL terms.
  topk_BLT = checkpoint_name(topk_BLT, "dsa_topk")
  queries, keys, slots = q_nope_BLHN.shape[1], ckv_BSC.shape[1], topk_BLT.shape[-1]
  if _dense_keys(c, queries, keys, slots) and _expanded_dense_keys(c):
    with jax.named_scope("sparse_mla"):
      out_BLHV, kl = _expanded_dense_keys_attention(c, latents, scale, index_scale, topk_BLT,
                                                    index_qkw)
    if kl is not None:
      aux["indexer_kl"] = kl
    return out_BLHV, aux
  q_latent_BLHC = jnp.einsum("blhn,chn->blhc", q_nope_BLHN, w_kb_CHN)
  # The GPU kernels: attention and indexer KL as one op, the target from the attention's
  # backward (`dsa_kl_fused`). Else, where the attention pass gives the KL target (the Pallas
  # kernels' forward; "xla" partitioned by XLA), no second pass gathers the selected rows for
  # it; otherwise ("xla" under context parallelism) `_kl_target_on_mesh` computes it.
  # Over every key instead (`model.dsa_attention_keys`): XLA on any backend, the KL target
  # from its own pass.
  dense_keys = _dense_keys(c, queries, keys, slots)
  kl_in_backward = index_qkw is not None and (
      _dense_kl_in_backward(c, queries, keys, slots) if dense_keys
      else kl_target_in_backward(c))
  fused_target = (index_qkw is not None and not kl_in_backward and not dense_keys
                  and pallas_kernels.dsa_ops(c.dsa_impl).sparse_mla_with_probs is not None)
  target_in_pass = (index_qkw is not None and not dense_keys and c.dsa_impl == "xla"
                    and not _queries_per_shard(c.dsa_impl))
  # Named scopes label the ops' `op_name` for per-category FLOP / time tables
  # (glm5_jax.planning.flop_ledger); they change nothing else.
  with jax.named_scope("sparse_mla"):
    if kl_in_backward:
      with_kl = (_dense_keys_and_kl(scale, index_scale) if dense_keys
                 else _sparse_mla_and_kl_on_mesh(c.dsa_impl, scale, index_scale))
      out_latent_BLHC, lse_BLH, kl_BL = with_kl(
          q_latent_BLHC, q_rope_BLHR, ckv_BSC, k_rope_BSR, topk_BLT, *index_qkw)
      aux["indexer_kl"] = kl_BL
    elif dense_keys:
      out_latent_BLHC, lse_BLH, *target = _dense_keys_on_mesh(
          scale, with_target=index_qkw is not None)(
              q_latent_BLHC, q_rope_BLHR, ckv_BSC, k_rope_BSR, topk_BLT)
      if target:
        target_BLT = target[0]
    elif target_in_pass:
      out_latent_BLHC, lse_BLH, target_BLT = pallas_kernels.sparse_mla_xla_with_kl_target(
          q_latent_BLHC, q_rope_BLHR, ckv_BSC, k_rope_BSR, topk_BLT, scale=scale,
          head_groups=context_split(HEADS), batch_shards=context_split(BATCH))
    else:
      out_latent_BLHC, lse_BLH, *target = _sparse_mla_on_mesh(
          c.dsa_impl, scale, with_probs=fused_target)(
              q_latent_BLHC, q_rope_BLHR, ckv_BSC, k_rope_BSR, topk_BLT)
      if fused_target:
        target_BLT = jax.lax.stop_gradient(target[0])  # the kernel drops its cotangent too
  if index_qkw is not None and not kl_in_backward:
    if not (target_in_pass or fused_target or dense_keys):
      (target_BLT,) = _kl_target_on_mesh(scale)(
          topk_BLT, q_latent_BLHC, q_rope_BLHR, ckv_BSC, k_rope_BSR, lse_BLH)
    target_BLT = checkpoint_name(target_BLT, "indexer_kl_target")
    (aux["indexer_kl"],) = _indexer_kl_on_mesh(index_scale)(*index_qkw, topk_BLT, target_BLT)
  return jnp.einsum("blhc,chv->blhv", out_latent_BLHC, w_vb_CHV), aux


def _dense_keys(c: ModelConfig, queries: int, keys: int, slots: int) -> bool:
  """Whether the sparse attention runs over every key with the selection as counts
  (`pallas_kernels.sparse_mla_dense`), by `model.dsa_attention_keys`: "dense" always, "gather"
  never, "auto" where it forms no more logits than the gather does: causal self-attention (the
  same positions for queries and keys, no context split) with S <= 2 T, where a query has S / 2
  causal keys on average and the gather paths attend over all T slots."""
  if c.dsa_attention_keys == "auto":
    return context_split(LENGTH) == 1 and queries == keys and keys <= 2 * slots
  return c.dsa_attention_keys == "dense"


def _expanded_dense_keys(c: ModelConfig) -> bool:
  """Whether the attention over every key (`_dense_keys`) runs in the expanded form, per-head
  keys and values, on the Pallas TPU kernels (`DSAOps.dense_expanded_parts`: `model.dsa_impl`
  "pallas" on TPU, "pallas_interpret"): where it does fewer FLOPs than the absorbed form,
  `N + V < 2 C` (a head and key cost 2 (N + R) + 2 V against 2 (C + R) + 2 C; expanding the
  keys costs what absorbing the queries does; GLM-5: 192 + 256 < 1,024, 2.1x fewer), with every
  head and the whole sequence on each device (the KL target is a mean over all heads; no
  context split). In XLA the expanded form is slower than the absorbed one (the TPU compiler's
  own estimate: its `[B, H, L, S]` intermediates cost more than the products it saves,
  docs/scaling.md), so "xla" keeps the absorbed form."""
  if (context_split(LENGTH) > 1 or context_split(HEADS) > 1
      or c.qk_nope_head_dim + c.v_head_dim >= 2 * c.kv_lora_rank
      or c.dsa_impl not in pallas_kernels.PALLAS_IMPLS):
    return False
  dispatch = pallas_kernels.dispatch
  if c.dsa_impl == "pallas" and dispatch.current_platform() not in dispatch.PALLAS_BY_PLATFORM:
    return False  # no kernels here: the sparse stage itself names the field
  return pallas_kernels.dsa_ops(c.dsa_impl).dense_expanded_parts is not None


def _expanded_keys(ckv_BSC, k_rope_BSR, w_kb_CHN):
  """Every head's key `[B, S, H, N + R]` = `[ckv W_kb | k_rope]`, as one product of the latent
  and the rope key side by side with the up-projection beside an identity:

      [ckv | k_rope] [[W_kb, 0], [0, I]]        ([C + R] x [H, N + R] per position)

  The same numbers (the extra terms are exact zeros; the rope key times one), 1.5x the product's
  FLOPs at GLM-5's C 512, R 64, N 192. Concatenated after the product instead, the TPU compiler
  materialized the rope key broadcast over the heads and wrote the joined keys in a pass of
  their own (a lane offset of N = 192, not a multiple of 128): 1.1 ms a layer in the 744B
  headline's forward and again in its rerun, where the wider product costs 0.2 ms more (its
  estimates, docs/scaling.md)."""
  c, h, n = w_kb_CHN.shape
  r = k_rope_BSR.shape[-1]
  dtype = jnp.result_type(ckv_BSC, w_kb_CHN)
  latent_BSX = jnp.concatenate([ckv_BSC.astype(dtype), k_rope_BSR.astype(dtype)], axis=-1)
  w_kb_CHN = w_kb_CHN.astype(dtype)
  eye_RHR = jnp.broadcast_to(jnp.eye(r, dtype=dtype)[:, None, :], (r, h, r))
  w_XHK = jnp.concatenate([jnp.pad(w_kb_CHN, ((0, 0), (0, 0), (0, r))),
                           jnp.pad(eye_RHR, ((0, 0), (0, 0), (n, 0)))], axis=0)
  return jnp.einsum("bsx,xhk->bshk", latent_BSX, w_XHK)


def _expanded_dense_keys_attention(c: ModelConfig, latents: _Latents, scale: float,
                                   index_scale: float, topk_BLT, index_qkw):
  """`(out_BLHV, kl_BL or None)`: the sparse stage over every key in the expanded form on the
  kernels of `model.dsa_impl`, causal (the same positions for queries and keys), per device
  under `mesh_shards.per_shard` (a pallas_call is opaque to the partitioner; the batch split,
  every head and key local). With an indexer the KL is fused with it, its target from the
  attention's backward kernels (`dsa_kl_fused`); without one (a given selection) the kernels'
  own custom VJP."""
  q_nope_BLHN, q_rope_BLHR, ckv_BSC, k_rope_BSR, w_kb_CHN, w_vb_CHV = latents
  q_BLHK = jnp.concatenate([q_nope_BLHN, q_rope_BLHR.astype(q_nope_BLHN.dtype)], axis=-1)
  k_BSHK = _expanded_keys(ckv_BSC, k_rope_BSR, w_kb_CHN)
  v_BSHV = jnp.einsum("bsc,chv->bshv", ckv_BSC, w_vb_CHV)
  q_axes, kv_axes, q_rows = (BATCH, LENGTH, HEADS, None), (BATCH, None, HEADS, None), (
      BATCH, LENGTH, None)
  if index_qkw is None:
    interpret = c.dsa_impl == "pallas_interpret"

    def op(q_BLHK, k_BSHK, v_BSHV, topk_BLT):
      return pallas_kernels.sparse_mla_dense_expanded_pallas(
          q_BLHK, k_BSHK, v_BSHV, topk_BLT, scale=scale, causal=True, interpret=interpret)[:1]

    (out_BLHV,) = per_shard(op, in_axes=(q_axes, kv_axes, kv_axes, q_rows),
                            out_axes=(q_axes,), name="sparse_mla_dense_expanded")(
                                q_BLHK, k_BSHK, v_BSHV, topk_BLT)
    return out_BLHV, None
  parts = pallas_kernels.dsa_ops(c.dsa_impl).dense_expanded_parts(causal=True)
  op = functools.partial(dsa_kl_fused.expanded_sparse_mla_with_indexer_kl, parts, scale=scale,
                         index_scale=index_scale)
  out_BLHV, _, kl_BL = per_shard(
      op, in_axes=(q_axes, kv_axes, kv_axes, q_rows, (BATCH, LENGTH, None, None),
                   (BATCH, None, None), q_rows),
      out_axes=(q_axes, (BATCH, LENGTH, HEADS), (BATCH, LENGTH)),
      name="sparse_mla_dense_expanded")(q_BLHK, k_BSHK, v_BSHV, topk_BLT, *index_qkw)
  return out_BLHV, kl_BL


def _dense_kl_in_backward(c: ModelConfig, queries: int, keys: int, slots: int) -> bool:
  """Whether the attention over every key (`_dense_keys`) and the indexer KL run as one op,
  the KL target from the attention's backward (`_dense_keys_and_kl`): wherever XLA partitions
  it (no context split). The forward then forms no target, nor does a remat's rerun of it
  (744B headline under full remat: the head mean over `[B, Lb, H, S]` once a step instead of
  twice), and a differentiated step's KL value is 0 (`kl_target_in_backward`)."""
  return _dense_keys(c, queries, keys, slots) and context_split(LENGTH) == 1


def _dense_keys_and_kl(scale: float, index_scale: float):
  """`dsa_kl_fused.sparse_mla_with_indexer_kl` on `pallas_kernels.sparse_mla_dense_parts`,
  partitioned by XLA and causal (`_dense_keys_on_mesh`'s layout without context parallelism).
  Args: `(q_latent, q_rope, ckv, k_rope, topk, index_q, index_k, index_w)`; returns
  `(out_BLHC, lse_BLH, kl_BL)`; XLA on any backend."""
  batch_shards = context_split(BATCH)
  parts = pallas_kernels.sparse_mla_dense_parts(causal=True, head_groups=context_split(HEADS),
                                                batch_shards=batch_shards)
  return functools.partial(dsa_kl_fused.sparse_mla_with_indexer_kl, parts, scale=scale,
                           index_scale=index_scale, batch_shards=batch_shards)


def _dense_keys_on_mesh(scale: float, with_target: bool):
  """`pallas_kernels.sparse_mla_dense` (`..._with_kl_target` for `with_target`) laid out for
  the context mesh: partitioned by XLA and causal (query blocks skip the keys after them)
  without context parallelism; under it per device on its own queries (`mesh_shards.per_shard`:
  a loop over query blocks of a sequence split over `context` is one XLA cannot partition, see
  `_queries_per_shard`), keys whole, not causal (the local queries are not the key positions;
  every slot is visible by `restrict_topk_to_visible`), the target's head mean taken over the
  head shards. Args: `(q_latent, q_rope, ckv, k_rope, topk)`; returns `(out, lse[, target])`."""
  op = (pallas_kernels.sparse_mla_dense_with_kl_target if with_target
        else pallas_kernels.sparse_mla_dense)
  if context_split(LENGTH) == 1:
    return functools.partial(op, scale=scale, causal=True, head_groups=context_split(HEADS),
                             batch_shards=context_split(BATCH))
  return _sparse_mla_per_device(pallas_kernels.sparse_mla_dense,
                                pallas_kernels.sparse_mla_dense_with_kl_target, scale,
                                with_probs=with_target, name="sparse_mla_dense")


def _sparse_mla_per_device(sparse_mla, sparse_mla_with_probs, scale, *, with_probs, name,
                           **options):
  """`sparse_mla` (or, `with_probs`, `sparse_mla_with_probs` and the mean of its head-mean
  probabilities over the head shards: equal head counts make it the mean over all heads) per
  device under `mesh_shards.per_shard`: queries and their selections keep the batch, sequence
  (context parallelism) and head splits, the key rows are whole on every device, their
  cotangents summed at the boundary. `options`: the op's keyword arguments."""
  q_axes, rows_axes = (BATCH, LENGTH, HEADS, None), (BATCH, None, None)
  in_axes = (q_axes, q_axes, rows_axes, rows_axes, (BATCH, LENGTH, None))
  if not with_probs:
    return per_shard(functools.partial(sparse_mla, scale=scale, **options), in_axes=in_axes,
                     out_axes=(q_axes, (BATCH, LENGTH, HEADS)), name=name)

  def local(*args):  # this device's head mean, one row per head shard: [B, L, 1, T]
    out_BLHC, lse_BLH, probs_BLT = sparse_mla_with_probs(*args, scale=scale, **options)
    return out_BLHC, lse_BLH, probs_BLT[:, :, None]

  run = per_shard(local, in_axes=in_axes,
                  out_axes=(q_axes, (BATCH, LENGTH, HEADS), (BATCH, LENGTH, HEADS, None)),
                  name=name)

  def with_head_mean(*args):
    out_BLHC, lse_BLH, probs_BLGT = run(*args)
    return out_BLHC, lse_BLH, probs_BLGT.mean(axis=2)

  return with_head_mean


def _queries_per_shard(impl: str) -> bool:
  """Whether the sparse stage's ops run per device under `mesh_shards.per_shard`: always for
  the Pallas impls (a pallas_call is opaque to the partitioner, which would gather the whole
  batch), and for "xla" under context parallelism. There the ops loop over blocks of queries
  (`pallas_kernels.blocking.map_query_blocks`), and a loop over a sequence axis split over
  `context` is one XLA cannot partition: the TPU compiler all-gathered the whole sequence's
  queries in every iteration and ran every query block on every device (GLM-5 at 128K on
  context 16: 8 GiB per iteration, 8,192 iterations per layer; docs/scaling.md)."""
  return impl in pallas_kernels.PALLAS_IMPLS or context_split(LENGTH) > 1


def kl_target_in_backward(c: ModelConfig, seq_len: int | None = None) -> bool:
  """Whether the sparse stage's indexer KL takes its target from the attention's backward
  kernel (`glm5_jax.attention.dsa_kl_fused`): for training sequences of `seq_len` tokens, where
  the attention runs over every key there (`_dense_kl_in_backward`); else where `model.dsa_impl`
  picks kernels that come apart for it (`DSAOps.sparse_mla_parts`: the GPU Triton ones) and
  every head of a query is on its device (the target is a mean over all heads). Then a
  differentiated step's KL value is 0 (its gradient exact) and the train step reports no
  `indexer_kl`; called at trace time."""
  if (seq_len is not None and c.dsa_impl != "dense_mask"
      and _dense_kl_in_backward(c, seq_len, seq_len, c.index_topk)):
    return True
  if c.dsa_impl not in pallas_kernels.PALLAS_IMPLS or context_split(HEADS) > 1:
    return False
  dispatch = pallas_kernels.dispatch  # its platform: the one `dsa_ops` picks kernels by
  if c.dsa_impl == "pallas" and dispatch.current_platform() not in dispatch.PALLAS_BY_PLATFORM:
    return False  # no kernels here: the sparse stage itself names the field
  return pallas_kernels.dsa_ops(c.dsa_impl).sparse_mla_parts is not None


def _sparse_mla_and_kl_on_mesh(impl: str, scale: float, index_scale: float):
  """`dsa_kl_fused.sparse_mla_with_indexer_kl` on the kernels of `impl`, per device under
  `mesh_shards.per_shard` (a pallas_call is opaque to the partitioner): queries, their
  selections and the indexer's queries and weights keep the batch and sequence splits, the key
  rows and indexer keys are whole (their cotangents summed at the boundary); every head is on
  the device (`kl_target_in_backward`). Args: `(q_latent, q_rope, ckv, k_rope, topk, index_q,
  index_k, index_w)`; returns `(out_BLHC, lse_BLH, kl_BL)`."""
  parts = pallas_kernels.dsa_ops(impl).sparse_mla_parts()
  op = functools.partial(dsa_kl_fused.sparse_mla_with_indexer_kl, parts, scale=scale,
                         index_scale=index_scale)
  q_axes, rows_axes, q_rows = (BATCH, LENGTH, HEADS, None), (BATCH, None, None), (BATCH, LENGTH,
                                                                                  None)
  return per_shard(op, in_axes=(q_axes, q_axes, rows_axes, rows_axes, q_rows,
                                (BATCH, LENGTH, None, None), rows_axes, q_rows),
                   out_axes=(q_axes, (BATCH, LENGTH, HEADS), (BATCH, LENGTH)),
                   name="sparse_mla_pallas")


def _indexer_kl_on_mesh(index_scale: float):
  """The indexer KL per query, fp32 `[B, L]` (`_sparse_stage_attention` step 3): I at the
  selection (`indexer_scores_at`) and its KL to `target_BLT` per query block, inside the
  block's checkpoint, so no `[B, L, T]` scores outlive a block and the blocks run twice per
  step under any remat policy (`indexer_scores_at`'s `reduce_block`). Per device on its own
  queries under context parallelism (see `_queries_per_shard`), XLA-partitioned otherwise.
  Args: the indexer's `(q_BLJI, k_BSI, weights_BLJ)`, `topk_BLT`, `target_BLT`; returns a
  1-tuple."""

  def kl(q_BLJI, k_BSI, weights_BLJ, topk_BLT, target_BLT, batch_shards=1):
    return (dsa_kl_fused.indexer_kl_at_selection(
        q_BLJI, k_BSI, weights_BLJ, topk_BLT, target_BLT, index_scale=index_scale,
        batch_shards=batch_shards,
        causal=dsa_kl_fused.self_attention_positions(q_BLJI, k_BSI)),)

  if context_split(LENGTH) == 1:  # blocks sized by each device's rows, not the global batch
    return functools.partial(kl, batch_shards=context_split(BATCH))
  # Keys whole, their cotangents summed over `context` at the boundary.
  q_rows = (BATCH, LENGTH, None)
  return per_shard(kl, in_axes=((BATCH, LENGTH, None, None), (BATCH, None, None), q_rows,
                                q_rows, q_rows),
                   out_axes=((BATCH, LENGTH),), name="indexer_kl")


def _kl_target_on_mesh(scale: float):
  """The indexer KL's target where the attention pass did not give it: the main attention's
  head-mean probability at the selection, fp32 `[B, L, T]`, recomputed from its log-sum-exp
  (`sparse_mla_head_mean_probs`, a second pass over the gathered rows); per device under
  context parallelism, as `_indexer_kl_on_mesh`. Args: `topk_BLT`, then the main attention's
  `q_latent_BLHC, q_rope_BLHR, ckv_BSC, k_rope_BSR, lse_BLH`; returns a 1-tuple."""

  def target(topk_BLT, q_latent_BLHC, q_rope_BLHR, ckv_BSC, k_rope_BSR, lse_BLH):
    with jax.named_scope("kl_target"):
      return (pallas_kernels.sparse_mla_head_mean_probs(
          q_latent_BLHC, q_rope_BLHR, ckv_BSC, k_rope_BSR, topk_BLT, lse_BLH, scale=scale),)

  if context_split(LENGTH) == 1:
    return target
  # The head mean needs every head on the device (heads whole: the context layouts have no
  # `tensor` split to undo); keys whole.
  q_rows = (BATCH, LENGTH, None)
  queries = (BATCH, LENGTH, None, None)
  keys = (BATCH, None, None)
  return per_shard(target, in_axes=(q_rows, queries, queries, keys, keys, q_rows),
                   out_axes=(q_rows,), name="kl_target")


def _indexer_topk_on_mesh(impl: str, **options):
  """`pallas_kernels.dsa_ops(impl).indexer_topk(..., **options)` laid out for the context mesh:
  "xla" partitioned by XLA without context parallelism (its top-k is a sort, which stays on
  the batch's devices); otherwise (`_queries_per_shard`) per device on its batch rows and
  queries under `mesh_shards.per_shard`, the index heads gathered (the op sums over all of
  them)."""
  op = functools.partial(pallas_kernels.dsa_ops(impl).indexer_topk, **options)
  if not _queries_per_shard(impl):
    # Traced with global shapes: "xla" sizes its query blocks by each device's batch rows.
    return functools.partial(op, batch_shards=context_split(BATCH)) if impl == "xla" else op
  # Queries (and their positions, global key indices) keep the residual stream's sequence
  # split (context parallelism); keys and their segment ids are whole on every device.
  q_rows, keys = (BATCH, LENGTH, None), (BATCH, None, None)
  return per_shard(op, in_axes=((BATCH, LENGTH, None, None), keys, q_rows, (BATCH, LENGTH),
                                (BATCH, LENGTH), (BATCH, None)),
                   out_axes=(q_rows, q_rows), name="indexer_topk")


def _sparse_mla_on_mesh(impl: str, scale: float, with_probs: bool = False, **options):
  """`pallas_kernels.dsa_ops(impl).sparse_mla` laid out for the context mesh (if any), batch and
  heads kept on their devices, the key gradients summed over the head shards once per layer:

    "xla"     partitioned by XLA; the backward keeps one key-gradient accumulator per device's
              share of the heads (`head_groups` = the heads' split) and sums them after its
              query-block loop, not per block. Under context parallelism it runs per device
              as the Pallas impls do (`_queries_per_shard`).
    "pallas", "pallas_interpret"  a pallas_call is opaque to the partitioner (it would gather
              the whole batch to every device), so the kernels run per device under
              `mesh_shards.per_shard`.
  `with_probs`: run the op's `sparse_mla_with_probs` instead (a Pallas impl that has one), which
  also returns the head-mean probabilities `[B, L, T]`: each device averages its own heads, and
  the mean over the head shards (equal head counts) is the mean over all heads.
  `options`: the op's own keyword arguments (block sizes).
  """
  ops = pallas_kernels.dsa_ops(impl)
  if _queries_per_shard(impl):  # "xla" too under context parallelism
    return _sparse_mla_per_device(ops.sparse_mla, ops.sparse_mla_with_probs, scale,
                                  with_probs=with_probs, name="sparse_mla_pallas", **options)
  if with_probs:
    raise ValueError(f"model.dsa_impl={impl!r}: the sparse MLA here does not emit the KL target")
  return functools.partial(ops.sparse_mla, scale=scale, head_groups=context_split(HEADS),
                           batch_shards=context_split(BATCH), **options)


def _absorbed_attention(latents: _Latents, visible_BLS, scale):
  """Attention over the shared latent: logits = (q_nope W_kb^T) . c + q_rope . k_rope."""
  q_nope_BLHN, q_rope_BLHR, ckv_BSC, k_rope_BSR, w_kb_CHN, w_vb_CHV = latents
  q_latent_BLHC = jnp.einsum("blhn,chn->blhc", q_nope_BLHN, w_kb_CHN)
  logits_BHLS = (
      jnp.einsum("blhc,bsc->bhls", q_latent_BLHC, ckv_BSC, preferred_element_type=jnp.float32)
      + jnp.einsum("blhr,bsr->bhls", q_rope_BLHR, k_rope_BSR, preferred_element_type=jnp.float32)
  ) * scale
  logits_BHLS = jnp.where(visible_BLS[:, None], logits_BHLS, MASKED_LOGIT)
  probs_BHLS = jax.nn.softmax(logits_BHLS, axis=-1)
  out_latent_BLHC = jnp.einsum("bhls,bsc->blhc", probs_BHLS.astype(ckv_BSC.dtype), ckv_BSC)
  return (jnp.einsum("blhc,chv->blhv", out_latent_BLHC, w_vb_CHV), probs_BHLS.mean(axis=1))
