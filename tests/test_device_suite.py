"""tools/device_suite.py on CPU (`--smoke`): every section runs or says why not, one failure never
stops the rest, both reports are written with device / jax / date on every table; and the rules
its correctness section applies (the causal selection, top-k recall and threshold)."""

import gzip
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.planning import flop_ledger
from tools import device_suite, device_suite_kernels as kernels
from tools import device_suite_moe, device_suite_profile as profile

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


@pytest.mark.slow  # a subprocess: compiles a train step and the decode engine (~2-4 min on CPU)
def test_smoke_model_sections(tmp_path):
  """The train step (its compiled HLO saved), its profile (the step's own compiled program,
  parsed from the CPU trace: every kernel's time attributed), the MoE A/B and decoding."""
  names = ["train_step", "train_profile", "moe_matmul", "decode"]
  out = subprocess.run(
      [sys.executable, "tools/device_suite.py", "--smoke", f"--sections={','.join(names)}",
       f"--out_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=1200,
      env=dict(os.environ, PYTHONPATH=REPO))
  assert out.returncode == 0, out.stderr[-3000:]
  assert all(f"== {name}" in out.stdout for name in names)  # progress lines
  sections = _check_report(str(tmp_path), names)
  train, decode = sections["train_step"], sections["decode"]
  assert train["status"] == "ok", train
  assert train["rows"][0]["dsa_impl"] == "pallas_interpret" and train["rows"][0]["step_s"] > 0
  with gzip.open(tmp_path / train["rows"][0]["hlo_file"], "rt") as f:
    assert "ENTRY" in f.read()
  profile = sections["train_profile"]
  assert profile["status"] == "ok", profile
  assert profile["hlo_module"] == "jit_train_step" and 0 <= profile["idle_pct"] < 100
  assert (tmp_path / profile["trace"]).stat().st_size == profile["trace_bytes"] > 0
  categories = {r["category"]: r for r in profile["rows"]}
  assert "unattributed" not in categories and categories["optimizer"]["optimizer_ms"] > 0
  assert sum(r["pct"] for r in profile["rows"]) == pytest.approx(100)
  assert profile["tables"]["top 40 kernels"][0]["ms_per_step"] > 0
  moe = {r["case"]: r for r in sections["moe_matmul"]["rows"]}
  assert moe["ragged_dot"]["status"] == "ok" and moe["ragged_dot"]["expanded"]  # XLA:CPU too
  assert not moe["dense bound"]["expanded"] and moe["dense bound"]["median_s"] > 0
  for name in ("ragged_dot +cudnn_fusion", "ragged_dot +pallas_lowering"):
    assert moe[name]["status"] in ("ok", "missing"), moe[name]
    assert moe[name].get("max_rel_diff", 0) < 1e-2
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


def test_profile_of_a_cpu_trace(tmp_path):
  """A jax.profiler trace of a small jitted loop on CPU: the thunk events are the kernels, a
  loop's own event (which contains its body's) is dropped, every kernel maps to an instruction
  of the compiled module, and busy + idle = span."""
  @jax.jit
  def f(x):
    return jax.lax.fori_loop(0, 3, lambda i, y: jnp.tanh(y @ y), x).sum()

  x = jnp.ones((64, 64))
  compiled = f.lower(x).compile()
  jax.block_until_ready(compiled(x))
  jax.profiler.start_trace(str(tmp_path))
  for _ in range(2):
    jax.block_until_ready(compiled(x))
  jax.profiler.stop_trace()
  found = profile.device_kernels(profile.load_trace(profile.trace_file(str(tmp_path))))
  names = flop_ledger.op_names(compiled.as_text())
  ours = [k for k in found if k["hlo_module"] == "jit_f"]
  assert ours and all(k["hlo_op"] in names for k in ours)
  assert not any(names[k["hlo_op"]][1] == "while" for k in ours)  # containers dropped
  summary = profile.summarize(found, names, steps=2)
  assert summary["hlo_module"] == "jit_f"
  assert summary["busy_ms_per_step"] + summary["idle_ms_per_step"] == pytest.approx(
      summary["span_ms_per_step"])
  assert sum(r["pct"] for r in summary["category_rows"]) == pytest.approx(100)


def test_a_tracer_plane_is_not_a_device():
  """libtpu, once loaded in the process, adds a `/device:CUSTOM:Megascale Trace` plane to a CPU
  run's trace: the host's thunk events are still the kernels."""
  trace = {"traceEvents": [
      dict(ph="M", pid=1, name="process_name", args=dict(name="/device:CUSTOM:Megascale Trace")),
      dict(ph="M", pid=701, name="process_name", args=dict(name="/host:CPU")),
      dict(ph="X", pid=701, tid=5, name="fusion.3", ts=0.0, dur=4.0,
           args=dict(hlo_op="fusion.3", hlo_module="jit_f"))]}
  assert [k["hlo_op"] for k in profile.device_kernels(trace)] == ["fusion.3"]


def _gpu_trace():
  """A trace shaped as xprof writes a GPU run: `/device:GPU:0` with one stream line and a
  derived `XLA Ops` line repeating the kernels, and a host process whose events carry hlo_op
  arguments too (launches: not kernels)."""
  meta = lambda pid, tid, kind, name: dict(ph="M", pid=pid, tid=tid, name=kind,
                                           args=dict(name=name))
  kernel = lambda tid, name, op, ts, dur, module="jit_train_step(7)": dict(
      ph="X", pid=1, tid=tid, name=name, ts=ts, dur=dur,
      args=dict(hlo_op=op, hlo_module=module, correlation_id=1))
  return {"traceEvents": [
      meta(1, None, "process_name", "/device:GPU:0"),
      meta(1, 13, "thread_name", "Stream #13(Compute)"),
      meta(1, 3735928559, "thread_name", "XLA Ops"),
      meta(701, 5, "process_name", "/host:CPU"),
      kernel(13, "sm90_xmma_gemm_bf16", "custom-call.1", 0.0, 10.0),
      kernel(13, "loop_fusion_3", "fusion.3", 12.0, 4.0),
      kernel(13, "loop_fusion_3", "fusion.3", 20.0, 4.0),
      kernel(13, "sparse_mla_triton_forward", "custom-call.9", 30.0, 10.0),
      kernel(13, "other_program", "fusion.1", 50.0, 1.0, module="jit_other(2)"),
      kernel(3735928559, "fusion.3", "fusion.3", 12.0, 4.0),
      dict(ph="X", pid=701, tid=5, name="launch", ts=0.0, dur=40.0,
           args=dict(hlo_op="fusion.3", hlo_module="jit_train_step(7)"))]}


def test_profile_of_a_gpu_shaped_trace():
  """Kernels come from the GPU's stream lines only; per-kernel rows, categories by the
  compiled module's op_names, an unknown hlo_op is "unattributed", idle = span - busy, and
  another program's kernels are set apart."""
  found = profile.device_kernels(_gpu_trace())
  assert [k["name"] for k in found] == ["sm90_xmma_gemm_bf16", "loop_fusion_3", "loop_fusion_3",
                                        "sparse_mla_triton_forward", "other_program"]
  names = {"custom-call.1": ("jit(train_step)/jvp(x)/transpose(jvp(x))/self_attn/dot_general",
                             "custom-call"),
           "fusion.3": ("jit(train_step)/adam/mul", "fusion")}
  summary = profile.summarize(found, names, steps=2)
  assert summary["hlo_module"] == "jit_train_step(7)"
  assert summary["other_modules"] == {"jit_other(2)": pytest.approx(1e-3)}
  assert summary["span_ms_per_step"] == pytest.approx(40e-3 / 2)
  assert summary["busy_ms_per_step"] == pytest.approx(28e-3 / 2)
  assert summary["idle_pct"] == pytest.approx(30)
  rows = {r["category"]: r for r in summary["category_rows"]}
  assert rows["attention projections"]["backward_ms"] == pytest.approx(5e-3)
  assert rows["optimizer"]["optimizer_ms"] == pytest.approx(4e-3)
  assert rows["unattributed"]["unattributed_ms"] == pytest.approx(5e-3)
  kernels_by_name = {r["kernel"]: r for r in summary["kernel_rows"]}
  assert kernels_by_name["loop_fusion_3"]["count"] == 2
  assert kernels_by_name["loop_fusion_3"]["category"] == "optimizer/optimizer"


def test_moe_matmul_inputs_and_expansion_check():
  """Uneven group sizes that sum to the rows; the expansion check reads an `[E, P, ...]`
  operand in a program's text."""
  sizes = device_suite_moe.group_sizes(1000, 8)
  assert sizes.sum() == 1000 and sizes.max() > 2 * sizes.min()
  shape = dict(rows=64, hidden=32, ffn=16, experts=4)
  assert device_suite_moe.hlo_summary("%a = bf16[4,64,32] broadcast(...)", shape)["expanded"]
  summary = device_suite_moe.hlo_summary(
      '%r = bf16[64,16] ragged-dot(...)\n%c = custom-call(), custom_call_target="__cublas$gemm"',
      shape)
  assert not summary["expanded"]
  assert summary["hlo"] == "ragged-dot x1, custom-call __cublas$gemm x1"


def test_profile_tables_again_from_saved_files(tmp_path, capsys):
  """`python3 tools/device_suite_profile.py --trace= --hlo=`: the same tables from a run's
  files; an op's kind names its category before the MTP layer's name does (XLA deduplicates
  the scanned layers' computations into the MTP layer's, names included)."""
  trace = tmp_path / "t.json.gz"
  with gzip.open(trace, "wt") as f:
    json.dump(_gpu_trace(), f)
  hlo = tmp_path / "step.hlo.txt"
  scope = "jit(train_step)/transpose(jvp(GLM5))/jvp(GLM5)/checkpoint/mtp.<lambda>/mtp/layer"
  hlo.write_text(
      "ENTRY %main () -> f32[8] {\n"
      f'  %custom-call.1 = bf16[8]{{0}} custom-call(), metadata={{op_name="{scope}/self_attn/'
      'sparse_mla/transpose(jvp(indexer_scores_at))/blji,bsi->bljs/dot_general"}\n'
      f'  %fusion.3 = f32[8]{{0}} fusion(), metadata={{op_name="{scope}/eh_proj/mul"}}\n'
      "  ROOT %tuple.4 = (bf16[8]{0}, f32[8]{0}) tuple(%custom-call.1, %fusion.3)\n"
      "}\n")
  profile.main([f"--trace={trace}", f"--hlo={hlo}", "--steps=2"])
  out = capsys.readouterr().out
  assert "| indexer | 0 | 0 | 0.005 |" in out and "| MTP layer | 0 | 0 | 0.004 |" in out
  assert "| sm90_xmma_gemm_bf16 | custom-call.1 | indexer/backward | 1 |" in out
