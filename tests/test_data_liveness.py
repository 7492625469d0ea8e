"""No data source makes the pipeline spin: a source with no documents, or too few records for
its split, is a clear error naming the source, raised within seconds.

Each case runs in a subprocess with a timeout, so a regression fails instead of hanging the suite
(a spinning grain pipeline ignores SIGTERM and SIGALRM never reaches it).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from glm5_jax.data import sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent("""
    import json, sys
    from glm5_jax import data
    case = json.loads(sys.argv[1])
    cfg = data.data_config(seq_len=64, batch_size=2, sources=case["sources"], **case["data"])
    try:
      if case["split"] == "eval":
        data.make_eval_batches(cfg, num_batches=1)
      else:
        it = data.make_train_iterator(cfg)
        next(it)
        it.close()
    except Exception as e:
      print("ERROR", type(e).__name__, e)
      sys.exit(3)
    print("OK")
    """)


def _first_batch(source_specs, *, split="train", timeout=60, **data_overrides):
  """(exit code, output) of building `split`'s first batch in a subprocess."""
  case = dict(sources=source_specs, split=split, data=dict(dict(prefetch=0), **data_overrides))
  try:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(case)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                          text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    pytest.fail(f"the pipeline spun for {timeout} s without a batch or an error")
  return proc.returncode, proc.stdout + proc.stderr


def _source(kind, glob, **options):
  return dict(kind=kind, glob=glob, weight=1.0, **options)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_blank_jsonl_is_an_error_naming_the_source(tmp_path, prefetch):
  for name in ("a", "b"):
    (tmp_path / f"{name}.jsonl").write_text("\n   \n\n" * 50)
  code, out = _first_batch(dict(
      web=_source("jsonl", str(tmp_path / "*.jsonl"), holdout_fraction=0.0, part_bytes=32),
      synth=dict(kind="synthetic", task="mqar", weight=1.0, min_length=20, max_length=64)),
      prefetch=prefetch)
  assert code == 3, out
  assert "source 'web'" in out and "no document" in out and "a.jsonl" in out, out


def test_empty_text_files_are_an_error_naming_the_source(tmp_path):
  for i in range(3):
    (tmp_path / f"empty{i}.txt").write_text("")
  code, out = _first_batch(dict(docs=_source("text_files", str(tmp_path / "*.txt"))))
  assert code == 3, out
  assert "source 'docs'" in out and "3 files" in out and "empty" in out, out


def test_jsonl_with_mostly_blank_parts_still_trains(tmp_path):
  # Two epochs' worth of empty parts in a row is possible here (a document-bearing part early
  # in one epoch, late in the next): the check must not fire on a source that has documents.
  (tmp_path / "a.jsonl").write_text("\n" * 600 + json.dumps({"text": "the only doc"}) + "\n")
  code, out = _first_batch(dict(web=_source("jsonl", str(tmp_path / "a.jsonl"),
                                            holdout_fraction=0.0, part_bytes=16)))
  assert code == 0 and "OK" in out, out


def test_single_file_without_heldout_share_says_what_to_do(tmp_path):
  path = tmp_path / "only.txt"
  path.write_text("one document of plain text\n" * 20)
  assert sources.unit_hash("only.txt") >= 0.05  # held out by file: this file trains
  code, out = _first_batch(dict(docs=_source("text_files", str(path))), split="eval")
  assert code == 3, out
  assert "config.data.sources.docs" in out and "held-out" in out, out
  assert "holdout_fraction=0" in out and "add files" in out, out
  assert "cannot be sharded" not in out, out
