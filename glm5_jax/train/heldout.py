"""Held-out scoring during training: mean eval losses, and per data source the target-token loss,
token accuracy and (for retrieval tasks) exact match.

The long-context suite (`glm5_jax.eval`) is separate: it scores a saved checkpoint on generated
tasks at chosen lengths; this scores the held-out split of the training mix at training time.
"""

import jax
import numpy as np

from glm5_jax.train.losses import target_weights

# Per-source accumulator columns (one row of `_SourceTotals`).
NLL, CORRECT, TARGETS, EXACT, DOCS = range(5)


def score_heldout(eval_step, params, batches, to_device, source_names,
                  answer_sources=()) -> dict:
  """Scores `params` on the held-out `batches`.

  Args:
    eval_step: jitted `(params, device batch) -> (metrics, predictions int [B, L],
      token nll float [B, L])`, aligned to the tokens (entry i: the guess for and the nll of
      token i; `glm5_jax.train.losses.token_logprobs`), as `glm5_jax.train.step.make_eval_step`.
    batches: local numpy batches (`glm5_jax.data.make_eval_batches`).
    to_device: local numpy batch -> global device arrays.
    source_names: what a batch's `source_id` indexes.
    answer_sources: names of retrieval sources, which also get `<name>/exact_match`: the
      fraction of examples with every answer token right.
  Returns:
    `{metric: mean over batches}` plus `<source>/loss`, `<source>/token_accuracy` (and
    `<source>/exact_match`) for each source with targets; {} when there are no batches.
  """
  if not batches:
    return {}
  sums, count = {}, 0
  totals = {name: np.zeros(5) for name in source_names}
  for batch in batches:
    metrics, predictions, nll = jax.device_get(eval_step(params, to_device(batch)))
    for k, v in metrics.items():
      sums[k] = sums.get(k, 0.0) + float(v)
    count += 1
    _accumulate_per_document(batch, np.asarray(predictions), np.asarray(nll), source_names,
                             totals)
  out = {k: v / count for k, v in sums.items()}
  for name, total in totals.items():
    if total[TARGETS]:
      out[f"{name}/loss"] = total[NLL] / total[TARGETS]
      out[f"{name}/token_accuracy"] = total[CORRECT] / total[TARGETS]
      if name in answer_sources:
        out[f"{name}/exact_match"] = total[EXACT] / max(total[DOCS], 1)
  return out


def _accumulate_per_document(batch, predictions_BL, nll_BL, source_names, totals):
  """Adds each packed document's (nll, correct, targets, all-correct, 1) to its source's row."""
  # Token 0 of a row is never a target: nothing predicts it.
  weights_BL = np.pad(np.asarray(target_weights(batch["segment_ids"], batch["loss_mask"], 1)),
                      ((0, 0), (1, 0))) > 0
  targets_BL = batch["tokens"]
  segments_BL = batch["segment_ids"]
  sources_BL = batch["source_id"]
  for row in range(targets_BL.shape[0]):
    for segment in np.unique(segments_BL[row][weights_BL[row]]):
      sel = weights_BL[row] & (segments_BL[row] == segment)
      total = totals[source_names[int(sources_BL[row][sel][0])]]
      right = predictions_BL[row][sel] == targets_BL[row][sel]
      total += (nll_BL[row][sel].sum(), right.sum(), sel.sum(), float(right.all()), 1.0)
