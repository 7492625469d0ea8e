"""Data pipeline: tokenizers, synthetic tasks, packing, mixing, resume, sharding, held-out data."""

import json
import re
import string

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tokenizers

from glm5_jax import data
from glm5_jax.config import ConfigError
from glm5_jax.data import sources, synthetic

TOK = data.make_tokenizer("byte")


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert sorted(x) == sorted(y)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def segments(batch):
  """Yields (source_id, tokens, loss_mask) of every packed document in a batch."""
  for row in range(batch["tokens"].shape[0]):
    seg = batch["segment_ids"][row]
    for s in range(1, seg.max() + 1):
      sel = seg == s
      yield (int(batch["source_id"][row][sel][0]), batch["tokens"][row][sel],
             batch["loss_mask"][row][sel])


def check_packing(batch, seq_len):
  """Per row: documents 1..k contiguous from the start then padding; positions restart at 0;
  one source per document; padding is never a target and has source_id -1."""
  assert all(v.shape == (batch["tokens"].shape[0], seq_len) for v in batch.values())
  for row in range(batch["tokens"].shape[0]):
    seg, pos = batch["segment_ids"][row], batch["positions"][row]
    used = int((seg > 0).sum())
    assert np.all(seg[used:] == 0) and np.all(np.diff(seg[:used]) >= 0), seg
    assert not used or seg[0] == 1
    assert set(np.unique(seg[:used])) == set(range(1, seg.max() + 1))
    for s in range(1, seg.max() + 1):
      np.testing.assert_array_equal(pos[seg == s], np.arange((seg == s).sum()))
      assert len(np.unique(batch["source_id"][row][seg == s])) == 1
  padding = batch["segment_ids"] == 0
  assert not batch["loss_mask"][padding].any()
  assert np.all(batch["source_id"][padding] == -1)
  assert np.all(batch["tokens"][padding] == TOK.pad_id)
  assert np.all(batch["source_id"][~padding] >= 0)
  assert batch["tokens"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32


def write_docs(directory, n, *, long_every=0):
  """n text files "doc-007 ..." of varied lengths; every `long_every`-th one is long."""
  rng = np.random.default_rng(0)
  directory.mkdir(parents=True, exist_ok=True)
  texts = {}
  for i in range(n):
    words = int(rng.integers(2, 12)) * (20 if long_every and i % long_every == 0 else 1)
    nouns = rng.choice(synthetic.NOUNS, size=words)
    text = f"doc-{i:03d} " + " ".join(nouns)
    (directory / f"doc-{i:03d}.txt").write_text(text)
    texts[i] = text
  return texts


def text_config(glob, **overrides):
  source = data.source_config("text_files", glob=glob, weight=1.0, part_bytes=1 << 20,
                              holdout_fraction=overrides.pop("holdout_fraction", 0.0))
  return data.data_config(seq_len=64, batch_size=4, sources=dict(docs=source), **overrides)


def doc_ids(batches):
  """The ids of the "doc-007 ..." documents (or their first chunks) in the batches."""
  return {int(m) for b in batches for _, tokens, _ in segments(b)
          for m in re.findall(r"doc-(\d+)", TOK.decode(tokens))}


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
  text = "def f(x):\n  return x ** 2  # ünïcödé ✓ 数据"
  ids = TOK.encode(text)
  assert TOK.decode(ids) == text
  assert len({TOK.pad_id, TOK.bos_id, TOK.eos_id}) == 3 and TOK.pad_id == 0
  assert min(ids) > TOK.eos_id and max(ids) < TOK.vocab_size <= 384
  assert TOK.decode([TOK.bos_id] + ids + [TOK.eos_id]) == text
  assert TOK.decode([TOK.bos_id] + ids, skip_special=False) == "<bos>" + text
  assert TOK.encode("<bos>") == TOK.encode("<") + TOK.encode("bos>")  # text never makes specials
  data.check_vocab(TOK, 384)
  with pytest.raises(ValueError, match="vocab_size 276 > model vocab_size 256"):
    data.check_vocab(TOK, 256)


def test_hf_tokenizer_round_trip(tmp_path):
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([" ".join(synthetic.NOUNS)] * 10, trainer=trainer)
  tok.save(str(tmp_path / "tokenizer.json"))

  for path in (tmp_path / "tokenizer.json", tmp_path):  # the file or its directory
    hf = data.make_tokenizer(str(path))
    text = "The river crossed the mountain; ünïcödé 123!"
    assert hf.decode(hf.encode(text)) == text
    assert (hf.pad_id, hf.bos_id, hf.eos_id) == (0, 1, 2)
    assert hf.vocab_size == tok.get_vocab_size()
    np.testing.assert_array_equal(hf.encode_array(text), hf.encode(text))

  # Synthetic answers stay exact spans, and the pipeline runs on it.
  ex = synthetic.generate("niah_single", hf, 0, length=200)
  (start, end), = ex.answer_spans
  assert hf.decode(ex.tokens[start:end]) == ex.answers[0]
  cfg = data.data_config(tokenizer=str(tmp_path), prefetch=0)
  batch = next(data.make_train_iterator(cfg))
  assert batch["tokens"].max() < hf.vocab_size and (batch["segment_ids"] > 0).any()


def test_tokenizer_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="no/such/tokenizer.json"):
    data.make_tokenizer("no/such/tokenizer.json")
  (tmp_path / "bad.json").write_text("{}")
  with pytest.raises(ValueError, match="bad.json"):
    data.make_tokenizer(str(tmp_path / "bad.json"))


