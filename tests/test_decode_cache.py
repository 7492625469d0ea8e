"""Cached decoding of the MLA family (M, D, R) and the MTP layer's caches (`glm5_jax.infer`).

The exactness target (issue 11): teacher-forced decode through the cache gives the logits of
the full forward over the whole sequence to 1e-5 relative in fp32, with sequences longer than
`index_topk`, so DSA's top-k really selects. The schedules below mix what an engine does:
variable-length prompts prefilled in padded chunks, a slot idle for a call, k + 1-token
verification calls, a rejected draft whose rows stay behind in the cache, single-token steps.
"""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import glm5_jax
from glm5_jax.config import ModelConfig, model_config
from glm5_jax.infer import cache as cache_lib
from glm5_jax.infer import paged, step
from glm5_jax.mtp import shift_tokens_left
from glm5_jax.sharding import default_logical_axis_rules, make_mesh, mesh_config

L, MAX_LEN = 12, 16
# D (dense FFN) | D (MoE) | R (reuses layer 1's top-k) | M; index_topk 4 < L.
PATTERN = dict(num_hidden_layers=4, attention_pattern="DDRM", first_k_dense_replace=1,
               index_topk=4, mtp_depths=2)
# Per call: (Q, [(start, count, draft) per slot]). Slot 0 has a 6-token prompt, slot 1 a
# 3-token one. Slot 1 verifies a wrong 4-token draft at 3..6, accepts 2 (3..4 re-fed with the
# true tokens while rows 5..6 still hold the draft), then goes on.
SCHEDULE = [
    (4, [(0, 4, False), (0, 3, False)]),
    (4, [(4, 2, False), (3, 4, True)]),
    (4, [(6, 4, False), (3, 2, False)]),
    (4, [(10, 0, False), (5, 4, False)]),
    (1, [(10, 1, False), (9, 1, False)]),
    (1, [(11, 1, False), (10, 1, False)]),
    (1, [(11, 0, False), (11, 1, False)]),
]


def rel_err(got, ref):
  return float(np.abs(np.asarray(got) - np.asarray(ref)).max() / np.abs(np.asarray(ref)).max())


def tokens_for(cfg, b=2, seed=0):
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, (b, L)).astype(np.int32)


def run_schedule(cfg, params, tokens_BL, schedule, cache, decode_step=step.decode_step):
  """Feeds `schedule` through `decode_step`; returns the logits `[B, L, Y]` of every position
  from its last non-draft call, and the final cache. Padding gets random tokens at position 0
  (its row write must be dropped, or row 0 would change)."""
  b = tokens_BL.shape[0]
  rng = np.random.default_rng(1)
  got = np.full((b, L, cfg.vocab_size), np.nan, np.float32)
  for q, slots in schedule:
    toks = rng.integers(0, cfg.vocab_size, (b, q)).astype(np.int32)
    pos = np.zeros((b, q), np.int32)
    seg = np.zeros((b, q), np.int32)
    for i, (start, n, draft) in enumerate(slots):
      if not draft:
        toks[i, :n] = tokens_BL[i, start:start + n]
      pos[i, :n] = np.arange(start, start + n)
      seg[i, :n] = 1
    out = decode_step(cfg, params, cache, toks, pos, seg)
    cache = out.cache
    logits = np.asarray(out.logits_BQY)
    for i, (start, n, draft) in enumerate(slots):
      if not draft:
        got[i, start:start + n] = logits[i, :n]
  return got, cache


@pytest.mark.parametrize("impl,scan", [("xla", True), ("pallas_interpret", False),
                                       ("dense_mask", True)])
def test_decode_equals_full_forward(helpers, impl, scan):
  """Chunked prefill with padding, verification calls, a rejected draft, single steps: every
  position's logits equal `glm5_jax.logits` over the whole sequence."""
  cfg = helpers.config(dsa_impl=impl, scan_layers=scan, **PATTERN)
  params = helpers.random_params(cfg)
  tokens = tokens_for(cfg)
  ref = np.asarray(glm5_jax.logits(cfg, params, tokens))
  cache = cache_lib.init_cache(cfg, 2, MAX_LEN)
  got, cache = run_schedule(cfg, params, tokens, SCHEDULE, cache)
  assert rel_err(got, ref) < 1e-5
  # The cache tree keeps its structure, shapes and dtypes (what donation and the engine need).
  fresh = cache_lib.init_cache(cfg, 2, MAX_LEN)
  assert jax.tree.structure(cache) == jax.tree.structure(fresh)
  for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(fresh)):
    assert (a.shape, a.dtype) == (b.shape, b.dtype)


