"""Mixture sources: config defaults and validation per kind, held-out splits, document datasets.

A source is one entry of `data.sources` (name -> {kind, weight, ...options}). Kinds:

  python_stdlib  the `.py` files of this Python's standard library
                 (`sysconfig.get_paths()["stdlib"]`, `*-packages` excluded): real code text that
                 every Python install has. Held out by file: hash of the path relative to the
                 stdlib root. Deterministic given the same Python version.
  text_files     `glob` of UTF-8 text files, one document per file; held out by file. A binary
                 file (NUL bytes or invalid UTF-8 at its start) is refused, named.
  jsonl          `glob` of JSON-lines files; each line's `text_field` string is a document; held
                 out by part (see below), so a single file still gets a held-out share.
  chat_jsonl     `glob` of JSON-lines files of conversations for SFT: each line is an object whose
                 `messages_field` ("messages") holds a list of message dicts, rendered by
                 `glm5_jax.data.chat.render` in `thinking_mode` into one document whose loss mask
                 is 1 on the assistant's tokens only (no bos/eos added: the rendering starts with
                 `[gMASK]<sop>` and ends its last assistant turn with eos). Held out by part, like
                 jsonl. A conversation longer than seq_len is cut to its first seq_len tokens
                 (`overlong="truncate"`; the prefix keeps every kept token's context, where
                 splitting it like a text document would train later turns without their
                 prompt), each cut logged with file:line and a running count; or refused
                 (`overlong="error"`, naming file:line). Every line is checked when the source
                 is opened, before any training: a malformed line (not JSON, no such field, a
                 bad message) or one with nothing to train (no assistant turn) raises naming
                 file:line.
  array_record   `glob` of ArrayRecord files, one document per record; held out by record.
                 `format="text"`: records are UTF-8 text. `format="tokens"`: records are the raw
                 little-endian int32 token ids of one document (`np.asarray(ids, "<i4")
                 .tobytes()`), without bos/eos, which the pipeline adds as for text.
  synthetic      `task` from `glm5_jax.data.synthetic.TASKS` with that task's options; lengths
                 drawn from [min_length, max_length] (None: max_length = seq_len, min_length =
                 max_length // 2); `depth` None = uniform. Held-out = a different seed stream.

Every source becomes a `grain.MapDataset` of records (file parts, record indices or example
indices) that is held-out filtered, sharded by process (`[process_index::process_count]`),
shuffled and repeated with reshuffling per epoch, and mapped lazily to a list of documents; each
document is {tokens int32, loss_mask float32, source_id int32} of one length.

Text files are read in *parts* of about `part_bytes` (None: 4 * seq_len) bytes, cut at line
starts: record (file, k) covers the lines starting in [k, k+1) * part_bytes, so listing needs
only file sizes (no read at startup), a record reads only its bytes, and a big file's pieces are
spread over the epoch by the shuffle instead of arriving as one long run of chunks. A file's
first part starts with bos and its last part ends with eos. Tokenized records are kept in a
per-source LRU cache (`token_cache_size` records) so later epochs skip reading and tokenizing.
"""

import functools
import glob as globlib
import json
import os
import sysconfig

from absl import logging
import grain
import ml_collections
import numpy as np

from glm5_jax.config import ConfigError, check_fields, require
from glm5_jax.data import chat, file_checks, liveness, synthetic
from glm5_jax.seeds import crc32_seed, unit_hash