# ----------------------------------------------------------------------------------------------
# Synthetic tasks
# ----------------------------------------------------------------------------------------------


def check_answers_recoverable(ex, text_before_answer):
  """Every answer follows from the context, by the task's own rules."""
  ctx = text_before_answer
  if ex.task == "mqar":
    pairs = dict(re.findall(r"([a-z]+):(\d+)", ctx.split("\n")[0]))
    queried = re.findall(r"([a-z]+):", ctx.split("\n")[1] + ":")  # the prompt ends in "key:"
    assert [pairs[k] for k in queried] == [ex.answers[0]]
    return
  if ex.task == "copy":
    assert ctx.endswith("\n") and ctx[:-1] == ex.answers[0]  # the string, then a newline
    assert len(ex.tokens) >= 200 - 1  # fills the drawn length (to within one odd token)
    return
  if ex.task == "variable_tracking":
    value_of = {}
    for name, rhs in re.findall(r"VAR (\w+) = (\w+)\.", ctx):
      value_of[name] = value_of.get(rhs, rhs)  # a chain's statements come in order
    wanted = re.search(r"assigned the value (\d+)\?", ctx).group(1)
    assert [n for n, v in value_of.items() if v == wanted] == list(ex.answers)
    return
  needles = re.findall(r"The magic number for (\w+) is (\d+)\.", ctx)
  question = ctx.split("\nQ: ")[1]
  keys = re.search(r"for (.*)\?", question).group(1).split(", ")
  if ex.task == "niah_multivalue":
    assert [v for k, v in needles if k == keys[0]] == list(ex.answers)
  else:
    assert [dict(needles)[k] for k in keys] == list(ex.answers)
  if ex.task == "niah_multikey":
    assert len(needles) == 4 and len(keys) == 1
  if ex.task == "niah_multiquery":
    assert len(keys) == 2