def test_paged_decode_reads_the_pages_in_place(helpers):
  """The paged cache read where it lies (`paged.read_in_place`, unrolled layers: each layer's
  dict in a `LayerCache`): pages of 4 rows in shuffled pool order, the schedule's logits equal
  the full forward's, and page 0 (never handed out) stays empty."""
  cfg = helpers.config(dsa_impl="xla", scan_layers=False, **PATTERN)
  params = helpers.random_params(cfg)
  tokens = tokens_for(cfg)
  specs = cache_lib.cache_specs(cfg, 2, MAX_LEN)
  layout = paged.page_layout(specs)
  page_size, pages_per_slot = 4, MAX_LEN // 4
  pool = cache_lib.allocate(paged.paged_specs(specs, page_size, 2 * pages_per_slot + 1))
  table = 1 + np.random.default_rng(2).permutation(2 * pages_per_slot).astype(np.int32)
  table = table.reshape(2, pages_per_slot)

  @jax.jit
  def paged_step(params, pool, toks, pos, seg):
    out = step.decode_step(cfg, params, paged.read_in_place(pool, table, *layout), toks, pos,
                           seg)
    return out._replace(cache=paged.pools(out.cache))

  got, pool = run_schedule(cfg, params, tokens, SCHEDULE, pool,
                           lambda cfg, params, pool, *batch: paged_step(params, pool, *batch))
  assert rel_err(got, np.asarray(glm5_jax.logits(cfg, params, tokens))) < 1e-5
  for leaf, is_pool, axis in zip(jax.tree.leaves(pool), *layout):
    if is_pool:
      assert not np.asarray(jax.lax.index_in_dim(leaf, 0, axis, keepdims=False)).any()


def test_top_k_is_active(helpers):
  """The selections decode makes are really sparse: queries past index_topk see exactly
  index_topk rows, none after their own position; R layers reuse the D layer's."""
  cfg = helpers.config(dsa_impl="xla", scan_layers=False, **PATTERN)
  params = helpers.random_params(cfg)
  tokens = tokens_for(cfg)
  cache = cache_lib.init_cache(cfg, 2, MAX_LEN)
  pos = np.broadcast_to(np.arange(L, dtype=np.int32), (2, L))
  layer_aux = jax.jit(lambda params, cache: glm5_jax.forward(
      cfg, params, tokens, pos, np.ones_like(pos), mode=glm5_jax.Mode(form="decode"),
      cache=cache)["aux"]["layers"])(params, cache)
  topk = {name: np.asarray(aux["topk_indices"]) for name, aux in layer_aux.items()
          if "topk_indices" in aux}
  assert set(topk) == {"layers_0", "layers_1", "layers_2"}
  np.testing.assert_array_equal(topk["layers_2"], topk["layers_1"])
  valid = topk["layers_0"] >= 0
  assert (valid.sum(-1) == np.minimum(np.arange(L) + 1, cfg.index_topk)).all()
  assert (np.where(valid, topk["layers_0"], -1) <= np.arange(L)[None, :, None]).all()


def test_mtp_per_depth_cache_is_exact(helpers):
  """Teacher-forced MTP through per-depth caches: every depth's logits equal the full
  forward's `mtp_logits` (the MTP layer after an R layer is a D layer: top-k active)."""
  cfg = helpers.config(num_hidden_layers=3, attention_pattern="DDR", first_k_dense_replace=3,
                       index_topk=4, mtp_depths=2, dsa_impl="xla")
  params = helpers.random_params(cfg)
  tokens = tokens_for(cfg)
  ref = helpers.forward(cfg, params, tokens)
  cache = cache_lib.init_cache(cfg, 2, MAX_LEN, mtp_cache="per_depth")
  assert jax.tree.leaves(cache["mtp"])[0].shape[0] == cfg.mtp_depths
  chunks = [(0, 4), (4, 8), (8, 12)]
  seg = np.ones((2, 4), np.int32)
  hidden = []
  for a, b in chunks:
    pos = np.broadcast_to(np.arange(a, b, dtype=np.int32), (2, 4))
    out = step.decode_step(cfg, params, cache, tokens[:, a:b], pos, seg)
    cache = out.cache
    hidden.append(out.hidden_BQD)
  h = np.concatenate(hidden, 1)
  assert rel_err(h, ref["hidden"]) < 1e-5
  for depth in range(1, cfg.mtp_depths + 1):
    next_tokens = np.asarray(shift_tokens_left(tokens, depth))
    logits, states = [], []
    for a, b in chunks:
      pos = np.broadcast_to(np.arange(a, b, dtype=np.int32), (2, 4))
      out = step.mtp_step(cfg, params, cache, h[:, a:b], next_tokens[:, a:b], pos, seg, depth)
      cache = out.cache
      logits.append(out.logits_BQY)
      states.append(out.hidden_BQD)
    assert rel_err(np.concatenate(logits, 1), ref["mtp_logits"][depth - 1]) < 1e-5, depth
    h = np.concatenate(states, 1)


