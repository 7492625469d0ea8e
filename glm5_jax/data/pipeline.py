"""The data pipeline: config defaults, validation, and checkpointable grain iterators.

Per process, everything below is grain except the marked (hand-written) pieces:

  each source: MapDataset of records (file parts / record ids / example ids)         sources.py
               -> held-out split -> [process_index::process_count] -> shuffle -> repeat
               (reshuffled every epoch) -> map: read + tokenize (*LRU-cached*)
               -> to_iter_dataset -> map: *raise if the source holds no document*  liveness.py
               -> flat map: *split documents into <= seq_len chunks*                packing.py
  IterDataset.mix({name: source}, weights)      chunks drawn in proportion to the weights
  -> FirstFitPackIterDataset -> map: rename keys -> batch(local rows)                packing.py
  -> ThreadPrefetchIterDataset (`prefetch` batches ahead) or mp_prefetch (`worker_count`)

No stage waits without bound: a file source whose records hold no document (e.g. a jsonl of
blank lines) raises `liveness.EmptySourceError` naming it after 2n - 1 empty records in a row
(n records per epoch: proof that none holds a document) instead of letting the flat map search
forever; a split with too few records is refused at build time with what to change. Synthetic
examples always exist.

Weights count documents (chunks of at most seq_len tokens), not tokens. The iterator state is a
small JSON-able dict (each source's next record index and position within the current record,
the mixer's index, the packer's row), so `grain.checkpoint.CheckpointSave(iterator)` /
`CheckpointRestore(iterator)` store it in an orbax checkpoint, and restoring it into a freshly
built iterator continues with exactly the batches the uninterrupted one would have produced.
Everything is deterministic given `seed`, the data files and `worker_count` (with worker
processes each packs its own slice, so changing `worker_count` changes the stream; grain's
workers also need absl flags parsed, as under `absl.app.run`, and a `__main__` guard).

Batch (local rows B = batch_size // process_count, L = seq_len), all numpy:
  tokens int32 [B, L]       token ids; `pad_id` in padding
  segment_ids int32 [B, L]  packed documents 1, 2, 3, ... per row; padding 0
  positions int32 [B, L]    0, 1, ... from each document's start (padding 0)
  loss_mask float32 [B, L]  1 where this token is a target: every text token, only the answer
                            tokens of synthetic examples and the assistant's tokens of chat
                            conversations (`chat.render`); 0 on padding. (The first token of a
                            document has no in-document context: the loss code drops it by
                            segment id.)
  source_id int32 [B, L]    index into `source_names(data_cfg)`; -1 in padding
"""

import atexit
import weakref

import grain
import ml_collections

from glm5_jax.config import check_fields, require
from glm5_jax.data import packing, sources
from glm5_jax.data.tokenizers import make_tokenizer
from glm5_jax.seeds import crc32_seed

SYNTHETIC_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "mqar")


def default_sources() -> ml_collections.ConfigDict:
  """Half Python-stdlib text, half synthetic retrieval spread evenly over the five tasks."""
  mix = dict(python_stdlib=sources.source_config("python_stdlib", weight=0.5))
  for task in SYNTHETIC_TASKS:
    mix[task] = sources.source_config("synthetic", task=task, weight=0.5 / len(SYNTHETIC_TASKS))
  return ml_collections.ConfigDict(mix)


def data_config(**overrides) -> ml_collections.ConfigDict:
  """The data defaults, with `overrides` applied (`sources=` replaces the whole mixture)."""
  c = ml_collections.ConfigDict()
  c.tokenizer = "byte"  # "byte" or a path to an HF tokenizer.json (or its directory)
  c.seq_len = 256  # tokens per packed row (the default synthetic mix needs >= ~210, bytes)
  c.batch_size = 8  # global rows per step; each process gets batch_size // process_count
  c.seed = 0
  # rows packed together by first fit; None = the local batch size
  c.packing_bins = ml_collections.config_dict.placeholder(int)
  c.prefetch = 2  # batches built ahead in a background thread; 0 = build on demand
  c.worker_count = 0  # > 0: build batches in that many grain worker processes instead
  c.read_threads = 0  # grain ReadOptions.num_threads per source (0: read in the pipeline thread)
  c.token_cache_size = 4096  # tokenized records kept per source (LRU); 0 = no cache
  c.sources = default_sources()
  if "sources" in overrides:
    c.sources = ml_collections.ConfigDict(overrides.pop("sources"))
  c.update(overrides)
  return c


def source_names(data_cfg) -> list[str]:
  """The sorted source names; `source_id` in a batch indexes this list."""
  return sorted(data_cfg.sources.keys())


