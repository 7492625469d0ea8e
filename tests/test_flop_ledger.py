"""The matmul-FLOP ledger (`glm5_jax.planning.flop_ledger`, tools/flop_ledger.py) on the tiny
model's train step lowered for CUDA from this CPU host: consistent totals, the phases, the
routed experts as the Triton gmm / tgmm kernels by default (no dense dot over the experts) and
as `ragged-dot`s priced as XLA GPU runs them when asked, and the bf16 options seen in the GPU
program."""

import collections
import pathlib

import numpy as np

from glm5_jax.planning import flop_ledger, hlo_loops
from tools import flop_ledger as tool

TINY = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.py")


def _lowered(*overrides):
  # bf16 compute as the GPU configs (tiny computes in fp32)
  config = tool.load_config(TINY, ["data.batch_size=2", "model.remat_policy='full'",
                                   "model.dtype='bfloat16'", *overrides])
  return config, tool.lowered_text(config, "cuda")


def test_ledger_of_the_cuda_lowered_tiny_step():
  """Categories and phases add up to the total; full remat recomputes every routed-expert
  forward matmul. The experts run as the Triton grouped matmul (`glm5_jax.grouped_matmul`'s
  GPU default): 3 gmm forward (+ 3 remat), 3 gmm input gradients and 3 tgmm weight gradients
  per MoE layer, priced at their useful FLOPs; no `ragged-dot` and no dot with an
  `[E, rows, .]` masked operand. With `model.moe_matmul=ragged_dot` they are `ragged-dot`s
  priced at E x their useful FLOPs for CUDA and 1 x for TPU. Useful FLOPs cover the model
  FLOPs. With `train.ce_chunk` and `optim.ns_dtype=bfloat16` the LM head and the optimizer run
  no fp32 dot (the default program runs both in fp32), and with `train.ce_grad_in_forward` the
  head runs no backward dot (its gradients are formed in the forward). Under full remat the
  indexer KL's scores at the selection (`indexer_scores_at`, `model.dsa_impl=xla`) are
  recomputed once, not twice."""
  config, text = _lowered()
  rows, calls, unknown = flop_ledger.ledger(text, "cuda")
  assert not unknown
  cats = flop_ledger.by_category(rows)
  total = sum(r.flops for r in rows)
  np.testing.assert_allclose(sum(c["total"] for c in cats.values()), total, rtol=1e-12)
  np.testing.assert_allclose(sum(c[p] for c in cats.values() for p in flop_ledger.PHASES),
                             total, rtol=1e-12)
  for phase in flop_ledger.PHASES:
    assert sum(c[phase] for c in cats.values()) > 0, phase
  experts = cats["routed experts"]
  assert experts["dtypes"] == {"kernel"} and experts["total"] == experts["useful"] > 0
  np.testing.assert_allclose(experts["remat"], experts["forward"], rtol=1e-12)
  np.testing.assert_allclose(experts["backward"], 2 * experts["forward"], rtol=1e-12)
  useful = sum(r.useful_flops for r in rows)
  assert useful >= tool.model_flops(config)

  module = hlo_loops.parse_module(text)
  assert not [i for c in module.computations.values() for i in c if i.op == "ragged-dot"]
  kernels = collections.Counter()

  def count(instr, name, times):
    if instr.op == "custom-call" and "grouped_matmul_triton" in name:
      kernel = "tgmm" if "grouped_matmul_triton_tgmm" in name else "gmm"
      kernels[kernel, flop_ledger.phase(name)] += times
  flop_ledger._walk(module, module.entry, "", 1, count)
  moe_layers = kernels["gmm", "forward"] // 3
  assert moe_layers >= 1 and kernels == {
      ("gmm", "forward"): 3 * moe_layers, ("gmm", "remat"): 3 * moe_layers,
      ("gmm", "backward"): 3 * moe_layers, ("tgmm", "backward"): 3 * moe_layers}, kernels
  _assert_no_expanded_expert_dot(config, text)

  def fp32_dots(rows, category):
    return sum(r.flops for r in rows if r.category == category and r.dtype == "f32")

  assert fp32_dots(rows, "LM head") > 0 and fp32_dots(rows, "optimizer (Muon NS)") > 0
  _, text_other = _lowered("train.ce_chunk=64", "train.ce_grad_in_forward=True",
                           "optim.ns_dtype='bfloat16'", "model.moe_matmul='ragged_dot'",
                           "model.dsa_impl='xla'")
  scores_at = _scores_at_flops(hlo_loops.parse_module(text_other))
  assert scores_at["forward"] > 0
  np.testing.assert_allclose(scores_at["remat"], scores_at["forward"], rtol=1e-12)
  rows_other, _, _ = flop_ledger.ledger(text_other, "cuda")
  assert fp32_dots(rows_other, "LM head") == 0
  head = flop_ledger.by_category(rows_other)["LM head"]
  assert head["forward"] > 0 and head["backward"] == head["remat"] == 0, head
  assert fp32_dots(rows_other, "optimizer (Muon NS)") == 0
  assert sum(r.flops for r in rows_other if r.category == "LM head") > 0
  assert "routed experts" in flop_ledger.format_table(rows, tool.model_flops(config))

  ragged = flop_ledger.by_category(rows_other)["routed experts"]
  groups = config.model.n_routed_experts
  np.testing.assert_allclose(ragged["total"], groups * ragged["useful"], rtol=1e-12)
  np.testing.assert_allclose(ragged["useful"], experts["useful"], rtol=1e-12)
  tpu_rows, _, _ = flop_ledger.ledger(text_other, "tpu")
  tpu_experts = flop_ledger.by_category(tpu_rows)["routed experts"]
  np.testing.assert_allclose(tpu_experts["total"], ragged["useful"], rtol=1e-12)
  _assert_no_expanded_expert_dot(config, text_other)  # XLA GPU expands it later, not jax


def _assert_no_expanded_expert_dot(config, text):
  """No dot has an `[E, >= routed rows, .]` operand (the masked operand of a dense
  expansion over the experts)."""
  module = hlo_loops.parse_module(text)
  shapes = {i.name: flop_ledger._arrays(i.result_type) for c in module.computations.values()
            for i in c}
  groups = config.model.n_routed_experts
  tokens = config.data.batch_size * config.data.seq_len  # routed rows: tokens x top-k
  for c in module.computations.values():
    for i in c:
      if i.op == "dot":
        for operand in i.operands:
          shape = shapes[operand][0][1] if shapes.get(operand) else ()
          assert not (len(shape) == 3 and shape[0] == groups and shape[1] >= tokens), (
              i.name, shape)


def _scores_at_flops(module) -> dict:
  """`{phase: FLOPs}` of the dots inside `indexer_scores_at` (the indexer KL's scores)."""
  shapes = {i.name: flop_ledger._arrays(i.result_type)[0] for c in module.computations.values()
            for i in c if flop_ledger._arrays(i.result_type)}
  flops = collections.Counter()

  def visit(instr, name, times):
    if instr.op == "dot" and "indexer_scores_at" in name:
      flops[flop_ledger.phase(name)] += flop_ledger._dot_flops(instr, shapes)[0] * times
  flop_ledger._walk(module, module.entry, "", 1, visit)
  return flops