def test_mtp_shared_cache_runs(helpers):
  """The "shared" scheme: one MTP cache without a depth axis; drafting with advancing
  positions updates it in place and keeps the tree's shapes."""
  cfg = helpers.config(num_hidden_layers=3, attention_pattern="DDR", first_k_dense_replace=3,
                       index_topk=4, mtp_depths=2, dsa_impl="xla")
  params = helpers.random_params(cfg)
  cache = cache_lib.init_cache(cfg, 2, MAX_LEN, mtp_cache="shared")
  shapes = jax.tree.map(lambda x: x.shape, cache)
  assert shapes["mtp"]["ckv"] == (2, MAX_LEN, cfg.kv_lora_rank)
  h = np.zeros((2, 1, cfg.hidden_size), np.float32)
  for depth in (1, 2):
    pos = np.full((2, 1), 3 + depth - 1, np.int32)
    out = step.mtp_step(cfg, params, cache, h, np.ones((2, 1), np.int32), pos,
                        np.ones((2, 1), np.int32), depth, mtp_cache="shared")
    cache, h = out.cache, out.hidden_BQD
    assert np.isfinite(np.asarray(out.logits_BQY)).all()
  assert jax.tree.map(lambda x: x.shape, cache) == shapes
  assert np.abs(np.asarray(cache["mtp"]["ckv"][:, 3:5])).min() > 0  # rows 3, 4 written
  assert not np.asarray(cache["mtp"]["ckv"][:, 5:]).any()
  with pytest.raises(ValueError, match="mtp_cache"):
    step.mtp_step(cfg, params, cache, h, np.ones((2, 1), np.int32), pos,
                  np.ones((2, 1), np.int32), 1, mtp_cache="per_depth")


def test_glm5_cache_bytes_per_token():
  """GLM-5's MLA layers cache C + R = 576 numbers per token (never expanded K / V), a DSA
  layer 128 more indexer-key numbers; read from the specs, nothing allocated."""
  cfg = ModelConfig.from_config(model_config())
  specs = cache_lib.layer_cache_specs(cfg, 0, slots=1, max_len=1)
  assert {k: s.shape[-1] for k, s in specs.items()} == {"ckv": 512, "k_rope": 64,
                                                        "index_k": 128}
  per_token = cache_lib.cache_numbers_per_token(cfg)
  assert set(per_token.values()) == {576 + 128} and len(per_token) == 79
  mla = ModelConfig.from_config(model_config(attention_pattern="M"))
  assert set(cache_lib.cache_numbers_per_token(mla).values()) == {576}
  # The registry's size model agrees with the specs.
  kind = glm5_jax.attention.kinds.ATTENTION_KINDS["D"]
  assert sum(kind.cache_numbers_per_token(cfg).values()) == 576 + 128
  # bf16 by default: 2 bytes a number; 78 layers + MTP (3 depths) at 1 slot x 1024 rows.
  specs = cache_lib.cache_specs(cfg, 1, 1024)
  assert cache_lib.cache_bytes(specs) == 2 * 1024 * 704 * (78 + 3)


def test_cache_tree_layout_and_shardings(helpers):
  """Keys mirror the param layout (scanned runs stacked `[layers, B, ...]`), and the
  shardings put slots on the batch rule's mesh axes."""
  cfg = helpers.config(**PATTERN)
  specs = cache_lib.cache_specs(cfg, 2, MAX_LEN)
  assert set(specs) == {"layers_0_0", "layers_1_1", "layers_2_2", "layers_3_3", "mtp"}
  unrolled = dataclasses.replace(cfg, scan_layers=False)
  assert set(cache_lib.cache_specs(unrolled, 2, MAX_LEN)) == {
      "layers_0", "layers_1", "layers_2", "layers_3", "mtp"}
  params = helpers.random_params(cfg)
  assert {k for k in params if k.startswith("layers_")} == set(specs) - {"mtp"}
  assert specs["layers_1_1"]["index_k"].shape == (1, 2, MAX_LEN, cfg.index_head_dim)
  rules = default_logical_axis_rules()
  shardings = cache_lib.cache_shardings(specs, make_mesh(mesh_config()), rules)
  batch = ("data", "fsdp", "expert")
  assert shardings["layers_0_0"]["ckv"].spec == PartitionSpec(None, batch, None, None)
  assert shardings["mtp"]["ckv"].spec == PartitionSpec(None, batch, None, None)
  cache = cache_lib.init_cache(cfg, 2, MAX_LEN, mesh=make_mesh(mesh_config()), rules=rules)
  assert cache["layers_3_3"]["k_rope"].sharding.spec == PartitionSpec(None, batch, None, None)


