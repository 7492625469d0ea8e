"""SWA layer search: the beam search finds the best pattern of a known score, respects its
settings, and on a tiny model (scored by the retrieval suite) returns a valid pattern."""

import itertools

import pytest

from configs import tiny
import glm5_jax
from glm5_jax.config import ModelConfig
from glm5_jax.data import make_tokenizer
from glm5_jax.eval import checkpoints
from glm5_jax.eval.evaluate import pattern_scorer
from glm5_jax.eval.suite import suite_config
from glm5_jax.eval.swa_search import beam_search_pattern, num_candidates

WEIGHTS = (0.1, 0.5, 0.3, 0.9, 0.2, 0.4)  # cost of making layer i SWA


def additive_score(pattern):
  return -sum(w for w, c in zip(WEIGHTS, pattern) if c == "S")


def test_beam_search_finds_the_best_additive_pattern():
  result = beam_search_pattern("MMMMMM", 3, additive_score, beam_width=8, layers_per_step=2)
  assert result.pattern == "SMSMSM"  # the three cheapest layers: 0, 4, 2
  assert result.score == pytest.approx(-0.6)
  assert len(result.history) == 2  # 2 layers, then the remaining 1
  assert all(p.count("S") == 2 for p, _ in result.history[0])
  assert all(p.count("S") == 3 for p, _ in result.history[1])
  # Every step's candidates are ranked best first; every pattern is scored once.
  for step in result.history:
    assert [s for _, s in step] == sorted((s for _, s in step), reverse=True)
  assert len(result.scores) <= num_candidates(6, 3, 8, 2)
  assert result.to_json()["evaluations"] == len(result.scores)


def test_beam_width_one_is_greedy_and_exhaustive_width_is_optimal():
  # A score with an interaction: layers 1 and 3 together are much better than either alone.
  def score(pattern):
    bonus = 2.0 if pattern[1] == pattern[3] == "S" else 0.0
    return additive_score(pattern) + bonus
  greedy = beam_search_pattern("MMMMMM", 2, score, beam_width=1, layers_per_step=1)
  assert greedy.pattern == "SMMMSM"  # greedy takes layer 0, then 4: misses the pair
  wide = beam_search_pattern("MMMMMM", 2, score, beam_width=1, layers_per_step=2)
  best = max(("".join("S" if i in pair else "M" for i in range(6))
              for pair in itertools.combinations(range(6), 2)), key=score)
  assert wide.pattern == best == "MSMSMM"


def test_search_settings_and_errors():
  result = beam_search_pattern("DMMD", 1, additive_score, layers_per_step=2, convertible="M")
  assert result.pattern in ("DSMD", "DMSD") and result.pattern[0] == result.pattern[3] == "D"
  assert beam_search_pattern("MMMM", 0, additive_score).pattern == "MMMM"
  calls = []
  beam_search_pattern("MMMM", 2, additive_score, progress=lambda *a: calls.append(a))
  assert [c[0] for c in calls] == list(range(1, 7))  # C(4, 2) candidates, counted
  with pytest.raises(ValueError, match="num_convert=5"):
    beam_search_pattern("MMMM", 5, additive_score)
  with pytest.raises(ValueError, match="beam_width"):
    beam_search_pattern("MMMM", 2, additive_score, beam_width=0)


def test_search_on_a_tiny_model_returns_a_valid_pattern(helpers):
  letter = "S"
  model = checkpoints.complete_model_config(
      tiny.get_config("attention=M").model)
  model.update(num_hidden_layers=4, first_k_dense_replace=4, mtp_depths=0, sliding_window=16)
  params = helpers.random_params(ModelConfig.from_config(model), seed=0)
  loaded = checkpoints.LoadedRun(model=model, params=params, source_model=model, step=0,
                                 data=dict(seq_len=64, tokenizer="byte"), converted=False)
  suite = suite_config(tasks=("niah_single",), lengths=(96,), depths=(0.5,),
                       examples_per_cell=1, batch_tokens=96)
  score = pattern_scorer(loaded, suite, make_tokenizer("byte"))
  result = beam_search_pattern("MMMM", 2, score, beam_width=8, layers_per_step=2, letter=letter)
  assert len(result.pattern) == 4 and result.pattern.count(letter) == 2
  assert set(result.pattern) <= {"M", letter}
  assert len(result.scores) == 6 and all(0.0 <= s <= 1.0 for s in result.scores.values())
  cfg = ModelConfig.from_config(checkpoints.apply_model_overrides(
      model, {"attention_pattern": result.pattern}))  # the pattern is a valid model config
  assert cfg.attention_pattern == result.pattern
  assert glm5_jax.abstract_params(cfg)  # and builds
