"""The GLM-5 decoder assembled from config: embedding, decoder layers, final norm, LM head, MTP.

Notation (docs/design.md): B batch, L sequence, D hidden, Y vocab, T top-k, U MTP depths.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from glm5_jax import routing_replay
from glm5_jax.attention import context_parallel
from glm5_jax.attention import decode_rows
from glm5_jax.attention.kinds import KINDS_BY_NAME
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.decoder import DecoderLayer
from glm5_jax.layers.embedding import embed_tokens
from glm5_jax.layers.norms import RMSNorm
from glm5_jax.layer_runs import LayerRun, layer_runs, unrolled_name
from glm5_jax.layers.axes import BATCH, EMBED, LAYERS, LENGTH, VOCAB
from glm5_jax.layers.params import constrain, dtypes, kernels, normal_kernel
from glm5_jax.layers.remat import checkpoint_policy
from glm5_jax.mtp import MTP_DEPTH_OUTPUT, MTPLayer, shift_tokens_left

ACTIVATION_AXES = (BATCH, LENGTH, EMBED)


class GLM5(nn.Module):
  """GLM-5 causal LM. Params: `embed_tokens [Y, D]`, the decoder layers, `norm`,
  `lm_head [D, Y]` (untied), and `mtp` when `num_nextn_predict_layers == 1`.

  The decoder layers run as one `nn.scan` per run of identical layers (`model.scan_layers`,
  `glm5_jax.layer_runs`), params `layers_{first}_{last}` stacked `[layers, ...]`, so the program
  holds one body per run whatever the depth; or, with `scan_layers=False`, one by one, params
  `layers_{i}`. Both compute the same numbers from the same (stacked) weights. Each layer, and
  the MTP layer, runs under `model.remat_policy` (`glm5_jax.layers.remat`).

  Token ids outside `[0, vocab_size)`: `glm5_jax.forward` and `glm5_jax.logits` refuse them on
  concrete inputs. Traced (under jit) they cannot be refused, so they are contained: such an id
  embeds as the zero vector (never another token's row: negative ids do not wrap), and every
  logit row that reads it directly is NaN: the main logits at its position and, for MTP depth d,
  the positions i whose t_i or t_{i+d} it is. Other positions stay finite (later ones attend to
  the zero embedding), so one bad id marks itself instead of turning the whole row to NaN.
  """

  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens_BL, positions_BL=None, segment_ids_BL=None, *,
               mode: Mode = Mode(), mtp=True, cache=None, routing=None, return_routing=False):
    """Args:
      tokens_BL: int token ids.
      positions_BL: int positions; default `0..L-1` per row.
      segment_ids_BL: document ids of packed rows; default one document per row.
      mode: how the attention layers compute (`glm5_jax.attention.mode.Mode`): the expanded
        or absorbed (decode) form, and the DSA stage (default: expanded, sparse).
      mtp: also run the MTP depths (when the model has an MTP layer).
      cache: `Mode(form="decode")` only (and then required): the decode cache tree of
        `glm5_jax.infer.cache.init_cache`, keys as the param layout (`layers_{i}` or
        `layers_{first}_{last}`, the latter stacked `[layers, B, ...]`) plus `mtp`. The L
        tokens are each slot's new ones at absolute `positions_BL` (segment id 1 real, 0
        padding). Decode runs the main model only: MTP depth d at position p needs token
        p + d, which a decode call does not have, so the drafter runs the MTP layer on its own
        (`glm5_jax.infer.step.mtp_step`) and the `mtp` entry passes through unchanged.
      routing: routing replay (`glm5_jax.routing_replay`, not in decode): `{"moe": int32
        [B, L, N_moe, X], "dsa": int32 [B, L, N_dsa, T]}` (either optional), the decoder layers'
        recorded experts / DSA keys, used instead of their own choices (MTP depths choose
        their own).
      return_routing: also return the decoder layers' choices as `out["routing"]`, same format.
    Returns:
      dict with `logits` fp32 `[B, L, Y]`; `mtp_logits` fp32 `[U, B, L, Y]` (depth d
      at position i predicts token i+d+1; absent when MTP is off); `hidden` `[B, L, D]` (after
      the final norm); `aux` = {"layers": {name: aux}, "mtp": [aux per depth]}, one entry per
      unrolled layer (`layers_{i}`) or per scanned run (`layers_{first}_{last}`, every entry
      stacked on a leading layers axis; see `_scanned_run`); `head_kernel` `[D, Y]` and
      `head_inputs` `[B, L, D]` (`mtp_head_inputs` `[U, B, L, D]`), the head's operands in the
      compute dtype, for a loss that fuses the head (under jit the logits nobody reads are
      compiled away). Decode form: also `cache`, the updated tree (same structure, shapes and
      dtypes), and no `mtp_logits`, `head_*`.
    """
    c = self.cfg
    decode = mode.form == "decode"
    if decode != (cache is not None):
      raise ValueError("GLM5: pass cache= exactly with Mode(form='decode') (got form "
                       f"{mode.form!r}, cache {'given' if cache is not None else 'None'})")
    dtype, pdtype = dtypes(c)
    b, l = tokens_BL.shape
    if not decode and context_parallel.context_ways() > 1:
      context_parallel.check_context_parallel(c.attention_pattern, context_parallel.context_ways(),
                                              l, "data.seq_len (tokens_BL.shape[1])",
                                              mode.context_layout)
    if positions_BL is None:  # each slot's sequence index (`Mode.context_layout`)
      positions_BL = context_parallel.query_index(b, l, mode.context_layout)
    if segment_ids_BL is None:
      segment_ids_BL = jnp.ones((b, l), jnp.int32)

    embedding_YD = normal_kernel(self, "embed_tokens", (c.vocab_size, c.hidden_size),
                                 (VOCAB, EMBED), c.initializer_range, pdtype)
    w_head_DY = kernels(self, c.initializer_range, pdtype, dtype)(
        "lm_head", (c.hidden_size, c.vocab_size), (EMBED, VOCAB))
    final_norm = RMSNorm(c.rms_norm_eps, dtype, pdtype, mix=c.head_norm_mix, name="norm")

    # The lookup pinned to the residual stream's sharding (see MTPLayer: left free, its output
    # could take the table's embed sharding and be replicated over the batch).
    embed = lambda tokens_BL: constrain(embed_tokens(embedding_YD, tokens_BL, dtype),
                                        ACTIVATION_AXES)
    lm_head = lambda h_BLD, valid_BL: lm_head_logits(w_head_DY, h_BLD, valid_BL, dtype)

    if routing is not None:
      if decode:
        raise ValueError("GLM5: routing replay is for the training forms, not Mode(form='decode')")
      routing_replay.check_routing(routing, c, (b, l))
    valid_BL = valid_tokens(tokens_BL, c.vocab_size)
    x_BLD = embed(tokens_BL)
    run_layers = self._scanned_run if c.scan_layers else self._unrolled_run
    layer_aux, prev_topk_BLT, used_routing = {}, None, []
    new_cache = dict(cache) if decode else None
    runs = layer_runs(c)
    for run, next_run in zip(runs, runs[1:] + (None,)):
      keep_topk = next_run is not None and KINDS_BY_NAME[next_run.attention_kind].needs_prev_topk
      x_BLD, prev_topk_BLT, aux, run_cache, run_routing = run_layers(
          run, x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT, mode, keep_topk, cache,
          routing_replay.for_layers(routing, c, run.first, run.last), return_routing)
      used_routing.append(run_routing)
      layer_aux.update(aux)
      if decode:
        new_cache.update(run_cache)
    hidden_BLD = final_norm(x_BLD)
    out = {"logits": lm_head(hidden_BLD, valid_BL), "hidden": hidden_BLD,
           "aux": {"layers": layer_aux, "mtp": []}}
    if not decode:  # for a loss that fuses the head (`train.losses.fused_cross_entropy`)
      out["head_kernel"] = w_head_DY
      out["head_inputs"] = head_inputs(hidden_BLD, valid_BL, dtype)
    if return_routing:
      out["routing"] = routing_replay.from_layers(used_routing)
    if decode:
      out["cache"] = new_cache
      return out

    # Initialization runs one depth (the depths share the layer's params), even when the config
    # has zero depths, so the declared MTP layer's params exist (e.g. to load a checkpoint).
    depths = 1 if self.is_initializing() else c.mtp_depths * mtp
    if c.num_nextn_predict_layers and depths:
      mtp_layer = MTPLayer(c, name="mtp")
      h_BLD, mtp_logits, mtp_inputs = hidden_BLD, [], []
      run_mtp = _rematerialized(
          lambda layer, h_BLD, e_BLD: layer(h_BLD, e_BLD, positions_BL, segment_ids_BL,
                                            mode=mode), c.remat_policy, prevent_cse=True,
          also_saved=(MTP_DEPTH_OUTPUT,))
      for depth in range(1, depths + 1):
        next_tokens_BL = context_parallel.along_sequence(
            lambda t_BL: shift_tokens_left(t_BL, depth), tokens_BL, mode.context_layout)
        next_valid_BL = (next_tokens_BL >= 0) & (next_tokens_BL < c.vocab_size)
        h_BLD, normed_BLD, aux = run_mtp(mtp_layer, h_BLD, embed(next_tokens_BL))
        mtp_logits.append(lm_head(normed_BLD, valid_BL & next_valid_BL))
        mtp_inputs.append(head_inputs(normed_BLD, valid_BL & next_valid_BL, dtype))
        out["aux"]["mtp"].append(aux)
      out["mtp_logits"] = jnp.stack(mtp_logits)
      out["mtp_head_inputs"] = jnp.stack(mtp_inputs)
    return out

  def _unrolled_run(self, run: LayerRun, x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT,
                    mode: Mode, keep_topk: bool, cache, routing: dict, return_routing: bool):
    """The run's layers one by one, params `layers_{i}`. Returns `(x_BLD, prev_topk_BLT,
    {"layers_{i}": aux}, {"layers_{i}": updated layer cache}, used routing)` (the cache {}
    outside decode); aux as each layer returns it, without its cache. `routing`: the run's
    replayed routing, `{kind: [layers, B, L, k]}` (`routing_replay.for_layers`); the used
    routing has that format ({} without `return_routing`)."""
    del keep_topk  # every layer's selection is at hand
    step = _rematerialized(_layer_step(positions_BL, segment_ids_BL, mode, return_routing),
                           self.cfg.remat_policy, prevent_cse=True, offload=run.moe)
    layer_aux, new_cache, used = {}, {}, []
    for i in range(run.first, run.last + 1):
      name = unrolled_name(i)
      layer = DecoderLayer(self.cfg, run.attention_kind, run.moe, name=name)
      layer_routing = {kind: r[i - run.first] for kind, r in routing.items()}
      layer_cache = _run_cache(cache, name)
      if decode_rows.has_paged_rows(layer_cache):  # written in its pages (`LayerCache`)
        layer_cache = decode_rows.LayerCache(layer_cache)
      x_BLD, aux = step(layer, x_BLD, prev_topk_BLT, layer_cache, layer_routing)
      prev_topk_BLT = aux.get("topk_indices", prev_topk_BLT)
      if cache is not None:
        layer_cache = aux["cache"]
        new_cache[name] = (layer_cache.arrays if isinstance(layer_cache, decode_rows.LayerCache)
                           else layer_cache)
      layer_aux[name] = {k: v for k, v in aux.items() if k not in ("cache", "routing")}
      used.append(aux.get("routing", {}))
    used = jax.tree.map(lambda *xs: jnp.stack(xs), *used) if return_routing else {}
    return x_BLD, prev_topk_BLT, layer_aux, new_cache, used

  def _scanned_run(self, run: LayerRun, x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT,
                   mode: Mode, keep_topk: bool, cache, routing: dict, return_routing: bool):
    """The run as one `nn.scan` over its stacked layer, params `layers_{first}_{last}` with a
    leading `[layers]` axis. Returns `(x_BLD, prev_topk_BLT, {run.name: aux}, {run.name:
    updated cache}` (the last {} outside decode), each aux entry stacked on a leading
    `[layers]` axis, without `topk_indices` and `index_scores` (`[B, L, T]` / `[B, L, S]` per
    layer: only the last selection is needed, by the next run), and the used routing
    (`_unrolled_run`).

    Decode: the run's cache, stacked `[layers, B, ...]` like its params, rides in the scan's
    carry with the layer index j, so one compiled body serves every layer and, with the cache
    donated to the jitted step (`glm5_jax.infer.step`), the update is in place. A kind with
    `decode_in_stack` (M, D, R, G, S) gets layer j of the stack (`decode_rows.LayerCache`;
    paged arrays stay in their pages, `decode_rows.PagedRows`) and scatters only its new rows
    into it; the others (the recurrent N, L) read slice j and write it back whole. Slicing,
    updating and writing back the whole layer copied every cached row per layer per step (D at
    64K: 30x the 8K step, docs/scaling.md "Long-context decode"). Scanning the cache as the
    scan's input and output instead needs a second copy of the run's cache as scratch
    (tests/test_decode_cache.py, `..._without_copying_the_run`).
    """
    kind = KINDS_BY_NAME[run.attention_kind]
    step = _layer_step(positions_BL, segment_ids_BL, mode, return_routing)

    # The carry holds the incoming selection only for a kind that reuses it (its shape is fixed
    # across the run); a kind that makes its own returns each layer's in `ys`, kept only when
    # the next run reuses the last one.
    # Replayed routing (`{kind: [layers, B, L, k]}`) is the scan's input: layer j gets slice j.
    def body(layer, carry, layer_routing):
      x_BLD, topk_BLT, j, run_cache = carry
      if run_cache is None:
        layer_cache = None
      elif kind.decode_in_stack:
        layer_cache = decode_rows.LayerCache(run_cache, j)
      else:
        layer_cache = jax.tree.map(lambda c: jax.lax.dynamic_index_in_dim(c, j, keepdims=False),
                                   run_cache)
      x_BLD, aux = step(layer, x_BLD, topk_BLT if kind.needs_prev_topk else None, layer_cache,
                        layer_routing)
      if run_cache is not None and kind.decode_in_stack:
        run_cache = aux["cache"].arrays
      elif run_cache is not None:
        run_cache = jax.tree.map(lambda c, u: jax.lax.dynamic_update_index_in_dim(c, u, j, 0),
                                 run_cache, aux["cache"])
      new_topk_BLT = aux.get("topk_indices", topk_BLT) if kind.needs_prev_topk else topk_BLT
      ys = {k: v for k, v in aux.items() if k not in _PER_LAYER_ONLY + ("cache",)}
      if keep_topk and not kind.needs_prev_topk and "topk_indices" in aux:
        ys["topk_indices"] = aux["topk_indices"]
      return (x_BLD, new_topk_BLT, j + 1, run_cache), ys

    scan = nn.scan(_rematerialized(body, self.cfg.remat_policy, prevent_cse=False,
                                   offload=run.moe),
                   variable_axes={"params": 0}, split_rngs={"params": True},
                   length=run.length, metadata_params={nn.PARTITION_NAME: LAYERS})
    layer = DecoderLayer(self.cfg, run.attention_kind, run.moe, name=run.name)
    run_cache = None if cache is None else _run_cache(cache, run.name)
    carry = (x_BLD, prev_topk_BLT if kind.needs_prev_topk else None, jnp.int32(0), run_cache)
    (x_BLD, topk_BLT, _, run_cache), ys = scan(layer, carry, routing)
    if kind.needs_prev_topk:
      prev_topk_BLT = topk_BLT
    elif "topk_indices" in ys:
      prev_topk_BLT = ys.pop("topk_indices")[-1]
    used = ys.pop("routing", {})
    return (x_BLD, prev_topk_BLT, {run.name: ys}, ({} if cache is None else {run.name: run_cache}),
            used)


# Per-layer aux entries a scanned run does not stack (see `GLM5._scanned_run`).
_PER_LAYER_ONLY = ("topk_indices", "index_scores")


def _layer_step(positions_BL, segment_ids_BL, mode: Mode, return_routing: bool = False):
  """`step(layer, x_BLD, prev_topk_BLT, cache, routing) -> (x_BLD, aux)`: one decoder layer, the
  residual stream constrained to its sharding at the layer boundary (cache: decode only, else
  None; routing: the layer's replayed routing dict, `DecoderLayer`)."""

  def step(layer, x_BLD, prev_topk_BLT, cache=None, routing=None):
    x_BLD = constrain(x_BLD, ACTIVATION_AXES)
    return layer(x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT, mode=mode, cache=cache,
                 routing=routing, return_routing=return_routing)

  return step


def _run_cache(cache, name: str):
  """The cache entry of one run / layer (None outside decode), or a ValueError naming it."""
  if cache is None:
    return None
  if name not in cache:
    raise ValueError(f"decode cache has no entry {name!r} (has {sorted(cache)}); build it with "
                     "glm5_jax.infer.cache.init_cache for this config (same scan_layers)")
  return cache[name]


def valid_tokens(tokens_BL, vocab_size: int):
  """Boolean `[B, L]`: ids inside `[0, vocab_size)` (others embed as zeros, NaN their logits)."""
  return (tokens_BL >= 0) & (tokens_BL < vocab_size)


def head_inputs(h_BLD, valid_BL, dtype):
  """The LM head's input: `h_BLD` in `dtype`, rows where `valid_BL` is False NaN (`GLM5`)."""
  # NaN in the [B, L, D] input, not the [B, L, Y] output: the matmul spreads it over the
  # row at no extra cost.
  return jnp.where(valid_BL[..., None], h_BLD.astype(dtype), jnp.nan)


def lm_head_logits(w_head_DY, h_BLD, valid_BL, dtype):
  """fp32 `[B, L, Y]` logits of `h_BLD`; rows where `valid_BL` is False are NaN (`GLM5`)."""
  return jnp.einsum("bld,dy->bly", head_inputs(h_BLD, valid_BL, dtype),
                    w_head_DY.astype(dtype), preferred_element_type=jnp.float32)


def _rematerialized(fn, policy_name: str, *, prevent_cse: bool, also_saved=(),
                    offload: bool = False):
  """`fn(module, *arrays)` under `model.remat_policy` (unchanged for "none"), keeping the
  values named `also_saved` (`jax.ad_checkpoint.checkpoint_name`) under every policy.
  `offload`: an offloading policy sends its names to host memory (`checkpoint_policy`); only the
  runs of MoE layers do (`glm5_jax.layers.remat`, save_selections_offload_attn_out).

  `prevent_cse=False` inside `nn.scan`: the scan already keeps XLA from merging the recomputed
  forward with the original (and the barrier would cost performance there), as `jax.checkpoint`
  documents.
  """
  policy = checkpoint_policy(policy_name, offload=offload)
  if policy is None:
    return fn
  if also_saved:
    # Not `save_from_both_policies`: it takes only boolean policies, and offload_dots answers
    # with an offload decision.
    named, base = jax.checkpoint_policies.save_only_these_names(*also_saved), policy
    policy = lambda prim, *args, **params: (named(prim, *args, **params)
                                            or base(prim, *args, **params))
  return nn.remat(fn, policy=policy, prevent_cse=prevent_cse)
