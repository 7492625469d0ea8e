"""tools/device_suite.py on CPU (`--smoke`): every section runs or says why not, one failure never
stops the rest, both reports are written with device / jax / date on every table; and the rules
its correctness section applies (the causal selection, top-k recall and threshold)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tools import device_suite, device_suite_kernels as kernels

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESENT = kernels.present_kernels()  # the lead's merge brings both GPU kernel modules


def _check_report(out_dir, names):
  with open(os.path.join(out_dir, "device_suite.json")) as f:
    report = json.load(f)
  with open(os.path.join(out_dir, "device_suite.md")) as f:
    text = f.read()
  assert list(report["sections"]) == names
  m = report["meta"]
  assert m["jax"] == jax.__version__ and m["device"] and m["date"] and m["smoke"]
  tables = text.split("\n## ")[1:]
  assert tables[0].startswith("goals") and len(tables) == 1 + len(names)
  for table in tables:  # each table names the device, the jax version and the date
    assert f"device {m['device']}" in table and f"jax {m['jax']}" in table and m["date"] in table
  return report["sections"]


def test_smoke_kernel_sections(tmp_path):
  """The three kernel sections in-process: each GPU kernel present in the build runs in
  interpret mode and passes its rules; an absent one is recorded "missing" (the lead wires both
  at merge). The dense baseline (XLA twin of the cuDNN call) and the XLA DSA path always run."""
  names = ["kernel_correctness", "kernel_timing", "dsa_vs_dense"]
  device_suite.run(device_suite.smoke_context(), names, 300, str(tmp_path), "test")
  sections = _check_report(str(tmp_path), names)
  for name in names[:2]:
    for row in sections[name]["rows"]:
      present = row["case"].split()[0] in PRESENT
      assert row["status"] == ("ok" if present else "missing"), row
      if name == "kernel_correctness" and present:
        assert row["ok"], row
  dense = sections["dsa_vs_dense"]
  assert dense["status"] == "ok", dense
  paths = [row["path"] for row in dense["rows"]]
  both = PRESENT == set(kernels.GPU_MODULES)
  assert paths == ["dense (xla)"] + ["dsa (pallas)"] * both + ["dsa (xla)"]
  assert all(row["median_s"] > 0 and row["tflops"] > 0 for row in dense["rows"])


def test_a_failing_section_is_recorded_and_the_rest_run(tmp_path, monkeypatch):
  def broken(ctx):
    raise RuntimeError("boom")

  def partial(ctx):
    return dict(rows=[ctx.case("fine", lambda: dict(x=1.0)),
                      ctx.case("bad", lambda: 1 / 0)])

  monkeypatch.setattr(device_suite, "SECTIONS", {"a": (broken, 1.0), "b": (partial, 1.0)})
  device_suite.run(device_suite.smoke_context(), ["a", "b"], 60, str(tmp_path), "test")
  sections = _check_report(str(tmp_path), ["a", "b"])
  assert sections["a"]["status"] == "error" and "boom" in sections["a"]["error"]
  assert sections["b"]["status"] == "partial: error"
  assert [r["status"] for r in sections["b"]["rows"]] == ["ok", "error"]
  assert "ZeroDivisionError" in sections["b"]["rows"][1]["error"]


@pytest.mark.slow  # a subprocess: compiles a train step and the decode engine (~1-2 min on CPU)
def test_smoke_model_sections(tmp_path):
  out = subprocess.run(
      [sys.executable, "tools/device_suite.py", "--smoke", "--sections=train_step,decode",
       f"--out_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=900,
      env=dict(os.environ, PYTHONPATH=REPO))
  assert out.returncode == 0, out.stderr[-3000:]
  assert "== train_step" in out.stdout and "== decode" in out.stdout  # progress lines
  sections = _check_report(str(tmp_path), ["train_step", "decode"])
  train, decode = sections["train_step"], sections["decode"]
  assert train["status"] == "ok", train
  assert train["rows"][0]["dsa_impl"] == "pallas_interpret" and train["rows"][0]["step_s"] > 0
  assert decode["status"] == "ok", decode
  assert [r["mode"] for r in decode["rows"]] == ["plain", "MTP k=1"]
  assert decode["rows"][1]["accept_length"] >= 1 and "meaningless" in decode["note"]


def test_causal_selection_is_distinct_and_causal():
  length, topk = 40, 8
  sel = np.asarray(kernels.causal_selection(length, topk)[0])
  for l in range(length):
    keys = sel[l][sel[l] >= 0]
    assert len(keys) == min(l + 1, topk) == len(set(keys.tolist()))
    assert keys.max() <= l
  assert kernels.valid_slots(length, topk) == int((sel >= 0).sum())


def test_topk_rules():
  """Recall over the reference's keys; a swapped pick passes only as a near-tie."""
  scores = np.array([[5.0, 4.0, 3.0, 2.999, 1.0]])
  want, want_scores = np.array([[0, 1, 2]]), np.array([[5.0, 4.0, 3.0]])
  ok = kernels.topk_agreement(np.array([[0, 1, 3]]), want, want_scores, scores)
  assert ok["threshold_ok"] and ok["recall"] == pytest.approx(2 / 3) and not ok["ok"]
  far = kernels.topk_agreement(np.array([[0, 1, 4]]), want, want_scores, scores)
  assert not far["threshold_ok"]
  same = kernels.topk_agreement(want, want, want_scores, scores)
  assert same["ok"] and same["recall"] == 1.0