@pytest.mark.parametrize("kwargs,match", [
    (dict(slots=0), "slots"), (dict(max_len=-1), "max_len"), (dict(max_verify=0), "max_verify"),
    (dict(max_verify=32), "max_verify"), (dict(mtp_cache="per_layer"), "mtp_cache"),
    (dict(mtp_depths=-1), "mtp_depths")])
def test_cache_bad_arguments(helpers, kwargs, match):
  args = dict(slots=2, max_len=MAX_LEN) | kwargs
  with pytest.raises(ValueError, match=match):
    cache_lib.init_cache(helpers.config(**PATTERN), **args)


def test_decode_needs_a_cache(helpers):
  cfg = helpers.config(**PATTERN)
  params = helpers.random_params(cfg)
  tokens = tokens_for(cfg)[:, :2]
  with pytest.raises(ValueError, match="cache"):
    glm5_jax.forward(cfg, params, tokens, mode=glm5_jax.Mode(form="decode"))
  with pytest.raises(ValueError, match="cache"):
    glm5_jax.forward(cfg, params, tokens, cache=cache_lib.init_cache(cfg, 2, MAX_LEN))


# The schedule without the rejected draft: a recurrent state (N, L) would keep it, and the
# model-level cache tree is not rolled back here (`glm5_jax.infer.rollback` is per layer).
SCHEDULE_NO_DRAFT = [(q, [(s, n, False) for s, n, _ in slots]) for q, slots in SCHEDULE]
SCHEDULE_NO_DRAFT[1] = (4, [(4, 2, False), (3, 4, False)])
SCHEDULE_NO_DRAFT[2] = (4, [(6, 4, False), (7, 2, False)])
SCHEDULE_NO_DRAFT[3] = (4, [(10, 0, False), (9, 0, False)])  # both idle for a call


@pytest.mark.parametrize("pattern", ["GG", "MS", "NM", "LD"])
def test_every_kind_decodes_like_the_full_forward_in_the_model(helpers, pattern):
  """Each of G, S (window 3 < L: the ring wraps), N and L, in a whole model (scanned, MoE
  second layer, MTP): cached decode equals the full forward."""
  cfg = helpers.config(num_hidden_layers=2, attention_pattern=pattern, first_k_dense_replace=1,
                       index_topk=4, sliding_window=3, dsa_impl="xla")
  params = helpers.random_params(cfg)
  tokens = tokens_for(cfg)
  ref = np.asarray(glm5_jax.logits(cfg, params, tokens))
  schedule = SCHEDULE if pattern in ("GG", "MS") else SCHEDULE_NO_DRAFT
  got, _ = run_schedule(cfg, params, tokens, schedule, cache_lib.init_cache(cfg, 2, MAX_LEN,
                                                                             max_verify=4))
  assert rel_err(got, ref) < 1e-5


def test_scanned_decode_updates_the_cache_without_copying_the_run():
  """A scanned run threads its stacked cache through the scan carry, so a donated cache is
  updated in place: the step's scratch memory holds at most one layer's slice, never a second
  copy of the run's cache (scanning the cache as xs/ys needed one: 44.8 MiB of scratch against
  11.8 MiB here, for a 77 MiB cache at max_len 8192)."""
  from glm5_jax.api import abstract_params
  from glm5_jax.infer import penalties, programs, sampling
  cfg = ModelConfig.from_config(model_config(
      vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
      num_attention_heads=2, q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=8,
      qk_rope_head_dim=8, v_head_dim=8, index_topk=4, index_n_heads=2, index_head_dim=8,
      n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
      first_k_dense_replace=1, attention_pattern="D", mtp_depths=0,
      num_nextn_predict_layers=0, scan_layers=True, dtype="float32", cache_dtype="float32"))
  slots, max_len = 2, 4096
  cache = jax.eval_shape(lambda: cache_lib.init_cache(cfg, slots, max_len))
  run = cache["layers_1_4"]  # the MoE layers; layer 0 (dense FFN) is a run of its own
  run_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(run))
  layers = jax.tree.leaves(run)[0].shape[0]
  zeros = np.zeros(slots, np.int32)
  compiled = programs.decode_and_sample.lower(
      cfg, abstract_params(cfg), cache, np.zeros((slots, cfg.vocab_size), np.int32), zeros,
      zeros, np.ones(slots, bool), sampling.SamplingParams.create(slots),
      zeros.astype(np.uint32), penalties.host_penalties([None] * slots), zeros,
      return_logits=False).compile()
  scratch = compiled.memory_analysis().temp_size_in_bytes
  assert layers == 4
  assert scratch < 1.5 * run_bytes / layers, (scratch, run_bytes)