@pytest.mark.parametrize("task", sorted(synthetic.TASKS))
def test_synthetic_task_answers_in_mask_and_recoverable(task):
  for index in range(20):
    ex = synthetic.generate(task, TOK, index, length=(200, 400), seed=3)
    assert ex.tokens.dtype == np.int32 and ex.loss_mask.shape == ex.tokens.shape
    assert ex.tokens[0] == TOK.bos_id and ex.tokens[-1] == TOK.eos_id
    expected_mask = np.zeros(len(ex.tokens))
    for (start, end), answer in zip(ex.answer_spans, ex.answers):
      expected_mask[start:end] = 1
      assert TOK.decode(ex.tokens[start:end]) == answer
    np.testing.assert_array_equal(ex.loss_mask, expected_mask)
    check_answers_recoverable(ex, TOK.decode(ex.tokens[:ex.prompt_len]))
    # Reproducible on its own; other indices differ.
    again = synthetic.generate(task, TOK, index, length=(200, 400), seed=3)
    np.testing.assert_array_equal(again.tokens, ex.tokens)
  other = synthetic.generate(task, TOK, 0, length=(200, 400), seed=4)
  assert not np.array_equal(other.tokens, synthetic.generate(task, TOK, 0, length=(200, 400),
                                                             seed=3).tokens)


@pytest.mark.parametrize("separator", ["", ":", "="])
def test_mqar_separator_places_every_answer_after_its_key(separator):
  for index in range(10):
    ex = synthetic.generate("mqar", TOK, index, length=96, key_chars=1, value_digits=1,
                            num_queries=8, separator=separator)
    context = TOK.decode(ex.tokens[1:ex.prompt_len]).split("\n")[0]
    pairs = dict(pair.split(separator) if separator else (pair[0], pair[1:])
                 for pair in context.split(" "))
    assert len(ex.answers) == 8
    for (start, _), answer in zip(ex.answer_spans, ex.answers):
      key = TOK.decode(ex.tokens[start - 1 - len(TOK.encode_array(separator)):start])
      assert key == pairs[key[0]][:0] + key[0] + separator and pairs[key[0]] == answer


@pytest.mark.parametrize("length", [300, 1000, 4000])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_synthetic_length_and_depth(length, depth):
  ex = synthetic.generate("niah_single", TOK, 7, length=length, depth=depth)
  assert length - 60 < len(ex.tokens) <= length  # short by less than one filler sentence
  text = TOK.decode(ex.tokens[1:ex.prompt_len])
  haystack = text.split("\nQ: ")[0]
  needle = haystack.index("The magic number for")
  assert abs(needle / len(haystack) - depth) < 0.1 + 60 / length


def test_copy_alphabets_and_minimum_length():
  letters = synthetic.generate("copy", TOK, 0, length=41, alphabet="letters")
  assert len(letters.tokens) == 41 and set(letters.answers[0]) <= set(string.ascii_lowercase)
  tiny = synthetic.generate("copy", TOK, 0, length=3, strict=False)
  assert len(tiny.answers[0]) == 2 and tiny.loss_mask.sum() == 2
  with pytest.raises(ValueError, match="copy: alphabet must be one of"):
    synthetic.generate("copy", TOK, 0, length=40, alphabet="greek")


def test_synthetic_errors():
  with pytest.raises(ValueError, match="needs .* tokens, more than length=50"):
    synthetic.generate("niah_multikey", TOK, 0, length=50)
  with pytest.raises(ValueError, match="unknown synthetic task 'nope'"):
    synthetic.generate("nope", TOK, 0, length=100)
  with pytest.raises(ValueError, match=r"unknown options \['num_values'\]"):
    synthetic.generate("niah_single", TOK, 0, length=100, num_values=2)


# ----------------------------------------------------------------------------------------------
# Pipeline
# ----------------------------------------------------------------------------------------------


def test_default_pipeline_batches():
  cfg = data.data_config()
  assert data.source_names(cfg) == sorted(
      ["python_stdlib", "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery",
       "mqar"])
  iterator = data.make_train_iterator(cfg)
  batches = take(iterator, 10)
  iterator.close()
  stdlib = data.source_names(cfg).index("python_stdlib")
  seen = set()
  for batch in batches:
    check_packing(batch, cfg.seq_len)
    assert batch["tokens"].shape == (cfg.batch_size, cfg.seq_len)
    for source_id, tokens, mask in segments(batch):
      seen.add(source_id)
      if source_id == stdlib:
        assert mask.all()
      else:  # synthetic: the only targets are answer digits
        assert 0 < mask.sum() < len(mask)
        assert re.fullmatch(r"\d+", TOK.decode(tokens[mask > 0]))
  assert seen == set(range(6))


