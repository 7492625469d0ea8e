"""Cached decoding (`Mode(form="decode")`) of the kinds G (GQA), S (SWA ring), N (GDN) and
L (SimpleGDN), at module level, against the module's full-sequence "expanded" call.

For each kind: (a) a prefix prefilled in one call, then token by token, in chunks (longer than
the S ring too) and in k + 1-token calls, equals the full call to 1e-5 relative (fp32);
(b) slots of different lengths with padding (at the end and in the middle), an idle slot, and
caches left over from an earlier request; (c) S beyond its window, the ring wrapping several
times; (d) speculative rollback: k + 1 tokens fed, the cache rolled back to j kept (0..k + 1
per slot), decoding continued: equal to feeding only the kept tokens. And the sizes of
`AttentionKind.decode_cache` agree with the kind's older per-token / per-sequence size facts.

Notation: B slots, L tokens of a call (or the full length), D hidden.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.attention.kinds import (ATTENTION_KINDS, CACHE_BYTES_PER_NUMBER,
                                      STATE_BYTES_PER_NUMBER, swa_ring_rows)
from glm5_jax.attention.mode import Mode
from glm5_jax.attention.modules import build_attention
from glm5_jax.infer.rollback import rollback
from glm5_jax.layers import axes

LETTERS = "GSNL"
WINDOW, MAX_VERIFY, MAX_LEN, LENGTH = 6, 3, 16, 14  # ring: 6 + 3 - 1 = 8 rows, wraps
SLOTS = 4  # every call has this many slots: one compilation per call length
TOLERANCE = 1e-5


def kind_config(helpers, letter, **overrides):
  """configs/tiny.py with one layer of `letter`, a short window and chunk (crossed by LENGTH)."""
  return helpers.config(**{**dict(
      attention_pattern=letter, num_hidden_layers=1, first_k_dense_replace=1, mtp_depths=1,
      gdn_chunk_size=4, sliding_window=WINDOW, simple_gdn_gates="learned", scan_layers=False),
      **overrides})


class Harness:
  """One kind's module, random params (fp32), its expanded reference and a jitted decode call."""

  def __init__(self, helpers, letter):
    self.kind = ATTENTION_KINDS[letter]
    self.cfg = kind_config(helpers, letter)
    self.module = build_attention(self.kind.name, self.cfg, "self_attn")
    self.d = self.cfg.hidden_size
    x, pos, seg = self.inputs(np.zeros((SLOTS, LENGTH, self.d)))
    abstract = jax.eval_shape(self.module.init, jax.random.key(0), x, pos, seg)
    self.params = helpers.random_tree(abstract, seed=1, std=0.2)
    self.expanded = jax.jit(lambda p, x, pos, seg: self.module.apply(p, x, pos, seg)[0])
    self.apply_decode = jax.jit(lambda p, x, pos, seg, cache: self.module.apply(
        p, x, pos, seg, None, mode=Mode(form="decode"), cache=cache))

  @staticmethod
  def inputs(x_BLD):
    b, l = x_BLD.shape[:2]
    return (jnp.asarray(x_BLD, jnp.float32),
            jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l)), jnp.ones((b, l), jnp.int32))

  def reference(self, x_BLD):
    return np.asarray(self.expanded(self.params, *self.inputs(x_BLD)))

  def empty_cache(self, slots):
    specs = self.kind.decode_cache(self.cfg, slots, MAX_LEN, MAX_VERIFY)
    return {k: jnp.full(s.shape, s.fill, s.dtype) for k, s in specs.items()}

  def call(self, cache, x_BLD, positions_BL, real_BL):
    """One decode call; returns `(y_BLD, aux)`."""
    return self.apply_decode(self.params, jnp.asarray(x_BLD, jnp.float32),
                             jnp.asarray(positions_BL, jnp.int32),
                             jnp.asarray(real_BL, jnp.int32), cache)


@pytest.fixture(name="harness", scope="module")
def harness_fixture(helpers):
  """letter -> its `Harness`, built once per test module."""
  built = {}

  def get(letter):
    if letter not in built:
      built[letter] = Harness(helpers, letter)
    return built[letter]

  return get


def relative_error(got, want):
  return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))


def run_plan(h, cache, x_BLD, plan, drafts=None):
  """Feeds `plan`: a list of calls, each a list (one per slot) of positions or None (padding),
  all of one length. Slot b's token at position p is `x_BLD[b, p]`, or `drafts[(b, p)]` where
  given. Returns `(outputs {(b, p): y_D}, final cache)`."""
  rng = np.random.default_rng(7)
  drafts = drafts or {}
  outputs = {}
  for call in plan:
    l = len(call[0])
    x = rng.standard_normal((len(call), l, h.d))  # padding carries noise
    pos = np.zeros((len(call), l), np.int32)
    real = np.zeros((len(call), l), bool)
    for b, slot in enumerate(call):
      for i, p in enumerate(slot):
        if p is not None:
          x[b, i] = drafts.get((b, p), x_BLD[b, p])
          pos[b, i], real[b, i] = p, True
    y, aux = h.call(cache, x, pos, real)
    cache = aux["cache"]
    for b, slot in enumerate(call):
      for i, p in enumerate(slot):
        if p is not None:
          outputs[(b, p)] = np.asarray(y[b, i])
  return outputs, cache


