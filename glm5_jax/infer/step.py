"""The jitted cached steps the inference engine is built on: small, pure, shapes documented.

  decode_step   main model over Q new tokens per slot (prefill chunk, 1 decode token, k + 1
                verification tokens), reading and updating the cache in place
  mtp_step      the shared MTP layer at one depth (drafting, or filling its cache teacher-forced)

Both take and return the whole cache tree (`glm5_jax.infer.cache.init_cache`) and donate it:
the caller must use the returned tree and drop the one it passed. Configs are static (a
`ModelConfig` is hashable): one compile per config, Q and cache shape. Every call is
position-addressed: `positions_BQ` are absolute positions in each slot's sequence and
`segment_ids_BQ` is 1 for a real token, 0 for padding (a slot with fewer new tokens than Q);
padding changes nothing a later real token reads, and its outputs are meaningless.

Notation (docs/design.md): B slots, Q new tokens per slot, D hidden, Y vocab, U MTP depths.
"""

import functools
import typing

import jax
import jax.numpy as jnp

from glm5_jax.attention.decode_rows import LayerCache, PagedRows, has_paged_rows
from glm5_jax.attention.kinds import layer_kind
from glm5_jax.attention.mode import DSA_STAGES, Mode
from glm5_jax.config import ModelConfig, require_model_config
from glm5_jax.infer.cache import MTP_CACHE_SCHEMES, layer_cache_specs
from glm5_jax.layers.params import dtypes
from glm5_jax.layers.embedding import embed_tokens
from glm5_jax.model import GLM5, lm_head_logits, valid_tokens
from glm5_jax.mtp import MTPLayer


class StepOutput(typing.NamedTuple):
  """What a step returns.

  logits_BQY: fp32 `[B, Q, Y]` (main head for `decode_step`; the MTP head for `mtp_step`,
    predicting the token after the input token).
  hidden_BQD: `[B, Q, D]` in `model.dtype`: `decode_step` gives the main model's final hidden
    state after the final norm (h^0, the MTP layer's input at depth 1); `mtp_step` the depth's
    output state h^d (the input of depth d + 1).
  cache: the updated cache tree.
  cache_steps: `decode_step` with Q > 1: for each layer (or scanned run, stacked
    `[layers, ...]`) with a recurrent state (`AttentionKind.decode_steps`), every state entry
    after each of the Q tokens, `[B, Q, ...]`, for `glm5_jax.infer.rollback.rollback_cache`;
    {} otherwise. Unused entries cost nothing: XLA drops what the caller does not return.
  routing: `decode_step(return_routing=True)`: the main model's routing of the Q tokens,
    `{"moe": int32 [B, Q, N_moe, X], "dsa": int32 [B, Q, N_dsa, T]}` (DSA keys are cache rows,
    i.e. positions; `glm5_jax.routing_replay`); {} otherwise.
  """

  logits_BQY: jax.Array
  hidden_BQD: jax.Array
  cache: dict
  cache_steps: dict = {}
  routing: dict = {}


def _check(cfg: ModelConfig, tokens_BQ, positions_BQ, segment_ids_BQ, dsa_stage: str):
  if tokens_BQ.ndim != 2 or positions_BQ.shape != tokens_BQ.shape or (
      segment_ids_BQ.shape != tokens_BQ.shape):
    raise ValueError(f"tokens {tokens_BQ.shape}, positions {positions_BQ.shape} and segment_ids "
                     f"{segment_ids_BQ.shape} must all be [B, Q]")
  if dsa_stage not in DSA_STAGES:
    raise ValueError(f"dsa_stage must be one of {DSA_STAGES}, got {dsa_stage!r}")


@functools.partial(jax.jit, static_argnames=("cfg", "dsa_stage", "return_routing"),
                   donate_argnames=("cache",))
def _decode_step(params, cache, tokens_BQ, positions_BQ, segment_ids_BQ, *, cfg, dsa_stage,
                 return_routing=False):
  out = GLM5(cfg).apply({"params": params}, tokens_BQ, positions_BQ, segment_ids_BQ,
                        mode=Mode(form="decode", dsa_stage=dsa_stage), mtp=False, cache=cache,
                        return_routing=return_routing)
  steps = {name: aux["cache_steps"] for name, aux in out["aux"]["layers"].items()
           if "cache_steps" in aux}
  return StepOutput(out["logits"], out["hidden"], out["cache"], steps, out.get("routing", {}))


def decode_step(config, params, cache, tokens_BQ, positions_BQ, segment_ids_BQ, *,
                dsa_stage: str = "sparse", return_routing: bool = False) -> StepOutput:
  """The main model over each slot's Q new tokens, with the cache (donated).

  Args:
    config: the run's `ModelConfig` (built once by the caller).
    params: the model params (either layout; it must match `model.scan_layers` and the cache).
    cache: the cache tree (`init_cache`); donated: use the returned one.
    tokens_BQ: int32 token ids. positions_BQ: int32 absolute positions (< the cache's
      max_len: a row past it is silently dropped, so the engine must refuse such requests).
    segment_ids_BQ: int32, 1 real token, 0 padding.
    dsa_stage: `Mode.dsa_stage` (inference: "sparse").
    return_routing: also return the routing of the Q tokens (`StepOutput.routing`).
  Returns:
    `StepOutput(logits_BQY fp32, hidden_BQD, cache, cache_steps, routing)`; logits at
    position p predict p + 1.
  """
  cfg = require_model_config(config, "decode_step")
  tokens_BQ, positions_BQ, segment_ids_BQ = (jnp.asarray(x, jnp.int32) for x in
                                             (tokens_BQ, positions_BQ, segment_ids_BQ))
  _check(cfg, tokens_BQ, positions_BQ, segment_ids_BQ, dsa_stage)
  return _decode_step(params, cache, tokens_BQ, positions_BQ, segment_ids_BQ, cfg=cfg,
                      dsa_stage=dsa_stage, return_routing=return_routing)


