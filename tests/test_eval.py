"""Retrieval suite: task generators place answers where they say (variable tracking included),
batches keep them there, scoring is teacher-forced exact match on answer tokens, results are
written as JSON + markdown, and a checkpoint converts training-free to another pattern."""

import json
import re

import jax
import numpy as np
import pytest

from configs import tiny
from glm5_jax import layer_runs
from glm5_jax.config import ModelConfig
from glm5_jax.data import make_tokenizer, synthetic
from glm5_jax.eval import checkpoints, report, suite as suite_lib

TOK = make_tokenizer("byte")


def haystack_text(example):
  return TOK.decode(example.tokens[1:example.prompt_len]).split("\nQ: ")[0]


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_variable_tracking_chain_answers_and_depth(depth):
  for index in range(8):
    ex = synthetic.generate("variable_tracking", TOK, index, length=600, depth=depth, seed=1,
                            num_chains=2, num_hops=3, var_chars=3, value_digits=2)
    assert len(ex.tokens) <= 600 and ex.tokens[-1] == TOK.eos_id
    assert len(ex.answers) == 4
    for (start, end), answer in zip(ex.answer_spans, ex.answers):  # spans decode to answers
      assert TOK.decode(ex.tokens[start:end]) == answer
      assert ex.loss_mask[start:end].all()
    assert ex.loss_mask.sum() == sum(e - s for s, e in ex.answer_spans)
    haystack = haystack_text(ex)
    statements = re.findall(r"VAR ([A-Z]+) = (\w+)\.", haystack)
    assert len(statements) == 8  # two chains of 4 variables
    value = re.search(r"assigned the value (\d+)\?", TOK.decode(ex.tokens)).group(1)
    # The answers are exactly the chain from the queried value, in text order.
    assigned, chain = dict(statements), []
    for name, source in statements:
      if source == value or source in chain:
        chain.append(name)
    assert tuple(chain) == ex.answers
    assert assigned[ex.answers[0]] == value
    first = haystack.index(f"VAR {ex.answers[0]} =")
    assert abs(first / len(haystack) - depth) < 0.2


@pytest.mark.parametrize("task", sorted(suite_lib.DEFAULT_TASKS))
def test_suite_examples_place_answers_in_padded_batches(task):
  suite = suite_lib.suite_config(tasks=(task,), lengths=(200, 300), depths=(0.0, 1.0),
                                 examples_per_cell=2)
  suite_lib.validate_suite(suite)
  for length in suite_lib.resolve_lengths(suite, None):
    examples = suite_lib.build_examples(suite, TOK, length)
    expected_cells = 1 if task in suite_lib.DEPTH_FREE_TASKS else 2
    assert len({k["depth"] for k, _ in examples}) == expected_cells
    assert len(examples) == 4  # depth-free tasks get examples_per_cell x len(depths) in one cell
    batch = suite_lib.pad_examples([e for _, e in examples], length, 5, TOK.pad_id)
    for row, (key, ex) in enumerate(examples):
      assert key["task"] == task and key["length"] == length and len(ex.tokens) <= length
      n = len(ex.tokens)
      assert (batch["segment_ids"][row, :n] == 1).all()
      assert (batch["segment_ids"][row, n:] == 0).all()
      np.testing.assert_array_equal(batch["positions"][row, :n], np.arange(n))
      for (start, end), answer in zip(ex.answer_spans, ex.answers):
        assert TOK.decode(batch["tokens"][row, start:end]) == answer
    assert (batch["segment_ids"][4] == 0).all()  # the filler row is empty
  # Reproducible from the seed; the training stream (0) holds other examples.
  again = suite_lib.build_examples(suite, TOK, 200)
  np.testing.assert_array_equal(again[0][1].tokens,
                                suite_lib.build_examples(suite, TOK, 200)[0][1].tokens)
  train_stream = suite_lib.build_examples(suite_lib.suite_config(
      tasks=(task,), lengths=(200,), depths=(0.0, 1.0), examples_per_cell=2, stream=0), TOK, 200)
  assert not np.array_equal(train_stream[0][1].tokens, again[0][1].tokens)


def test_score_example_is_teacher_forced_exact_match():
  ex = synthetic.generate("niah_multivalue", TOK, 0, length=200, value_digits=2, num_values=3)
  predictions = np.zeros(len(ex.tokens) - 1, np.int32)
  predictions[:] = -1
  for start, end in ex.answer_spans:  # predictions[i] is the guess for token i + 1
    predictions[start - 1:end - 1] = ex.tokens[start:end]
  scores = suite_lib.score_example(ex, predictions)
  assert scores == dict(exact_match=1.0, answer_accuracy=1.0, token_accuracy=1.0)
  start, _ = ex.answer_spans[1]
  predictions[start] = 0  # second digit of the second answer wrong
  scores = suite_lib.score_example(ex, predictions)
  assert scores["exact_match"] == 0.0 and scores["answer_accuracy"] == pytest.approx(2 / 3)
  assert scores["token_accuracy"] == pytest.approx(5 / 6)