def assert_matches(outputs, reference, what):
  got = np.stack([outputs[key] for key in sorted(outputs)])
  want = np.stack([reference[key] for key in sorted(outputs)])
  err = relative_error(got, want)
  assert err < TOLERANCE, f"{what}: relative error {err:.2e}"


def schedule(sizes, slots=SLOTS):
  """Consecutive calls of `sizes` tokens, the same positions in every slot."""
  starts = np.cumsum([0] + list(sizes))
  return [[list(range(s, s + n))] * slots for s, n in zip(starts[:-1], sizes)]


@pytest.mark.parametrize("letter", LETTERS)
def test_decode_equals_full_sequence(harness, letter):
  """(a, c) Prefill 5 then one token at a time; chunks of 5, 1, 3, 5 (S: longer than
  max_verify, the ring wraps); k + 1 = 3 tokens a call."""
  h = harness(letter)
  x = np.random.default_rng(1).standard_normal((SLOTS, LENGTH, h.d))
  ref = h.reference(x)
  reference = {(b, p): ref[b, p] for b in range(SLOTS) for p in range(LENGTH)}
  for sizes in ([5] + [1] * 9, [5, 1, 3, 5], [5, 3, 3, 3]):
    outputs, cache = run_plan(h, h.empty_cache(SLOTS), x, schedule(sizes))
    assert len(outputs) == SLOTS * LENGTH
    assert_matches(outputs, reference, f"{h.kind.letter} calls of {sizes}")
    specs = h.kind.decode_cache(h.cfg, SLOTS, MAX_LEN, MAX_VERIFY)
    for key, spec in specs.items():
      assert cache[key].shape == spec.shape and cache[key].dtype == jnp.dtype(spec.dtype), key


@pytest.mark.parametrize("letter", LETTERS)
def test_slots_of_different_lengths_with_padding(harness, letter):
  """(b) Calls of 3 tokens: different lengths per slot and per call, padding at the end and in
  the middle of a call, a slot idle for a whole call (its cache untouched) and one idle
  throughout, and every slot starting at position 0 over the cache of an earlier, longer
  request."""
  h = harness(letter)
  x = np.random.default_rng(2).standard_normal((SLOTS, LENGTH, h.d))
  ref = h.reference(x)
  _, stale = run_plan(h, h.empty_cache(SLOTS),
                      np.random.default_rng(3).standard_normal((SLOTS, LENGTH, h.d)),
                      schedule([5, 3, 3, 3]))
  idle = [None, None, None]
  plan = [
      [[0, 1, 2], [0, 1, None], [0, None, None], idle],
      [[3, 4, 5], [2, None, 3], [1, 2, 3], idle],
      [[6, 7, 8], idle, [4, 5, 6], idle],
      [[9, None, None], [4, 5, 6], [None, 7, 8], idle],
      [[10, 11, 12], [7, 8, None], [9, 10, None], idle],
  ]
  outputs, _ = run_plan(h, stale, x, plan)
  assert_matches(outputs, {k: ref[k] for k in outputs}, f"{h.kind.letter} padded slots")

  _, cache = run_plan(h, stale, x, plan[:2])
  _, after = run_plan(h, cache, x, plan[2:3])  # slot 1 idle
  for key in cache:
    np.testing.assert_array_equal(after[key][1], cache[key][1], err_msg=key)
    np.testing.assert_array_equal(after[key][3], stale[key][3], err_msg=key)