FILE_KINDS = ("python_stdlib", "text_files", "jsonl", "chat_jsonl")
KIND_OPTIONS = {
    "python_stdlib": dict(holdout_fraction=0.05, part_bytes=None),
    "text_files": dict(glob="", holdout_fraction=0.05, part_bytes=None),
    "jsonl": dict(glob="", text_field="text", holdout_fraction=0.05, part_bytes=None),
    "chat_jsonl": dict(glob="", messages_field="messages", thinking_mode="interleaved",
                       overlong="truncate", holdout_fraction=0.05, part_bytes=None),
    "array_record": dict(glob="", format="text", holdout_fraction=0.05),
    "synthetic": dict(task="niah_single", min_length=None, max_length=None, depth=None),
}
ARRAY_RECORD_FORMATS = ("text", "tokens")
OVERLONG = ("truncate", "error")
# Types of the options whose default is None (for `source_config`'s typed placeholders).
OPTIONAL_TYPES = dict(part_bytes=int, min_length=int, max_length=int, depth=float, num_pairs=int)
SPLITS = ("train", "eval")
# Synthetic example indices run over [0, SYNTHETIC_INDICES): effectively infinite, no repeat.
SYNTHETIC_INDICES = 2**62


def _allowed_options(kind, task=None):
  if kind not in KIND_OPTIONS:
    raise ValueError(f"unknown source kind {kind!r}; known: {sorted(KIND_OPTIONS)}")
  options = dict(kind=kind, weight=1.0, **KIND_OPTIONS[kind])
  if kind == "synthetic":
    options.update(synthetic.task_options(task or options["task"]))
  return options


def source_config(kind: str, **options) -> ml_collections.ConfigDict:
  """One source entry with every option of its kind (and task) at its default.

  Options that default to None become typed placeholders, so `--config.data.sources.NAME.depth=
  0.5` still parses on the command line.
  """
  spec = _allowed_options(kind, options.get("task"))
  spec.update(options)
  spec = {k: ml_collections.config_dict.placeholder(OPTIONAL_TYPES[k])
          if v is None and k in OPTIONAL_TYPES else v for k, v in spec.items()}
  return ml_collections.ConfigDict(spec)


def resolve_source(name, spec, seq_len) -> dict:
  """`spec` (ConfigDict or dict) with defaults filled in, validated; a `ConfigError` names the
  option as `config.data.sources.<name>.<option>`."""
  spec = dict(spec.to_dict() if hasattr(spec, "to_dict") else spec)
  where = f"data.sources.{name}"
  require("kind" in spec, f"{where}.kind", f"missing; known kinds: {sorted(KIND_OPTIONS)}")
  require(spec["kind"] in KIND_OPTIONS, f"{where}.kind",
          f"unknown source kind {spec['kind']!r}; known: {sorted(KIND_OPTIONS)}")
  try:
    allowed = _allowed_options(spec["kind"], spec.get("task"))
  except ValueError as e:  # an unknown synthetic task
    raise ConfigError(f"config.{where}.task: {e}") from None
  check_fields(spec, allowed, where, optional=tuple(allowed))
  spec = {**allowed, **spec}
  weight = spec["weight"]
  require(weight > 0, f"{where}.weight", f"weight must be a number > 0, got {weight!r}")
  kind = spec["kind"]
  if kind != "synthetic":
    require(0.0 <= spec["holdout_fraction"] < 1.0, f"{where}.holdout_fraction",
            f"must be in [0, 1), got {spec['holdout_fraction']}")
  if kind in ("text_files", "jsonl", "chat_jsonl", "array_record"):
    require(spec["glob"], f"{where}.glob", f"({kind}) set 'glob' to the files to read")
  if spec.get("part_bytes") is not None:
    require(spec["part_bytes"] > 0, f"{where}.part_bytes",
            f"must be > 0, got {spec['part_bytes']}")
  if kind == "chat_jsonl":
    require(spec["thinking_mode"] in chat.THINKING_MODES, f"{where}.thinking_mode",
            f"{spec['thinking_mode']!r}; known: {chat.THINKING_MODES}")
    require(spec["overlong"] in OVERLONG, f"{where}.overlong",
            f"{spec['overlong']!r}; known: {OVERLONG}")
    require(isinstance(spec["messages_field"], str) and spec["messages_field"],
            f"{where}.messages_field", "must name the JSON field holding the messages")
  if kind == "array_record":
    require(spec["format"] in ARRAY_RECORD_FORMATS, f"{where}.format",
            f"format {spec['format']!r}; known: {ARRAY_RECORD_FORMATS}")
  if kind == "synthetic":
    max_length = spec["max_length"] if spec["max_length"] is not None else seq_len
    min_length = spec["min_length"] if spec["min_length"] is not None else max_length // 2
    require(0 < min_length <= max_length <= seq_len, f"{where}.max_length",
            f"need 0 < min_length ({min_length}) <= max_length ({max_length}) <= seq_len "
            f"({seq_len})")
    depth = spec["depth"]
    require(depth is None or 0.0 <= depth <= 1.0, f"{where}.depth",
            f"must be None or in [0, 1], got {depth}")
    spec.update(min_length=min_length, max_length=max_length)
  return spec