def test_packing_splits_long_documents_and_keeps_documents_apart(tmp_path):
  texts = write_docs(tmp_path / "docs", 12, long_every=4)
  cfg = text_config(str(tmp_path / "docs" / "*.txt"), prefetch=0)
  chunks = set()
  for text in texts.values():
    ids = [TOK.bos_id] + TOK.encode(text) + [TOK.eos_id]
    chunks |= {tuple(ids[i:i + cfg.seq_len]) for i in range(0, len(ids), cfg.seq_len)}
  assert any(len(t) > 3 * cfg.seq_len for t in texts.values())  # some need several chunks
  seen = set()
  for batch in take(data.make_train_iterator(cfg), 40):
    check_packing(batch, cfg.seq_len)
    for _, tokens, mask in segments(batch):
      assert tuple(tokens) in chunks  # one document's chunk, never a mix of two
      assert mask.all()
      seen.add(tuple(tokens))
  assert seen == chunks


def test_epochs_are_reshuffled_and_seeds_matter(tmp_path):
  write_docs(tmp_path / "docs", 8)
  spec = sources.resolve_source("d", data.source_config(
      "text_files", glob=str(tmp_path / "docs" / "*.txt"), holdout_fraction=0.0), 64)

  def epochs(seed):  # the documents' order in each of the first three epochs
    ds = sources.document_dataset("d", spec, split="train", source_id=0, tokenizer=TOK,
                                  seq_len=64, seed=seed)
    order = [int(re.search(r"doc-(\d+)", TOK.decode(doc["tokens"])).group(1))
             for i in range(24) for doc in ds[i]]
    return [order[e * 8:(e + 1) * 8] for e in range(3)]

  orders = epochs(0)
  assert all(sorted(o) == list(range(8)) for o in orders)
  assert orders[0] != orders[1] != orders[2]
  assert epochs(0) == orders and epochs(1) != orders


def test_mixture_proportions_match_weights():
  mix = dict(
      a=data.source_config("synthetic", task="niah_single", weight=3.0, min_length=100),
      b=data.source_config("synthetic", task="mqar", weight=1.0, min_length=60, max_length=100),
      c=data.source_config("python_stdlib", weight=2.0))
  cfg = data.data_config(seq_len=128, batch_size=8, sources=mix, prefetch=0)
  counts = np.zeros(3)
  for batch in take(data.make_train_iterator(cfg), 60):
    for source_id, _, _ in segments(batch):
      counts[source_id] += 1
  np.testing.assert_allclose(counts / counts.sum(), [0.5, 1 / 6, 1 / 3], atol=0.03)


@pytest.mark.parametrize("which", ["default", "small_text"])
def test_resume_is_exact(tmp_path, which):
  if which == "default":
    cfg = data.data_config()
  else:  # a tiny corpus: several epochs (reshuffled) pass within the batches taken
    write_docs(tmp_path / "docs", 6, long_every=3)
    cfg = text_config(str(tmp_path / "docs" / "*.txt"))
  reference = data.make_train_iterator(cfg)
  expected = take(reference, 12)
  reference.close()

  iterator = data.make_train_iterator(cfg)
  assert_batches_equal(take(iterator, 5), expected[:5])
  state = json.loads(json.dumps(iterator.get_state()))
  iterator.close()
  resumed = data.make_train_iterator(cfg)
  resumed.set_state(state)
  assert_batches_equal(take(resumed, 7), expected[5:])
  resumed.close()

  if which == "default":  # through orbax, as the trainer saves it
    iterator = data.make_train_iterator(cfg)
    take(iterator, 5)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
      manager.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)))
      manager.wait_until_finished()
      fresh = data.make_train_iterator(cfg)
      manager.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
    assert_batches_equal(take(fresh, 7), expected[5:])
    iterator.close()
    fresh.close()


