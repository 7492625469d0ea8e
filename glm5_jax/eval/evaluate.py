"""Evaluate a training run's checkpoint (as trained, or converted to another attention pattern)
on the retrieval suite: the function behind experiments/eval.py, the sweeps and the SWA search.
"""

import time

from absl import logging
import ml_collections

from glm5_jax.data import make_tokenizer
from glm5_jax.eval.checkpoints import (LoadedRun, apply_model_overrides, convert_run_params,
                                       load_run)
from glm5_jax.eval.suite import run_suite
from glm5_jax.eval.swa_search import SWA_LETTER, beam_search_pattern, num_candidates


def evaluate_run(workdir: str, suite, *, target_model=None, model_overrides: dict | None = None,
                 seed: int = 0, train_length: int | None = None, tokenizer=None,
                 loaded: LoadedRun | None = None) -> dict:
  """Suite results (see `glm5_jax.eval.suite`) of `workdir`'s latest params.

  Args:
    suite: a `suite_config()`.
    target_model, model_overrides, seed: see `glm5_jax.eval.checkpoints.load_run`.
    train_length: the training row length the suite's `length_multiples` scale; default the
      run's `data.seq_len`.
    tokenizer: default the run's `data.tokenizer`.
    loaded: an already loaded run (skips loading; the other loading arguments are ignored).
  Returns:
    the suite's results, with `meta` extended by the checkpoint, its step and whether the params
    were converted.
  """
  if loaded is None:
    loaded = load_run(workdir, target_model=target_model, model_overrides=model_overrides,
                      seed=seed)
  if tokenizer is None:
    tokenizer = make_tokenizer(loaded.data.get("tokenizer", "byte"))
  train_length = train_length or loaded.data.get("seq_len")
  logging.info("evaluating %s (step %d, pattern %s%s)", workdir, loaded.step,
               loaded.model.attention_pattern,
               f", converted from {loaded.source_model.attention_pattern}"
               if loaded.converted else "")
  results = run_suite(loaded.model, loaded.params, suite, tokenizer, train_length=train_length)
  results["meta"].update(checkpoint=workdir, step=loaded.step, converted=loaded.converted,
                         source_pattern=loaded.source_model.attention_pattern,
                         model=loaded.model.to_dict())
  return results


def pattern_scorer(loaded: LoadedRun, suite, tokenizer, *, model_overrides: dict | None = None,
                   seed: int = 0, train_length: int | None = None):
  """`score(pattern) -> float`: the suite's overall exact match of `loaded`'s params converted
  training-free to `pattern` (with `model_overrides`, e.g. the sliding window), plus 1e-4 x its
  answer-token accuracy: patterns with equal exact match (e.g. all 0 at a length the model
  cannot handle) rank by how many answer tokens they still get right; exact match moves in
  steps of 1 / examples, far above the tie-break for any suite under 10,000 examples."""
  train_length = train_length or loaded.data.get("seq_len")

  def score(pattern: str) -> float:
    target = apply_model_overrides(loaded.source_model,
                                   {**(model_overrides or {}), "attention_pattern": pattern})
    params = convert_run_params(loaded.params, loaded.source_model, target, seed=seed,
                                description="the searched checkpoint")
    results = run_suite(target, params, suite, tokenizer, train_length=train_length,
                        progress=False)
    return results["score"] + 1e-4 * results["token_accuracy"]

  return score


def search_swa_pattern(workdir: str, suite, *, length: int | None = None,
                       length_multiple: float = 4.0, num_convert: int | None = None,
                       beam_width: int = 8, layers_per_step: int = 2, letter: str = SWA_LETTER,
                       model_overrides: dict | None = None, seed: int = 0) -> dict:
  """Beam search (`glm5_jax.eval.swa_search`) over which layers of `workdir`'s trained model
  become `letter`, each candidate scored training-free on `suite` at one `length`.

  Args:
    length: the one context length scored; default `length_multiple` x the run's training
      length (`data.seq_len`).
    num_convert: layers converted (default half of them, rounded down).
  Returns:
    JSON-able dict: pattern, score, base_pattern, evaluations, history, scores, settings.
  """
  loaded = load_run(workdir)
  base = loaded.model.attention_pattern
  base = base * loaded.model.num_hidden_layers if len(base) == 1 else base
  num_convert = len(base) // 2 if num_convert is None else num_convert
  if length is None:
    length = int(length_multiple * loaded.data["seq_len"])
  suite = ml_collections.ConfigDict(suite.to_dict())
  suite.lengths = (int(length),)
  tokenizer = make_tokenizer(loaded.data.get("tokenizer", "byte"))
  total = num_candidates(sum(c != letter for c in base), num_convert, beam_width,
                         layers_per_step)
  start = time.time()

  def progress(count, pattern, value):
    logging.info("swa search: %d/<=%d %s score %.4f (%.0f s)", count, total, pattern, value,
                 time.time() - start)

  score = pattern_scorer(loaded, suite, tokenizer, model_overrides=model_overrides, seed=seed)
  result = beam_search_pattern(base, num_convert, score, beam_width=beam_width,
                               layers_per_step=layers_per_step, letter=letter,
                               progress=progress)
  return dict(result.to_json(), base_pattern=base, checkpoint=workdir, step=loaded.step,
              length=int(length), num_convert=num_convert, beam_width=beam_width,
              layers_per_step=layers_per_step, letter=letter,
              model_overrides=model_overrides or {}, seconds=time.time() - start)