@functools.partial(jax.jit, static_argnames=("cfg", "dsa_stage", "mtp_cache"),
                   donate_argnames=("cache",))
def _mtp_step(params, cache, h_prev_BQD, tokens_BQ, positions_BQ, segment_ids_BQ, depth, *,
              cfg, dsa_stage, mtp_cache):
  dtype, _ = dtypes(cfg)
  valid_BQ = valid_tokens(tokens_BQ, cfg.vocab_size)
  e_BQD = embed_tokens(params["embed_tokens"], tokens_BQ, dtype)
  layer_cache = cache["mtp"]
  # "per_depth": the depth's cache is layer depth - 1 of a stack; a kind that writes only its
  # new rows writes them there in place (as a scanned run does, `GLM5._scanned_run`).
  in_stack = layer_kind(cfg.attention_pattern, cfg.num_hidden_layers).decode_in_stack
  if mtp_cache == "per_depth" and in_stack:
    layer_cache = LayerCache(layer_cache, depth - 1)
  elif mtp_cache == "per_depth":
    layer_cache = jax.tree.map(lambda x: x[depth - 1], layer_cache)
  elif has_paged_rows(layer_cache):
    layer_cache = LayerCache(layer_cache)
  h_BQD, normed_BQD, aux = MTPLayer(cfg).apply(
      {"params": params["mtp"]}, h_prev_BQD, e_BQD, positions_BQ, segment_ids_BQ,
      mode=Mode(form="decode", dsa_stage=dsa_stage), cache=layer_cache)
  new_mtp = aux["cache"]
  if isinstance(new_mtp, LayerCache):
    new_mtp = new_mtp.arrays
  elif mtp_cache == "per_depth":
    new_mtp = jax.tree.map(lambda all_, one: all_.at[depth - 1].set(one), cache["mtp"], new_mtp)
  logits_BQY = lm_head_logits(params["lm_head"], normed_BQD, valid_BQ, dtype)
  return StepOutput(logits_BQY, h_BQD, {**cache, "mtp": new_mtp})


def mtp_step(config, params, cache, h_prev_BQD, tokens_BQ, positions_BQ, segment_ids_BQ, depth,
             *, mtp_cache: str = "per_depth", dsa_stage: str = "sparse") -> StepOutput:
  """The shared MTP layer at depth `depth` (1-based) for Q positions per slot (donated cache).

  Depth d at position p computes `h^d_p = layer(eh_proj([enorm(emb(t_{p+d})) ;
  hnorm(h^{d-1}_p)]))` and its logits predict t_{p+d+1} (`glm5_jax.mtp`).

  Args:
    h_prev_BQD: h^{d-1} at those positions: `decode_step`'s `hidden_BQD` for d = 1, the
      previous depth's `mtp_step` `hidden_BQD` after.
    tokens_BQ: t_{p+d}, the token d places after each position (the sampled / drafted one).
    positions_BQ: the positions p ("per_depth": the same p at every depth, as trained;
      "shared": the caller advances them, p + d - 1; see `glm5_jax.infer.cache`).
    segment_ids_BQ: 1 real, 0 padding.
    depth: int (traced is fine: one compile serves every depth) in 1..U; selects the cache
      under "per_depth", ignored under "shared".
    mtp_cache: the scheme the cache was built with (`init_cache(mtp_cache=...)`).
  Returns:
    `StepOutput(logits_BQY fp32, h^d [B, Q, D], cache)`.
  """
  cfg = require_model_config(config, "mtp_step")
  if mtp_cache not in MTP_CACHE_SCHEMES:
    raise ValueError(f"mtp_cache must be one of {MTP_CACHE_SCHEMES}, got {mtp_cache!r}")
  if "mtp" not in cache:
    raise ValueError("mtp_step: the cache has no 'mtp' entry (the model has no MTP layer, or "
                     "init_cache got mtp_depths=0)")
  ranks = {name: len(spec.shape) + (mtp_cache == "per_depth") for name, spec in
           layer_cache_specs(cfg, cfg.num_hidden_layers, 1, 1).items()}
  got = {name: jnp.ndim(x.pool if isinstance(x, PagedRows) else x)  # pages: [.., NP, PG, ..]
         for name, x in cache["mtp"].items()}
  if got != ranks:
    raise ValueError(f"mtp_step: mtp_cache={mtp_cache!r} expects MTP cache ranks {ranks}, got "
                     f"{got}; pass the scheme init_cache was built with")
  tokens_BQ, positions_BQ, segment_ids_BQ = (jnp.asarray(x, jnp.int32) for x in
                                             (tokens_BQ, positions_BQ, segment_ids_BQ))
  _check(cfg, tokens_BQ, positions_BQ, segment_ids_BQ, dsa_stage)
  if h_prev_BQD.shape != tokens_BQ.shape + (cfg.hidden_size,):
    raise ValueError(f"h_prev_BQD {h_prev_BQD.shape} must be [B, Q, D] = "
                     f"{tokens_BQ.shape + (cfg.hidden_size,)}")
  if mtp_cache == "per_depth" and isinstance(depth, int):
    depths = jax.tree.leaves(cache["mtp"])[0].shape[0]
    if not 1 <= depth <= depths:
      raise ValueError(f"depth must be in 1..{depths} (the cache's MTP depths), got {depth}")
  return _mtp_step(params, cache, h_prev_BQD, tokens_BQ, positions_BQ, segment_ids_BQ,
                   jnp.asarray(depth, jnp.int32), cfg=cfg, dsa_stage=dsa_stage,
                   mtp_cache=mtp_cache)