def test_suite_errors_name_the_field():
  with pytest.raises(ValueError, match="suite.tasks"):
    suite_lib.validate_suite(suite_lib.suite_config(tasks=("nope",)))
  with pytest.raises(ValueError, match=r"suite.task_options.niah_single: unknown options"):
    suite_lib.validate_suite(suite_lib.suite_config(
        task_options=dict(niah_single=dict(value_digits=2, num_values=3))))
  with pytest.raises(ValueError, match="suite.train_length"):
    suite_lib.resolve_lengths(suite_lib.suite_config(), None)
  with pytest.raises(ValueError, match="suite.task_options.niah_multikey at length 40"):
    suite_lib.build_examples(suite_lib.suite_config(tasks=("niah_multikey",)), TOK, 40)


def small_model():
  """configs/tiny.py's MLA model with 2 dense-FFN layers and no MTP (compiles in seconds)."""
  model = tiny.get_config("attention=M").model
  model.update(num_hidden_layers=2, first_k_dense_replace=2, mtp_depths=0)
  return checkpoints.complete_model_config(model)


def test_run_suite_writes_json_and_markdown(tmp_path, helpers):
  model = small_model()
  params = helpers.random_params(ModelConfig.from_config(model))
  suite = suite_lib.suite_config(tasks=("niah_single", "variable_tracking", "mqar"),
                                 length_multiples=(1, 2), depths=(0.0, 1.0),
                                 examples_per_cell=1, batch_tokens=256)
  results = suite_lib.run_suite(model, params, suite, TOK, train_length=128, progress=False)
  assert results["meta"]["lengths"] == [128, 256]
  assert results["meta"]["examples"] == 2 * 3 * 2
  assert set(results["by_task_length"]) == {"niah_single", "variable_tracking", "mqar"}
  assert 0.0 <= results["score"] <= 1.0
  assert {c["depth"] for c in results["cells"] if c["task"] == "mqar"} == {None}
  json_path, md_path = report.write_suite_results(results, str(tmp_path), "eval")
  with open(json_path) as f:
    assert json.load(f)["by_length"].keys() == {"128", "256"}
  with open(md_path) as f:
    text = f.read()
  assert "| niah_single |" in text and "L=256" in text and "by needle depth" in text


def test_convert_run_params_keeps_trained_params_and_adds_fresh_ones(helpers):
  source = small_model()
  params = helpers.random_params(ModelConfig.from_config(source), seed=1)
  target = checkpoints.apply_model_overrides(source, {"attention_pattern": "MD"})
  converted = checkpoints.convert_run_params(params, source, target, seed=3)
  flat = lambda t: {jax.tree_util.keystr(p): v for p, v in
                    jax.tree_util.tree_flatten_with_path(t)[0]}
  # Layer by layer: the scanned runs regroup when the pattern changes (MM is one run, MD two).
  before = flat(layer_runs.as_unrolled(params, ModelConfig.from_config(source)))
  after = flat(layer_runs.as_unrolled(converted, ModelConfig.from_config(target)))
  for key, value in before.items():
    np.testing.assert_array_equal(np.asarray(after[key]), np.asarray(value), err_msg=key)
  new = sorted(set(after) - set(before))
  assert new and all("indexer" in k for k in new)
  assert checkpoints.convert_run_params(params, source, source) is params
  gqa = checkpoints.apply_model_overrides(source, {"attention_pattern": "G"})
  with pytest.raises(ValueError, match=r"converting /runs/x from pattern 'M' to 'G': .*family"):
    checkpoints.convert_run_params(params, source, gqa, description="/runs/x")
  with pytest.raises(ValueError, match="model has no field 'window'"):
    checkpoints.apply_model_overrides(source, {"window": 3})


def true_next_tokens(tokens_BL, positions_BL, segment_ids_BL):
  """A predictor that is always right: entry i is token i + 1."""
  return np.asarray(tokens_BL)[:, 1:]


def current_tokens(tokens_BL, positions_BL, segment_ids_BL):
  """Right one position late: entry i is token i (the off-by-one a scorer must not reward)."""
  return np.asarray(tokens_BL)[:, :-1]


def test_suite_scores_an_oracle_100_percent_and_a_shifted_one_0():
  suite = suite_lib.suite_config(lengths=(256, 512), depths=(0.0, 0.5, 1.0),
                                 examples_per_cell=2, batch_tokens=512)
  assert set(suite.tasks) == set(suite_lib.DEFAULT_TASKS)
  oracle = suite_lib.score_predictor(true_next_tokens, suite, TOK, progress=False)
  assert oracle["meta"]["examples"] == 2 * 3 * 2 * len(suite.tasks)
  assert oracle["score"] == oracle["answer_accuracy"] == oracle["token_accuracy"] == 1.0
  assert all(c["exact_match"] == 1.0 for c in oracle["cells"])
  shifted = suite_lib.score_predictor(current_tokens, suite, TOK, progress=False)
  assert shifted["score"] == shifted["answer_accuracy"] == 0.0
  assert all(c["exact_match"] == 0.0 for c in shifted["cells"])
  assert shifted["token_accuracy"] < 0.2  # only repeated digits ("33") can match
