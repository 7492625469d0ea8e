"""The paged decode cache (`glm5_jax.infer.paged`, `page_pool`, `Engine(page_size=...)`): cached
decode stays exact, pages are shared by reference within a group and freed when requests end,
and bucketed shapes stop recompiling after warm-up.

Most tests share one engine shape (`SHAPE`: pages of 8 rows, max_len 64, so steps read 1, 2, 4
or 8 pages) so that they share compiled programs."""

import random

import jax
import numpy as np
import pytest

from glm5_jax import infer
from glm5_jax.infer import engine as engine_lib
from glm5_jax.infer.compile_count import count_compiles
from glm5_jax.infer.page_pool import PagePool
from glm5_jax.infer.paged import page_bucket
from glm5_jax.infer.requests import Request
from tests.conftest import forward, random_params, tiny_model_config

# D | R, index_topk 4: the DSA top-k is active past 4 tokens, the R layer reuses it.
CFG = tiny_model_config(num_hidden_layers=2, attention_pattern="DR", first_k_dense_replace=2,
                        index_topk=4, mtp_depths=1)
# Every other kind: GQA K / V paged; the GDN state and the SWA ring (also the MTP layer's kind)
# per slot.
MIXED = tiny_model_config(num_hidden_layers=3, attention_pattern="NGS", first_k_dense_replace=3,
                          sliding_window=5, mtp_depths=1)
SHAPE = dict(slots=2, max_len=64, prefill_chunk=8)
PAGED = dict(SHAPE, page_size=8)
PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [11], [250, 3, 3, 9],
           [5, 17, 3, 99, 42, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def params():
  return random_params(CFG, seed=3, std=0.5)


def _requests(prompts, max_new, temperature=0.0, seed=0, session=None):
  return [Request(i, tuple(p), m, temperature, 1.0, 0, engine_lib.request_seed(seed, i), (),
                  session=session)
          for i, (p, m) in enumerate(zip(prompts, max_new))]


def test_page_pool_refcounts_and_copies():
  pool = PagePool(num_pages=9, slots=3, max_pages=4, page_size=4)
  pool.grow(0, 3)  # a 10-row prompt: pages 1, 2 full, 3 partly filled
  assert pool.held[0] == [1, 2, 3] and pool.free == 5
  copies = pool.share(0, 1, shared=2, copied=1, pages=4)
  assert pool.held[1][:2] == [1, 2] and copies == [(3, pool.held[1][2])]
  assert pool.shared_rows[0] == pool.shared_rows[1] == 8 and pool.used == 5
  pool.release(0)  # pages 1, 2 still held by slot 1
  assert pool.used == 4 and pool.free == 4
  pool.release(1)
  assert pool.used == 0 and pool.free == 8 and not pool.table.any()
  with pytest.raises(ValueError, match="num_pages"):
    PagePool(num_pages=1, slots=1, max_pages=1, page_size=4)


def test_page_bucket_is_a_power_of_two_capped():
  assert [page_bucket(r, 4, 6) for r in (1, 4, 5, 9, 13, 24, 99)] == [1, 1, 2, 4, 4, 6, 6]


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_paged_engine_equals_contiguous(params, temperature):
  """Pages of 8 rows (prompts span up to 4, a group of two shares its prompt pages), 2 slots
  refilled as requests end: the tokens and log-probs of the contiguous cache."""
  prompts = PROMPTS + [[1, 2, 3], [250]]
  requests = _requests(prompts, (9, 3, 6, 4, 2, 5), temperature)
  want = engine_lib.Engine(CFG, params, **SHAPE, page_size=None).run(requests)
  engine = engine_lib.Engine(CFG, params, **PAGED)
  got = engine.run(requests)
  for g, w in zip(got, want):
    assert g.tokens == w.tokens
    np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, rtol=1e-5, atol=1e-5)
  assert engine.pages.used == 0  # every request ended: every page is back


def test_paged_greedy_equals_the_full_forward(params):
  """Each greedy token of the paged engine is the full forward's argmax, with its raw
  log-prob."""
  n, length = 12, 32
  got = engine_lib.Engine(CFG, params, **PAGED).run(_requests(PROMPTS, (n,) * len(PROMPTS)))
  for prompt, c in zip(PROMPTS, got):
    seq = np.zeros((1, length), np.int32)
    seq[0, :len(prompt) + n] = list(prompt) + c.tokens
    logits = np.asarray(forward(CFG, params, seq, mtp=False)["logits"][0], np.float64)
    want_LY = logits[len(prompt) - 1:len(prompt) - 1 + n]
    assert c.tokens == list(np.argmax(want_LY, axis=-1))
    top = want_LY.max(-1, keepdims=True)
    log_softmax = want_LY - top - np.log(np.exp(want_LY - top).sum(-1, keepdims=True))
    np.testing.assert_allclose(c.raw_logprobs, log_softmax[np.arange(n), c.tokens], rtol=0,
                               atol=3e-5 * np.abs(want_LY).max())


@pytest.mark.slow  # its own configs and shapes compile ~8 programs
def test_every_kind_paged_equals_contiguous():
  """GQA K / V paged, the sliding-window ring and the GDN state per slot, MTP speculation
  (its caches paged too): the contiguous cache's tokens."""
  params = random_params(MIXED, seed=4, std=0.5)
  for k in (0, 1):
    kwargs = dict(max_new_tokens=5, prefill_chunk=4, max_len=32, speculative_steps=k, slots=2)
    want = infer.generate(MIXED, params, PROMPTS, page_size=None, **kwargs)
    got = infer.generate(MIXED, params, PROMPTS, page_size=4, **kwargs)
    assert got.tokens == want.tokens, k
    np.testing.assert_allclose(np.concatenate(got.raw_logprobs),
                               np.concatenate(want.raw_logprobs), rtol=0, atol=1e-5)