def validate_data_config(data_cfg, *, process_count: int = 1) -> dict:
  """Checks every field; returns {name: resolved source spec}. Raises `ConfigError` naming the
  field (`config.data.<field>`, `config.data.sources.<name>.<option>`)."""
  check_fields(data_cfg, data_config(), "data")
  require(data_cfg.seq_len >= 2, "data.seq_len", f"must be an int >= 2, got {data_cfg.seq_len}")
  require(data_cfg.batch_size >= 1, "data.batch_size",
          f"must be an int >= 1, got {data_cfg.batch_size}")
  require(process_count >= 1 and data_cfg.batch_size % process_count == 0, "data.batch_size",
          f"{data_cfg.batch_size} is not divisible by process_count {process_count}")
  require(data_cfg.packing_bins is None or data_cfg.packing_bins >= 1, "data.packing_bins",
          f"must be None or >= 1, got {data_cfg.packing_bins}")
  for field in ("prefetch", "worker_count", "read_threads", "token_cache_size"):
    require(data_cfg[field] >= 0, f"data.{field}", f"must be >= 0, got {data_cfg[field]}")
  require(len(data_cfg.sources) > 0, "data.sources", "is empty; name at least one source")
  return {name: sources.resolve_source(name, data_cfg.sources[name], data_cfg.seq_len)
          for name in source_names(data_cfg)}


def make_dataset(data_cfg, *, split: str = "train", process_index: int = 0,
                 process_count: int = 1) -> grain.IterDataset:
  """The `grain.IterDataset` of local batches (see the module docstring). `split="eval"` mixes
  the held-out data of the sources that have any (synthetic: a separate seed stream; file
  sources with holdout_fraction 0 are left out).

  The data library's entry point (evaluation calls it with a checkpoint's `data` section,
  tests with bare ones), so it checks `data_cfg` itself: `validate_data_config` is also what
  fills each source's defaults.
  """
  specs = validate_data_config(data_cfg, process_count=process_count)
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} not in [0, {process_count})")
  tokenizer = make_tokenizer(data_cfg.tokenizer)
  names = source_names(data_cfg)
  read_options = grain.ReadOptions(num_threads=data_cfg.read_threads,
                                   prefetch_buffer_size=4 * data_cfg.read_threads)
  mixture, weights = {}, {}
  for source_id, name in enumerate(names):
    spec = specs[name]
    if split == "eval" and spec["kind"] != "synthetic" and spec["holdout_fraction"] == 0:
      continue
    docs = sources.document_stream(
        name, spec, read_options=read_options, split=split, source_id=source_id,
        tokenizer=tokenizer, seq_len=data_cfg.seq_len, seed=data_cfg.seed,
        process_index=process_index, process_count=process_count,
        cache_size=data_cfg.token_cache_size)
    mixture[name] = grain.experimental.FlatMapIterDataset(
        docs, packing.SplitIntoChunks(data_cfg.seq_len))
    weights[name] = float(spec["weight"])
  if not mixture:
    raise ValueError("no source has held-out data: every file source has holdout_fraction 0 "
                     "and there is no synthetic source")
  local_batch = data_cfg.batch_size // process_count
  ds = packing.pack_and_batch(
      grain.IterDataset.mix(mixture, weights), seq_len=data_cfg.seq_len,
      batch_size=local_batch, num_bins=data_cfg.packing_bins or local_batch,
      seed=crc32_seed(data_cfg.seed, "pack", split), pad_id=tokenizer.pad_id)
  if data_cfg.worker_count:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=data_cfg.worker_count))
  elif data_cfg.prefetch:
    ds = grain.experimental.ThreadPrefetchIterDataset(
        ds, prefetch_buffer_size=data_cfg.prefetch)
  return ds


def make_train_iterator(data_cfg, *, process_index: int = 0,
                        process_count: int = 1) -> grain.DatasetIterator:
  """A checkpointable iterator of this process's training batches (infinite).

  Save/restore with the train state in one orbax checkpoint:
    ocp.args.Composite(..., data=grain.checkpoint.CheckpointSave(iterator))
    ocp.args.Composite(..., data=grain.checkpoint.CheckpointRestore(iterator))
  (restore into a freshly built iterator), or `get_state()` / `set_state(state)` directly.
  """
  iterator = iter(make_dataset(data_cfg, split="train", process_index=process_index,
                               process_count=process_count))
  _close_at_exit(iterator)
  return iterator


def _close_at_exit(iterator):
  """Closes the iterator (stopping its prefetch thread) before interpreter teardown.

  grain 0.2.18's `ThreadPrefetchDatasetIterator.close` is not idempotent, and `__del__` calls it
  again during teardown, after module globals are gone ("'NoneType' object has no attribute
  ..."); so after closing, the instance's `close` becomes a no-op. Holds a weak reference only.
  """
  ref = weakref.ref(iterator)

  def close():
    if (live := ref()) is not None:
      live.close()
      live.close = lambda: None

  atexit.register(close)


def make_eval_batches(data_cfg, *, num_batches: int, process_index: int = 0,
                      process_count: int = 1) -> list[dict]:
  """`num_batches` local batches of held-out data; the same on every call."""
  data_cfg = ml_collections.ConfigDict(data_cfg.to_dict())
  data_cfg.prefetch, data_cfg.worker_count = 0, 0
  iterator = iter(make_dataset(data_cfg, split="eval", process_index=process_index,
                               process_count=process_count))
  return [next(iterator) for _ in range(num_batches)]
