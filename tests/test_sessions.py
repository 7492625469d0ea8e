"""Engine sessions: a multi-turn conversation continued in its held slot equals re-prefilling the
whole context (tokens exactly, log-probs to fp32 rounding), under slot pressure (LRU evictions),
prefix mismatches and releases; the prefix counters; and rollouts with sessions on the
calculator env equal rollouts without them."""

import numpy as np
import pytest

from configs import rl_tiny
from glm5_jax.config import ModelConfig
from glm5_jax.data import chat, make_tokenizer
from glm5_jax.infer import engine as engine_lib
from glm5_jax.infer.requests import Request
from glm5_jax.posttrain import rollout
from glm5_jax.posttrain.envs import calculator
from tests.conftest import random_params, tiny_model_config

# D | D (MoE) | R | M, index_topk 4: top-k is active past 4 tokens, and two recurrent kinds
# whose state must continue from the held session exactly.
CFG = tiny_model_config(num_hidden_layers=4, attention_pattern="DDRM", first_k_dense_replace=1,
                        index_topk=4, mtp_depths=1)
MAX_LEN, CHUNK = 48, 4
PROMPTS = [(5, 17, 3, 99, 42, 7, 8), (11,), (250, 3, 3, 9), (5, 17, 3, 99, 42, 7, 8)]
# The segments appended after each turn (an observation's rendering in a rollout).
SEGMENTS = [[(4, 200, 31), (7,), (90, 91, 92, 93, 94), (12, 13)],
            [(60, 61), (8, 9, 10, 11, 12, 13), (1,), (77, 78, 79)]]


@pytest.fixture(scope="module")
def params():
  return random_params(CFG, seed=3, std=0.5)


def request(i, prompt, turn, session=None, max_new=(5, 3, 6, 4)):
  return Request(i, tuple(prompt), max_new[i], 1.3, 0.9, 0,
                 engine_lib.request_seed(turn, i), session=session)


def play(engine, turns, sessions=True, release=()):
  """Plays len(PROMPTS) conversations for `turns` turns on `engine`: each turn's prompt is the
  last turn's sequence plus its segment. Returns [turn][conversation] completions."""
  contexts, out = [list(p) for p in PROMPTS], []
  for turn in range(turns):
    done = engine.run([request(i, c, turn, session=f"s{i}" if sessions else None)
                       for i, c in enumerate(contexts)])
    out.append(done)
    if turn + 1 < turns:
      contexts = [c.sequence + list(SEGMENTS[turn][i]) for i, c in enumerate(done)]
    for s in release:
      engine.release(s)
  return out


@pytest.fixture(scope="module")
def reference(params):
  """Every turn re-prefilled whole: no sessions."""
  engine = engine_lib.Engine(CFG, params, slots=4, max_len=MAX_LEN, prefill_chunk=CHUNK)
  turns = play(engine, 3, sessions=False)
  return turns, engine.prefix_stats()


def assert_same(got, want):
  for turn, (g_turn, w_turn) in enumerate(zip(got, want)):
    for i, (g, w) in enumerate(zip(g_turn, w_turn)):
      assert g.request.prompt == w.request.prompt, (turn, i)
      assert g.tokens == w.tokens, (turn, i)
      np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-4, atol=1e-5)
      np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, rtol=1e-4, atol=1e-5)


def test_sessions_equal_full_prefill_and_prefill_only_new_tokens(params, reference):
  want, ref_stats = reference
  engine = engine_lib.Engine(CFG, params, slots=4, max_len=MAX_LEN, prefill_chunk=CHUNK)
  got = play(engine, 3)
  assert_same(got, want)
  stats = engine.prefix_stats()
  prompt_tokens = sum(len(c.request.prompt) for turn in want for c in turn)
  assert stats["prompt_tokens"] == ref_stats["prompt_tokens"] == prompt_tokens
  # Turn 0: prompts 0 and 3 are equal (one prefill, copied). Later turns: each session prefills
  # its last sampled token (never fed) and the segment.
  fresh = sum(len(p) for p in PROMPTS[:3])
  new = sum(1 + len(seg) for turn in SEGMENTS for seg in turn)
  assert stats["prefilled_tokens"] == fresh + new
  assert ref_stats["prefilled_tokens"] == prompt_tokens - len(PROMPTS[3])
  assert stats["hit_rate"] == pytest.approx(1 - (fresh + new) / prompt_tokens)
  assert stats["hit_rate"] > ref_stats["hit_rate"] + 0.3
  assert (stats["session_hits"], stats["session_misses"], stats["evictions"]) == (8, 4, 0)
  assert len(engine.sessions) == 4


def test_slot_pressure_evicts_lru_and_stays_exact(params, reference):
  """2 slots for 4 conversations: finished sessions are evicted for waiting requests, whose
  next turn is a miss (whole prefill); every token is still the reference's."""
  want, _ = reference
  engine = engine_lib.Engine(CFG, params, slots=2, max_len=MAX_LEN, prefill_chunk=CHUNK)
  got = play(engine, 3)
  assert_same(got, want)
  stats = engine.prefix_stats()
  assert stats["evictions"] > 0 and stats["session_misses"] > 4  # 4: the first turn's
  assert stats["session_hits"] > 0 and len(engine.sessions) == 2


