"""Held-out scoring (`glm5_jax.train.heldout`): per-source loss, token accuracy, exact match."""

import numpy as np
import pytest

from glm5_jax.train.heldout import score_heldout


def test_per_source_scores_count_each_packed_document():
  # One row, two packed documents: doc 1 (source 0, "text") tokens 0-2, doc 2 (source 1,
  # "mqar", a retrieval task) tokens 3-6 whose answer (loss_mask 1) is tokens 5-6; then padding.
  batch = dict(
      tokens=np.array([[10, 11, 12, 20, 21, 22, 23, 0]]),
      segment_ids=np.array([[1, 1, 1, 2, 2, 2, 2, 0]]),
      loss_mask=np.array([[1, 1, 1, 0, 0, 1, 1, 0]], np.float32),
      source_id=np.array([[0, 0, 0, 1, 1, 1, 1, -1]]),
  )
  # Entry i is token i's (guess, nll); entry 0 has none. Targets counted: 11, 12 (doc 1) and
  # 22, 23 (doc 2).
  predictions = np.array([[-1, 11, 99, 0, 0, 22, 23, 0]])  # doc 1 half right, doc 2 all right
  nll = np.array([[0.0, 1.0, 3.0, 9.0, 9.0, 0.5, 1.5, 9.0]])

  def eval_step(params, device_batch):
    assert params == "params" and device_batch is batch
    return {"loss": 2.0}, predictions, nll

  out = score_heldout(eval_step, "params", [batch, batch], lambda b: b, ["text", "mqar"],
                      answer_sources={"mqar"})
  assert out["loss"] == 2.0
  assert out["text/loss"] == pytest.approx(2.0) and out["text/token_accuracy"] == 0.5
  assert out["mqar/loss"] == pytest.approx(1.0) and out["mqar/token_accuracy"] == 1.0
  assert out["mqar/exact_match"] == 1.0 and "text/exact_match" not in out


def test_no_batches_scores_nothing():
  assert score_heldout(None, None, [], None, ["a"]) == {}