# ---------------------------------------------------------------------------------------------
# Listing and held-out splits
# ---------------------------------------------------------------------------------------------


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def list_files(name, spec) -> tuple[str, list[str]]:
  """(root, sorted paths). Paths are hashed relative to `root` for the held-out split, so the
  split does not depend on where the files live."""
  if spec["kind"] == "python_stdlib":
    root = stdlib_root()
    pattern = os.path.join(root, "**", "*.py")
    paths = []
    for directory, subdirs, files in os.walk(root):
      subdirs[:] = [d for d in subdirs if not d.endswith("-packages")]
      paths += [os.path.join(directory, f) for f in files if f.endswith(".py")]
  else:
    pattern = os.path.expanduser(spec["glob"])
    paths = [p for p in globlib.glob(pattern, recursive=True) if os.path.isfile(p)]
  if not paths:
    raise FileNotFoundError(f"source {name!r} ({spec['kind']}): glob {pattern!r} matches no "
                            "files")
  paths = sorted(paths)
  root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
  if spec["kind"] == "python_stdlib":
    root = stdlib_root()
  return root, paths


def _unit_hash_array(key: str, n: int) -> np.ndarray:
  """Deterministic [0, 1) hashes of (key, 0..n-1): splitmix64 of a key hash plus the index."""
  x = np.arange(n, dtype=np.uint64) + np.uint64(int(unit_hash(key) * 2**63))
  x = x + np.uint64(0x9E3779B97F4A7C15)
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  x = x ^ (x >> np.uint64(31))
  return (x >> np.uint64(11)).astype(np.float64) / 2.0**53


def _in_split(hash_value, fraction, split):
  return (hash_value < fraction) == (split == "eval")