def test_group_shares_the_prompt_pages(params):
  """G = 2 samples of an 18-token prompt in pages of 8: the two full prompt pages are stored
  once, the third (2 rows) copied per sample; each sample equals generating it alone."""
  prompt = PROMPTS[0]
  requests = _requests([prompt] * 2, (3,) * 2, temperature=1.0, seed=5)
  engine = engine_lib.Engine(CFG, params, **PAGED)
  used = []
  original = engine._admit

  def admit(admitted):
    out = original(admitted)
    used.append(engine.pages.used)
    return out

  engine._admit = admit
  got = engine.run(requests)
  # Each sample needs 18 + 3 - 1 = 20 rows = 3 pages: 2 shared + 1 own each.
  assert used == [4]
  for r, g in zip(requests, got):
    alone = engine_lib.Engine(CFG, params, **PAGED).run([r])[0]
    assert g.tokens == alone.tokens
  assert engine.pages.used == 0


def test_sessions_hold_their_pages(params):
  engine = engine_lib.Engine(CFG, params, **PAGED)
  first = engine.run(_requests([PROMPTS[0]], (3,), session="a"))[0]
  assert engine.pages.used == 3  # 18 + 3 - 1 rows, held
  second = list(first.sequence) + [7, 8]
  engine.run(_requests([second], (4,), session="a"))
  assert engine.pages.used == 4  # 23 + 4 - 1 rows, the held pages kept
  assert engine.release("a") and engine.pages.used == 0


@pytest.mark.slow  # a pool of its own size: its own compiles
def test_a_small_pool_makes_requests_wait(params):
  """3 free pages for requests of 2 pages each: one runs at a time, all finish, as with ample
  pages."""
  requests = _requests([[1] * 9] + [[9, 8, 7] * 3] * 2, (3, 4, 2))
  small = engine_lib.Engine(CFG, params, **PAGED, num_pages=4).run(requests)
  ample = engine_lib.Engine(CFG, params, **PAGED).run(requests)
  assert [c.tokens for c in small] == [c.tokens for c in ample]
  with pytest.raises(ValueError, match="num_pages"):
    engine_lib.Engine(CFG, params, **PAGED, num_pages=2).run(_requests([[1] * 12], (2,)))


def test_no_compile_after_warmup(params):
  """After `warmup()`, 100 random requests (prompt lengths 1..40, 1..8 new tokens, greedy and
  sampled, a fifth of them one prompt: groups; 2 slots refilled as they end) compile nothing."""
  engine = engine_lib.Engine(CFG, params, **PAGED)
  engine.warmup()
  rng = random.Random(0)
  prompts = [[rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 40))]
             for _ in range(80)]
  prompts += [prompts[0]] * 20
  requests = [Request(i, tuple(p), rng.randint(1, 8), rng.choice([0.0, 1.0]), 1.0, 0, i, ())
              for i, p in enumerate(prompts)]
  with count_compiles() as compiles:
    done = engine.run(requests)
  assert compiles.count == 0
  assert [len(c.tokens) for c in done] == [r.max_new_tokens for r in requests]
  assert engine.pages.used == 0


def test_warmup_covers_every_admission_with_placed_params(params):
  """After `warmup()`, admissions of one-chunk and three-chunk prompts (alone, two distinct:
  two rows), a group (copy-on-write) and a session's continuation over two chunks compile
  nothing. The params are placed on a one-device mesh, as an RL worker places them: programs
  then take committed arrays, the previous chunk's outputs, which fresh arrays do not stand
  for."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  placed = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  engine = engine_lib.Engine(CFG, placed, **dict(PAGED, max_len=32))
  engine.warmup()
  long = list(range(1, 20))  # 3 chunks of 8
  with count_compiles() as compiles:
    engine.run(_requests([[1, 2, 3]], (3,)))
    engine.run(_requests([long], (3,)))
    engine.run(_requests([long, [7] + long], (2, 2)))
    engine.run(_requests([long, long], (2, 2), temperature=1.0))
    first = engine.run(_requests([[4, 5, 6, 7, 8]], (2,), session="s"))[0]
    engine.run(_requests([first.sequence + list(range(30, 40))], (2,), session="s"))  # 11 new
    assert engine.release("s")
  assert compiles.count == 0


def test_generate_does_not_recompile_for_new_lengths(params):
  """`generate` buckets max_len (here 64 for every call): new prompt lengths and
  max_new_tokens reuse the compiled steps."""
  kwargs = dict(slots=2, prefill_chunk=8, page_size=8)
  infer.generate(CFG, params, [[1] * 40], max_new_tokens=2, **kwargs)  # 5 chunks: N 1..8
  infer.generate(CFG, params, [[1] * 3], max_new_tokens=30, **kwargs)  # decode N 1..8
  with count_compiles() as compiles:
    for length, new in ((5, 3), (9, 7), (17, 2), (2, 20), (33, 1)):
      infer.generate(CFG, params, [[3] * length], max_new_tokens=new, **kwargs)
  assert compiles.count == 0


def test_cancel_gives_the_pages_back(params):
  engine = engine_lib.Engine(CFG, params, **PAGED)
  handles = [engine.submit(r) for r in _requests([PROMPTS[0], PROMPTS[2]], (9, 9))]
  engine.step()
  assert engine.pages.used == 4 + 2  # 18 + 9 - 1 rows, 4 + 9 - 1 rows
  assert engine.cancel(handles[0]) and engine.pages.used == 2
  while engine.busy:
    engine.step()
  assert engine.pages.used == 0
