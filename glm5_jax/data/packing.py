"""Documents -> packed rows -> batches, on grain's packing and batching.

grain provides the packing itself: `grain.experimental.FirstFitPackIterDataset` places whole
documents into `num_packing_bins` rows of `seq_len` (first fit), numbers them 1, 2, ... per row
(`*_segment_ids`, 0 = padding), restarts `*_positions` at 0 for each document, pads, and
checkpoints as (parent state, row index): nothing buffered is saved.

Written here, because grain lacks it:
  `SplitIntoChunks`: splits a document longer than `seq_len` into consecutive chunks of at most
    `seq_len` tokens (first-fit packing rejects longer inputs). grain's
    `ConcatThenSplitIterDataset` splits too, but it cuts every document at row ends, which would
    separate a synthetic task's answer from its context; here only over-long documents are cut,
    and each chunk is its own segment (positions restart, no attention across the cut).
  `to_batch_keys`: renames grain's per-feature `tokens_segment_ids`/`tokens_positions` to the
    trainer's `segment_ids`/`positions` and drops the duplicates for the other features.
"""

import grain

FEATURES = ("tokens", "loss_mask", "source_id")
BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask", "source_id")


class SplitIntoChunks(grain.experimental.FlatMapTransform):
  """A list of documents -> their chunks of at most `max_len` tokens, in order."""

  max_fan_out = 1 << 20  # only read by grain's MapDataset flat map; this runs on IterDatasets

  def __init__(self, max_len: int):
    self.max_len = max_len

  def flat_map(self, documents):
    chunks = []
    for doc in documents:
      n = len(doc["tokens"])
      chunks += [{k: v[i:i + self.max_len] for k, v in doc.items()}
                 for i in range(0, n, self.max_len)]
    return chunks


def to_batch_keys(row):
  return dict(
      tokens=row["tokens"],
      segment_ids=row["tokens_segment_ids"],
      positions=row["tokens_positions"],
      loss_mask=row["loss_mask"],
      source_id=row["source_id"],
  )


def pack_and_batch(documents: grain.IterDataset, *, seq_len: int, batch_size: int,
                   num_bins: int, seed: int, pad_id: int) -> grain.IterDataset:
  """Chunks of at most `seq_len` tokens -> batches of `batch_size` packed rows.

  Each row of the result holds whole chunks; a row's documents get segment ids 1, 2, ... and
  positions from 0; padding has segment id 0, position 0, token `pad_id`, loss_mask 0 and
  source_id -1. Bins are shuffled (seeded) before they are emitted.
  """
  rows = grain.experimental.FirstFitPackIterDataset(
      documents,
      length_struct={k: seq_len for k in FEATURES},
      num_packing_bins=num_bins,
      seed=seed,
      shuffle_bins=True,
      padding_struct=dict(tokens=pad_id, loss_mask=0.0, source_id=-1),
  )
  return rows.map(to_batch_keys).batch(batch_size, drop_remainder=True)