def test_goals_read_the_sections():
  """Each of issue 26's goals is read from its section's rows; absent figures stay unmeasured,
  and the MTP goal needs a trained checkpoint."""
  ok = dict(status="ok")
  report = dict(meta=dict(seq_lens=[4096, 65536], workdir=None), sections=dict(
      kernel_timing=dict(rows=[
          dict(ok, op="sparse_mla fwd", L=4096, peak_pct=30.0, median_s=0.1),
          dict(ok, op="sparse_mla fwd", L=65536, peak_pct=45.0, median_s=2.0),
          dict(ok, op="indexer_topk", L=65536, median_s=3.0)]),
      dsa_vs_dense=dict(rows=[dict(ok, path="dsa (pallas)", L=65536, speedup_vs_dense=3.5)],
                        growth_per_4x_L={"pallas 16384->65536": 5.0}),
      train_step=dict(rows=[dict(status="error", dsa_impl="pallas")]),
      decode=dict(rows=[dict(ok, slots=1, mode="MTP k=1", speedup=2.0)])))
  got = {goal.split()[0] + goal.split()[1]: (measured, met)
         for goal, measured, met in device_suite.goals(report)}
  assert got["sparseMLA"] == (45.0, True)
  assert got["DSAfwd+bwd"] == (3.5, True)
  assert got["DSAtime"] == (5.0, False)
  assert got["indexer+"] == (1.5, False)
  assert got["train-stepMFU"] == (None, None)
  assert got["MTPspeculation"] == (2.0, None)  # random init: not judged


def test_tune_sparse_mla_rows(capsys):
  """tools/tune_sparse_mla.py's rows (interpret mode, tiny dims): the defaults row has zero
  error against itself, another block size is timed and checked against it, an unknown option
  is an error row and the rest still run."""
  if "sparse_mla" not in PRESENT:
    pytest.skip("the GPU sparse MLA kernel is not in this build")
  dims = kernels.Dims(heads=8, latent=32, rope=16, index_heads=2, index_dim=16, topk=16,
                      dense_head_dim=32)
  rows = kernels.tune_sparse_mla(32, dims, [{}, {"bogus": 1}, {"block_t": 16}], repeats=1,
                              budget_s=120, interpret=True)
  assert [r["status"] for r in rows] == ["ok", "error", "ok"], rows
  assert "unknown options ['bogus']" in rows[1]["error"]
  for row in (rows[0], rows[2]):
    assert row["forward_ms"] > 0 and row["fwd_bwd_ms"] > 0
    assert max(row[k] for k in ("out", "dq", "dq_rope", "dkv", "dk_rope")) < 1e-2, row
  assert rows[0]["out"] == 0
  with pytest.raises(ValueError, match="defaults"):
    kernels.tune_sparse_mla(32, dims, [{"block_t": 16}], repeats=1, budget_s=1, interpret=True)
