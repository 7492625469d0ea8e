"""The matmul-FLOP ledger (`glm5_jax.planning.flop_ledger`, tools/flop_ledger.py) on the tiny
model's train step lowered for CUDA from this CPU host: consistent totals, the phases, the
routed experts as `ragged-dot`s priced as XLA GPU runs them, and the bf16 options seen in the
GPU program."""

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
  forward matmul; the experts are `ragged-dot`s (no dot has an `[E, rows, .]` masked
  operand), priced at E x their useful FLOPs for CUDA and 1 x for TPU; useful FLOPs cover the
  model FLOPs. With `train.ce_chunk` and `optim.ns_dtype=bfloat16` the LM head and the
  optimizer run no fp32 dot (the default program runs both in fp32)."""
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
  groups = config.model.n_routed_experts
  np.testing.assert_allclose(experts["total"], groups * experts["useful"], rtol=1e-12)
  np.testing.assert_allclose(experts["remat"], experts["forward"], rtol=1e-12)
  useful = sum(r.useful_flops for r in rows)
  assert useful >= tool.model_flops(config)

  tpu_rows, _, _ = flop_ledger.ledger(text, "tpu")
  tpu_experts = flop_ledger.by_category(tpu_rows)["routed experts"]
  np.testing.assert_allclose(tpu_experts["total"], experts["useful"], rtol=1e-12)

  module = hlo_loops.parse_module(text)
  ragged = [i for c in module.computations.values() for i in c if i.op == "ragged-dot"]
  assert ragged
  shapes = {i.name: flop_ledger._arrays(i.result_type) for c in module.computations.values()
            for i in c}
  tokens = config.data.batch_size * config.data.seq_len  # routed rows: tokens x top-k
  for c in module.computations.values():
    for i in c:
      if i.op == "dot":
        for operand in i.operands:
          shape = shapes[operand][0][1] if shapes.get(operand) else ()
          assert not (len(shape) == 3 and shape[0] == groups and shape[1] >= tokens), (
              i.name, shape)

  def fp32_dots(rows, category):
    return sum(r.flops for r in rows if r.category == category and r.dtype == "f32")

  assert fp32_dots(rows, "LM head") > 0 and fp32_dots(rows, "optimizer (Muon NS)") > 0
  _, text_bf16 = _lowered("train.ce_chunk=64", "optim.ns_dtype='bfloat16'")
  rows_bf16, _, _ = flop_ledger.ledger(text_bf16, "cuda")
  assert fp32_dots(rows_bf16, "LM head") == 0
  assert fp32_dots(rows_bf16, "optimizer (Muon NS)") == 0
  assert sum(r.flops for r in rows_bf16 if r.category == "LM head") > 0
  assert "routed experts" in flop_ledger.format_table(rows, tool.model_flops(config))