@pytest.mark.parametrize("letter", LETTERS)
def test_rollback_equals_feeding_only_the_kept_tokens(harness, letter):
  """(d) The slots prefill 5 tokens, then verify positions 5..7 (the true token and two
  drafts). Slot b keeps b tokens (0: nothing, 1: both drafts wrong, 2: one accepted, 3: all);
  rejected drafts are other inputs. After `rollback`, each slot continues from position 5 + b
  with the true tokens: every kept and later output equals the full call."""
  h = harness(letter)
  slots = SLOTS
  x = np.random.default_rng(4).standard_normal((slots, LENGTH, h.d))
  ref = h.reference(x)
  noise = np.random.default_rng(5).standard_normal((slots, 3, h.d))
  drafts = {(b, p): noise[b, p - 5] for b in range(slots) for p in (5, 6, 7) if p - 5 >= b}
  _, before = run_plan(h, h.empty_cache(slots), x, [[list(range(5))] * slots])
  verify = [[[5, 6, 7]] * slots]
  outputs, after = run_plan(h, before, x, verify, drafts)
  kept = np.arange(slots)
  # The aux of the same call, for its cache_steps.
  xv = np.stack([[drafts.get((b, p), x[b, p]) for p in (5, 6, 7)] for b in range(slots)])
  _, aux = h.call(before, xv, np.tile([5, 6, 7], (slots, 1)), np.ones((slots, 3), bool))
  if h.kind.decode_steps:
    assert set(aux["cache_steps"]) == set(aux["cache"])
    for key in aux["cache"]:  # the last step is the cache
      np.testing.assert_array_equal(aux["cache_steps"][key][:, -1], aux["cache"][key])
  else:
    assert "cache_steps" not in aux
  cache = rollback(h.kind.letter, before, after, aux.get("cache_steps"), kept)
  kept_outputs = {(b, p): outputs[(b, p)] for b in range(slots) for p in range(5, 5 + b)}
  rest = [[list(range(5 + b + 3 * i, 5 + b + 3 * i + 3)) for b in range(slots)]
          for i in range(2)]
  later, _ = run_plan(h, cache, x, rest)
  got = {**kept_outputs, **later}
  assert_matches(got, {k: ref[k] for k in got}, f"{h.kind.letter} rollback")


def test_rollback_of_a_one_token_call(harness):
  """Without cache_steps (one token fed): kept 0 gives the cache before, 1 the cache after."""
  h = harness("N")
  before = {k: v + 1 for k, v in h.empty_cache(SLOTS).items()}
  _, aux = h.call(before, np.ones((SLOTS, 1, h.d)), np.full((SLOTS, 1), 3),
                  np.ones((SLOTS, 1), bool))
  assert "cache_steps" not in aux
  kept = np.array([0, 1, 1, 0])
  cache = rollback("gdn", before, aux["cache"], None, kept)
  for key in cache:
    for b in range(SLOTS):
      np.testing.assert_array_equal(cache[key][b], (aux["cache"] if kept[b] else before)[key][b])
  with pytest.raises(ValueError, match="unknown attention kind"):
    rollback("Q", before, aux["cache"], None, kept)


def test_decode_needs_a_cache_and_only_in_decode(harness):
  h = harness("G")
  x, pos, seg = h.inputs(np.zeros((1, 2, h.d)))
  with pytest.raises(ValueError, match="needs `cache=`"):
    h.module.apply(h.params, x, pos, seg, mode=Mode(form="decode"))
  with pytest.raises(ValueError, match="only read in Mode"):
    h.module.apply(h.params, x, pos, seg, cache=h.empty_cache(1))
  with pytest.raises(ValueError, match="expected"):
    h.module.apply(h.params, x, pos, seg, mode=Mode(form="decode"), cache={"k": 0})


@pytest.mark.parametrize("letter", LETTERS)
def test_decode_cache_sizes_agree_with_the_kind_facts(helpers, letter):
  """Per-token caches (G, S) hold `cache_numbers_per_token` values per row; recurrent caches
  (N, L) hold `recurrent_state_bytes` per slot with bf16 caches (the facts' byte sizes)."""
  kind = ATTENTION_KINDS[letter]
  overrides = dict(dtype="bfloat16")
  cfg = kind_config(helpers, letter, **overrides)
  if hasattr(cfg, "cache_dtype"):
    cfg = kind_config(helpers, letter, cache_dtype="bfloat16", **overrides)
  specs = kind.decode_cache(cfg, 3, MAX_LEN, MAX_VERIFY)
  for key, s in specs.items():
    assert s.shape[0] == 3 and len(s.axes) == len(s.shape), key
    assert axes.check(s.axes, key)[0] == axes.BATCH, key  # names glm5_jax.layers.axes knows
  per_row = lambda s: math.prod(s.shape[2:])
  if letter == "G":
    assert all(s.shape[1] == MAX_LEN for s in specs.values())
    assert sum(map(per_row, specs.values())) == kind.cache_numbers_per_token(cfg)["gqa_kv"]
  elif letter == "S":
    rows = swa_ring_rows(cfg, MAX_LEN, MAX_VERIFY)
    assert rows == WINDOW + MAX_VERIFY - 1
    latent = [specs["ckv"], specs["k_rope"]]
    assert all(s.shape[1] == rows for s in latent)
    assert sum(map(per_row, latent)) == kind.cache_numbers_per_token(cfg)["swa_latent"]
    assert specs["pos"].fill == -1 and specs["pos"].dtype == "int32"
  else:
    assert not kind.cache_numbers_per_token(cfg)
    nbytes = sum(math.prod(s.shape[1:]) * jnp.dtype(s.dtype).itemsize for s in specs.values())
    assert nbytes == kind.recurrent_state_bytes(cfg)
    assert jnp.dtype(specs["state"].dtype).itemsize == STATE_BYTES_PER_NUMBER
    conv = [s for k, s in specs.items() if k != "state"]
    assert all(jnp.dtype(s.dtype).itemsize == CACHE_BYTES_PER_NUMBER for s in conv)