def test_process_shards_are_disjoint(tmp_path):
  write_docs(tmp_path / "docs", 30)
  cfg = text_config(str(tmp_path / "docs" / "*.txt"), prefetch=0)
  ids = []
  for process_index in range(2):
    iterator = data.make_train_iterator(cfg, process_index=process_index, process_count=2)
    batches = take(iterator, 20)
    assert all(b["tokens"].shape == (2, cfg.seq_len) for b in batches)
    ids.append(doc_ids(batches))
  assert ids[0] and ids[1] and not ids[0] & ids[1]
  assert ids[0] | ids[1] == set(range(30))
  with pytest.raises(ConfigError, match="config.data.batch_size: 4 is not divisible by "
                     "process_count 3"):
    data.make_train_iterator(cfg, process_count=3)


def test_heldout_data_is_disjoint_and_fixed(tmp_path):
  write_docs(tmp_path / "docs", 40)
  cfg = text_config(str(tmp_path / "docs" / "*.txt"), holdout_fraction=0.25, prefetch=0)
  train_ids = doc_ids(take(data.make_train_iterator(cfg), 40))
  eval_batches = data.make_eval_batches(cfg, num_batches=10)
  eval_ids = doc_ids(eval_batches)
  assert eval_ids and not train_ids & eval_ids and train_ids | eval_ids == set(range(40))
  assert_batches_equal(eval_batches, data.make_eval_batches(cfg, num_batches=10))

  # The stdlib: held out by file, a few percent, disjoint from training files.
  spec = sources.resolve_source("s", data.source_config("python_stdlib"), 256)
  train = {r[0] for r in sources.file_part_records("s", spec, 256, "train")}
  held = {r[0] for r in sources.file_part_records("s", spec, 256, "eval")}
  assert held and not train & held and 0.01 < len(held) / (len(train) + len(held)) < 0.1

  # Synthetic eval examples come from another seed stream.
  synth = data.data_config(sources=dict(
      x=data.source_config("synthetic", task="niah_single")), prefetch=0)
  eval_batch, = data.make_eval_batches(synth, num_batches=1)
  train_batch = next(data.make_train_iterator(synth))
  assert not np.array_equal(eval_batch["tokens"], train_batch["tokens"])
  check_packing(eval_batch, synth.seq_len)


def test_jsonl_and_array_record_sources(tmp_path):
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  lines = [json.dumps({"text": f"doc-{i:03d} jsonl line", "id": i}) for i in range(20)]
  (tmp_path / "a.jsonl").write_text("\n".join(lines[:12]) + "\n")
  (tmp_path / "b.jsonl").write_text("\n".join(lines[12:]) + "\n")
  for name, fmt, offset in (("text.array_record", "text", 100), ("ids.array_record", "tokens",
                                                                  200)):
    writer = array_record_module.ArrayRecordWriter(str(tmp_path / name), "group_size:1")
    for i in range(10):
      text = f"doc-{offset + i:03d} array record"
      writer.write(text.encode() if fmt == "text" else np.asarray(TOK.encode(text), "<i4")
                   .tobytes())
    writer.close()
  mix = dict(
      j=data.source_config("jsonl", glob=str(tmp_path / "*.jsonl"), part_bytes=64,
                           holdout_fraction=0.0),
      t=data.source_config("array_record", glob=str(tmp_path / "text.array_record"),
                           holdout_fraction=0.0),
      i=data.source_config("array_record", glob=str(tmp_path / "ids.array_record"),
                           format="tokens", holdout_fraction=0.0))
  cfg = data.data_config(seq_len=64, batch_size=4, sources=mix, prefetch=0)
  batches = take(data.make_train_iterator(cfg), 30)
  for batch in batches:
    check_packing(batch, cfg.seq_len)
  assert doc_ids(batches) == set(range(20)) | set(range(100, 110)) | set(range(200, 210))
  assert TOK.decode(next(segments(batches[0]))[1]).endswith(("line", "record"))