def test_release_and_prefix_mismatch_are_misses(params, reference):
  want, _ = reference
  engine = engine_lib.Engine(CFG, params, slots=4, max_len=MAX_LEN, prefill_chunk=CHUNK)
  got = play(engine, 2, release=["s1"])
  assert_same(got, want[:2])
  assert engine.release("s1") is False and engine.release("s0") is True
  stats = engine.prefix_stats()
  assert (stats["session_hits"], stats["session_misses"]) == (3, 5)
  # A prompt that does not extend the held sequence (an edited history) re-prefills whole.
  held = got[1][2]
  edited = list(held.sequence)
  edited[1] = (edited[1] + 1) % CFG.vocab_size
  r = request(2, edited + [5], 9, session="s2")
  alone = engine_lib.Engine(CFG, params, slots=4, max_len=MAX_LEN, prefill_chunk=CHUNK).run(
      [request(2, edited + [5], 9)])[0]
  before = engine.prefix_stats()["prefilled_tokens"]
  [c] = engine.run([r])
  assert engine.prefix_stats()["prefilled_tokens"] - before == len(edited) + 1
  assert c.tokens == alone.tokens
  np.testing.assert_allclose(c.raw_logprobs, alone.raw_logprobs, rtol=1e-4, atol=1e-5)


def test_session_errors(params):
  engine = engine_lib.Engine(CFG, params, slots=2, max_len=MAX_LEN, prefill_chunk=CHUNK)
  with pytest.raises(ValueError, match="request 1: session 's' has two requests"):
    engine.run([request(0, [1, 2], 0, session="s"), request(1, [3], 0, session="s")])
  with pytest.raises(ValueError, match="request 0: session must be hashable"):
    engine.run([request(0, [1, 2], 0, session=["s"])])
  spec = engine_lib.Engine(CFG, params, slots=2, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           speculative_steps=1)
  with pytest.raises(ValueError, match="speculative_steps=0"):
    spec.run([request(0, [1, 2], 0, session="s")])


# ---------------------------------------------------------------------------------------------
# Rollouts: the calculator env, multi-turn


class ToolEveryTurn(calculator.Calculator):
  """The calculator env, with a turn that made no tool call read as `calc(expression)` while
  turns remain: random params rarely write a tool call, and this plays every episode whose
  turns end for all max_turns turns, with the env's real observations."""
  name = "calculator_every_turn"

  def step(self, task, messages):
    turns = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    last = messages[-1] if messages else None
    if isinstance(last, dict) and last.get("role") == "assistant" and not last.get(
        "tool_calls") and len(turns) < self.max_turns:
      messages = list(messages[:-1]) + [dict(last, tool_calls=[
          f"calc({task.info['expression']})"])]
    return super().step(task, messages)


def rollout_setup():
  """configs/rl_tiny.py with a 2-layer model, and random params whose turn-ending tokens' output
  columns are scaled 5x: plain random params end ~1 turn in 4 within 24 tokens, these most."""
  config = rl_tiny.get_config("recipe=plain")
  del config["sft"]
  config.model.num_hidden_layers = 2
  config.data.seq_len = 128
  config.rl.update(group_size=4, max_new_tokens=24, temperature=1.0)
  params = dict(random_params(ModelConfig.from_config(config.model), seed=1, std=0.1))
  lm_head = np.array(params["lm_head"])
  lm_head[:, list(chat.stop_ids(make_tokenizer("byte")))] *= 5.0
  params["lm_head"] = lm_head
  return config, params


@pytest.mark.parametrize("max_slots", [64, 6])
def test_rollout_sessions_equal_no_sessions(max_slots, monkeypatch):
  """4 calculator tasks x 4 samples, 3 turns: with sessions every sample's tokens and log-probs
  equal those without; with 6 slots for 16 episodes, evictions happen and it still holds."""
  monkeypatch.setattr(rollout, "MAX_SLOTS", max_slots)
  config, params = rollout_setup()
  env = ToolEveryTurn(max_turns=3)
  tasks = [env.task(i, "train") for i in range(4)]
  runs = {}
  for sessions in (False, True):
    stats = {}
    samples = rollout.generate_samples(config, params, env, tasks, seed=3, sessions=sessions,
                                       stats=stats)
    runs[sessions] = samples, stats
  (plain, plain_stats), (held, held_stats) = runs[False], runs[True]
  assert sum(s.turns == 3 for s in plain) >= 8 and sum(s.turns == 2 for s in plain) >= 1
  for a, b in zip(plain, held):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    np.testing.assert_allclose(a.rollout_logp, b.rollout_logp, rtol=1e-4, atol=1e-5)
    assert (a.reward, a.turns) == (b.reward, b.turns)
  assert held_stats["prompt_tokens"] == plain_stats["prompt_tokens"]
  assert held_stats["hit_rate"] > plain_stats["hit_rate"]
  if max_slots == 6:
    assert held_stats["evictions"] > 0 and held_stats["session_misses"] > len(plain)
  else:
    assert held_stats["evictions"] == 0
    assert held_stats["session_hits"] == sum(s.turns - 1 for s in held)