def file_part_records(name, spec, seq_len, split) -> list[tuple[str, int, int]]:
  """(path, part, num_parts) records of a file-based source in `split` (see module doc).
  text_files and chat_jsonl files are checked first (`file_checks.check_file`)."""
  root, paths = list_files(name, spec)
  part_bytes = spec["part_bytes"] or 4 * seq_len
  fraction = spec["holdout_fraction"]
  records = []
  if spec["kind"] in ("text_files", "chat_jsonl"):
    options = tuple((k, spec[k]) for k in ("messages_field", "thinking_mode") if k in spec)
    for path in paths:
      stat = os.stat(path)
      file_checks.check_file(name, spec["kind"], options, path, stat.st_size,
                             stat.st_mtime_ns)
  for path in paths:
    rel = os.path.relpath(os.path.abspath(path), root)
    num_parts = -(-os.path.getsize(path) // part_bytes)
    if spec["kind"] in ("jsonl", "chat_jsonl"):  # held out by part
      records += [(path, k, num_parts) for k in range(num_parts)
                  if _in_split(unit_hash(f"{rel}#{k}"), fraction, split)]
    elif _in_split(unit_hash(rel), fraction, split):  # held out by file
      records += [(path, k, num_parts) for k in range(num_parts)]
  return records


def array_record_records(name, spec, split):
  """(data source over all files, global indices of the records in `split`)."""
  root, paths = list_files(name, spec)
  indices, offset = [], 0
  for path in paths:
    try:
      n = len(grain.sources.ArrayRecordDataSource([path]))
    except Exception as e:  # pylint: disable=broad-except  # array_record raises bare errors
      raise ValueError(f"source {name!r} (array_record): {path}: not a readable ArrayRecord "
                       f"file ({type(e).__name__}: {e}); narrow the glob") from None
    keep = _in_split(_unit_hash_array(os.path.relpath(path, root), n),
                     spec["holdout_fraction"], split)
    indices.append(offset + np.nonzero(keep)[0])
    offset += n
  return grain.sources.ArrayRecordDataSource(paths), np.concatenate(indices)


# ---------------------------------------------------------------------------------------------
# Reading records into documents
# ---------------------------------------------------------------------------------------------


def _line_start_at_or_after(f, offset):
  """The first offset >= `offset` that starts a line (or the file size)."""
  if offset <= 0:
    return 0
  f.seek(offset - 1)
  position = offset - 1
  while True:
    block = f.read(1 << 14)
    if not block:
      return position
    newline = block.find(b"\n")
    if newline >= 0:
      return position + newline + 1
    position += len(block)


def read_part(path: str, part: int, part_bytes: int) -> bytes:
  """The lines of `path` that start in [part, part + 1) * part_bytes; parts tile the file."""
  return read_part_at(path, part, part_bytes)[1]


def read_part_at(path: str, part: int, part_bytes: int) -> tuple[int, bytes]:
  """(byte offset of the part's first line, `read_part`)."""
  with open(path, "rb") as f:
    start = _line_start_at_or_after(f, part * part_bytes)
    end = _line_start_at_or_after(f, (part + 1) * part_bytes)
    f.seek(start)
    return start, f.read(max(0, end - start))


def line_number(path: str, offset: int, line_in_part: int) -> int:
  """The 1-based line number of line `line_in_part` of the part starting at byte `offset` (reads
  the file up to there: for error messages only)."""
  with open(path, "rb") as f:
    return f.read(offset).count(b"\n") + line_in_part + 1


def _document(ids, *, answer_mask=None, source_id):
  ids = np.asarray(ids, np.int32)
  mask = np.ones(len(ids), np.float32) if answer_mask is None else answer_mask
  return dict(tokens=ids, loss_mask=mask, source_id=np.full(len(ids), source_id, np.int32))


class _ReadRecord(grain.transforms.Map):
  """record -> list of documents, tokenized; the last `cache_size` results are cached."""

  def __init__(self, name, spec, tokenizer, seq_len, source_id, cache_size, data_source=None):
    self._name, self._spec, self._tok, self._seq_len = name, spec, tokenizer, seq_len
    self._part_bytes = spec.get("part_bytes") or 4 * seq_len
    if spec["kind"] == "chat_jsonl":
      chat.special_ids(tokenizer)  # a tokenizer without the chat specials fails here, not mid-run
    self._num_truncated = 0
    self._source_id = source_id
    self._data_source = data_source
    self._cache_size = cache_size
    self._cached = None  # built lazily: an lru_cache does not pickle (grain mp_prefetch workers)

  def __getstate__(self):
    return {**self.__dict__, "_cached": None}

  def map(self, record):
    if self._cached is None:
      self._cached = functools.lru_cache(maxsize=self._cache_size)(self._read)
    return self._cached(record if isinstance(record, tuple) else int(record))

  def _with_specials(self, ids, bos=True, eos=True):
    parts = [[self._tok.bos_id]] * bos + [ids] + [[self._tok.eos_id]] * eos
    return np.concatenate([np.asarray(p, np.int32) for p in parts])

  def _read(self, record):
    kind = self._spec["kind"]
    if kind == "array_record":
      ids = self._record_ids(self._data_source[record], record)
      return [_document(self._with_specials(ids), source_id=self._source_id)]
    path, part, num_parts = record
    if kind == "chat_jsonl":
      start, data = read_part_at(path, part, self._part_bytes)
      return [self._conversation(line, path, start, k)
              for k, line in enumerate(data.split(b"\n")) if line.strip()]
    start, data = read_part_at(path, part, self._part_bytes)
    if kind == "jsonl":
      texts = [self._json_text(line, path, start, k) for k, line in enumerate(data.split(b"\n"))
               if line.strip()]
      return [_document(self._with_specials(self._tok.encode_array(t)),
                        source_id=self._source_id) for t in texts]
    if not data:
      return []
    if b"\0" in data:
      raise ValueError(f"source {self._name!r} ({kind}): {path}: binary data (a NUL byte) in a "
                       "text file; text_files reads text only: narrow the glob")
    ids = self._tok.encode_array(data.decode("utf-8", errors="replace"))
    ids = self._with_specials(ids, bos=part == 0, eos=part == num_parts - 1)
    return [_document(ids, source_id=self._source_id)]

  def _json_text(self, line, path, offset, k):
    field = self._spec["text_field"]
    try:
      text = json.loads(line)[field]
    except (ValueError, KeyError, TypeError, IndexError) as e:
      raise ValueError(f"source {self._name!r}: {path}:{line_number(path, offset, k)}: not a "
                       f"JSON object with a string field {field!r} ({e!r})") from None
    if not isinstance(text, str):
      raise ValueError(f"source {self._name!r}: {path}:{line_number(path, offset, k)}: field "
                       f"{field!r} is {type(text).__name__}, not a string")
    return text

  def _conversation(self, line, path, offset, k):
    """One jsonl line -> the document of its rendered conversation (module docstring)."""
    def where():
      return f"source {self._name!r}: {path}:{line_number(path, offset, k)}"

    field = self._spec["messages_field"]
    try:
      messages = json.loads(line)[field]
    except (ValueError, KeyError, TypeError, IndexError) as e:
      raise ValueError(f"{where()}: not a JSON object with a field {field!r} ({e!r})") from None
    try:
      rendered = chat.render(messages, self._tok, thinking_mode=self._spec["thinking_mode"])
    except ValueError as e:
      raise ValueError(f"{where()}: {e}") from None
    n = len(rendered.ids)
    if n > self._seq_len:
      if self._spec["overlong"] == "error":
        raise ValueError(f"{where()}: the conversation has {n} tokens > seq_len "
                         f"{self._seq_len}; raise seq_len, shorten it, or set "
                         f"config.data.sources.{self._name}.overlong='truncate'")
      self._num_truncated += 1
      if self._num_truncated <= 10 or self._num_truncated % 100 == 0:
        logging.warning("%s: conversation of %d tokens cut to seq_len %d (%d cut so far by "
                        "this reader)", where(), n, self._seq_len, self._num_truncated)
      rendered = chat.Rendered(*(x[:self._seq_len] for x in rendered))
    return _document(rendered.ids, answer_mask=rendered.loss_mask, source_id=self._source_id)

  def _record_ids(self, data, index):
    if self._spec["format"] == "text":
      return self._tok.encode_array(data.decode("utf-8", errors="replace"))
    if len(data) % 4:
      raise ValueError(f"source {self._name!r}: record {index} has {len(data)} bytes, not a "
                       "multiple of 4: format='tokens' records are little-endian int32 ids")
    ids = np.frombuffer(data, "<i4").astype(np.int32)
    if len(ids) and (ids.min() < 0 or ids.max() >= self._tok.vocab_size):
      raise ValueError(f"source {self._name!r}: record {index} has token ids outside "
                       f"[0, {self._tok.vocab_size})")
    return ids


class _SyntheticRecord(grain.transforms.Map):
  """example index -> [document] of the source's synthetic task."""

  def __init__(self, name, spec, tokenizer, seq_len, source_id, seed, split):
    self._name, self._tok, self._seq_len, self._source_id = name, tokenizer, seq_len, source_id
    self._task = spec["task"]
    self._options = {k: spec[k] for k in synthetic.task_options(self._task)}
    self._length = (spec["min_length"], spec["max_length"])
    self._depth = spec["depth"]
    self._seed, self._stream, self._salt = seed, SPLITS.index(split), crc32_seed(name)
    # Fail at build time, not mid-run, when the task cannot fit: examples built with no filler.
    shortest = max(len(self._generate(i, length=1).tokens) for i in range(64))
    self._check_fits(shortest, "at least ")

  def _generate(self, index, length):
    return synthetic.generate(
        self._task, self._tok, index, length=length, seed=self._seed, stream=self._stream,
        salt=self._salt, depth=self._depth, strict=False, **self._options)

  def _check_fits(self, num_tokens, qualifier=""):
    if num_tokens > self._seq_len:
      raise ValueError(
          f"source {self._name!r}: {self._task} examples with options {self._options} need "
          f"{qualifier}{num_tokens} tokens > seq_len {self._seq_len}; raise seq_len or make "
          "the task smaller")

  def map(self, index):
    example = self._generate(int(index), self._length)
    self._check_fits(len(example.tokens))
    return [_document(example.tokens, answer_mask=example.loss_mask, source_id=self._source_id)]


def shuffle_seed(seed, name, split) -> int:
  """Per-source, per-split shuffle seed in [0, 2**32) (grain's range)."""
  return crc32_seed(seed, name, split)


def document_dataset(name, spec, *, split, source_id, tokenizer, seq_len, seed,
                     process_index=0, process_count=1, cache_size=4096) -> grain.MapDataset:
  """Infinite `grain.MapDataset` of document lists for one resolved source (see module doc)."""
  return _documents(name, spec, split=split, source_id=source_id, tokenizer=tokenizer,
                    seq_len=seq_len, seed=seed, process_index=process_index,
                    process_count=process_count, cache_size=cache_size)[0]


def document_stream(name, spec, *, read_options, **kwargs) -> grain.IterDataset:
  """`document_dataset(name, spec, **kwargs)` read in order, as a `grain.IterDataset` that
  raises `liveness.EmptySourceError` instead of spinning when the source holds no document."""
  docs, num_records = _documents(name, spec, **kwargs)
  stream = docs.to_iter_dataset(read_options)
  if num_records is None:  # synthetic: every index is an example
    return stream
  return stream.map(liveness.RequireDocuments(
      name, spec, kwargs["split"], num_records, functools.partial(list_files, name, spec)))


def _documents(name, spec, *, split, source_id, tokenizer, seq_len, seed, process_index=0,
               process_count=1, cache_size=4096) -> tuple[grain.MapDataset, int | None]:
  """(`document_dataset`, this process's records per epoch; None for synthetic sources)."""
  if split not in SPLITS:
    raise ValueError(f"split {split!r}; known: {SPLITS}")
  kind = spec["kind"]
  if kind == "synthetic":
    ds = grain.MapDataset.range(SYNTHETIC_INDICES)[process_index::process_count]
    return ds.map(_SyntheticRecord(name, spec, tokenizer, seq_len, source_id, seed, split)), None
  data_source = None
  if kind == "array_record":
    data_source, records = array_record_records(name, spec, split)
  else:
    records = file_part_records(name, spec, seq_len, split)
  if len(records) < process_count:
    raise liveness.EmptySourceError(liveness.too_few_records(
        name, spec, split, len(records), process_count, seq_len, list_files(name, spec)[1]))
  ds = grain.MapDataset.source(records)[process_index::process_count]
  num_records = len(ds)
  ds = ds.shuffle(shuffle_seed(seed, name, split)).repeat()
  reader = _ReadRecord(name, spec, tokenizer, seq_len, source_id, cache_size, data_source)
  return ds.map(reader), num_records