def test_bad_files_are_named(tmp_path):
  """A malformed jsonl line (file:line), a binary file among text files, a file that is not an
  ArrayRecord, a token record of the wrong size: each error names the source and the file."""
  def build(kind, glob, **options):
    source = data.source_config(kind, glob=str(tmp_path / glob), holdout_fraction=0.0, **options)
    return data.make_train_iterator(data.data_config(seq_len=64, batch_size=2, prefetch=0,
                                                     sources=dict(bad=source)))

  (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n\n{"text": 3}\n{"txt": "x"}\n')
  with pytest.raises(ValueError, match=r"source 'bad': .*a.jsonl:3: field 'text' is int"):
    next(build("jsonl", "a.jsonl"))
  (tmp_path / "t").mkdir()
  (tmp_path / "t" / "ok.txt").write_text("text " * 20)
  (tmp_path / "t" / "img.txt").write_bytes(bytes(range(256)) * 4)
  with pytest.raises(ValueError, match=r"source 'bad' \(text_files\): .*img.txt: not a UTF-8 "
                     "text file"):
    build("text_files", "t/*.txt")  # refused when opened, before any batch
  (tmp_path / "x.array_record").write_text("not an array record")
  with pytest.raises(ValueError, match=r"source 'bad' \(array_record\): .*x.array_record: not "
                     "a readable ArrayRecord file"):
    build("array_record", "x.array_record")
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  writer = array_record_module.ArrayRecordWriter(str(tmp_path / "ids.array_record"), "")
  writer.write(b"\1\0\0")
  writer.close()
  with pytest.raises(ValueError, match="record 0 has 3 bytes, not a multiple of 4"):
    next(build("array_record", "ids.array_record", format="tokens"))


def test_config_errors(tmp_path):
  def build(**source):
    cfg = data.data_config(sources=dict(bad=source))
    return data.make_train_iterator(cfg)

  with pytest.raises(ConfigError, match="config.data.sources.bad.kind: unknown source kind "
                     "'webtext'"):
    build(kind="webtext")
  with pytest.raises(FileNotFoundError, match=r"source 'bad' \(text_files\): glob .*nothing"):
    build(kind="text_files", glob=str(tmp_path / "nothing" / "*.txt"))
  with pytest.raises(ConfigError, match="config.data.sources.bad.weight: weight must be a "
                     "number > 0, got 0"):
    build(kind="python_stdlib", weight=0.0)
  with pytest.raises(ConfigError, match="config.data.sources.bad.weight: weight must be a "
                     "number > 0, got -1"):
    build(kind="python_stdlib", weight=-1.0)
  with pytest.raises(ConfigError, match=r"config.data.sources.bad.globb: unknown field \(did "
                     r"you mean 'glob'\?\)"):
    build(kind="text_files", globb="*.txt")
  with pytest.raises(ConfigError, match="config.data.sources.bad.glob: .* set 'glob'"):
    build(kind="jsonl")
  with pytest.raises(ConfigError, match="config.data.sources.bad.task: unknown synthetic task "
                     "'needle'"):
    build(kind="synthetic", task="needle")
  with pytest.raises(ConfigError, match=r"config.data.sources.bad.max_length: .*max_length "
                     r"\(512\) <= seq_len \(256\)"):
    build(kind="synthetic", task="mqar", max_length=512)
  cfg = data.data_config(seq_len=160, sources=dict(
      bad=data.source_config("synthetic", task="niah_multikey")))
  with pytest.raises(ValueError, match="niah_multikey examples .* need at least .* > seq_len 160"):
    data.make_train_iterator(cfg)
  cfg.sources.bad.num_distractors = 1  # now it fits
  data.make_train_iterator(cfg).close()
  with pytest.raises(FileNotFoundError, match="tokenizer 'missing.json'"):
    data.make_train_iterator(data.data_config(tokenizer="missing.json"))
