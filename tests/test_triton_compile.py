"""Triton's own compiler on the GPU kernels, offline (tools/check_triton_compile.py): each kernel
program at small shapes and its default options lowers for CUDA, compiles to an sm_90a cubin
(ptxas included) and, at these shapes, neither spills registers nor overflows shared memory.

The compiles need the optional `gpu-check` extra (triton 3.6, setup.cfg) and are skipped
without it, as in CI.
Or PYTHONPATH=$PWD:DIR with triton installed into DIR (`triton_offline.import_triton` says how).
No GPU is used: resources only, not numerics (tests/test_triton_*.py) or speed (device suite).
"""

import pytest

from pallas_kernels import triton_offline
from tools import check_triton_compile

try:
  triton_offline.import_triton()
  _SKIP = None
except ImportError as e:
  _SKIP = str(e)

# Small but Triton-legal: dot operands >= 16 (block_q * J = 32 for the indexer), several slot
# blocks per token, and a decode long enough to split.
SMALL = check_triton_compile.Shapes(length=128, heads=16, latent=64, rope=16, index_heads=4,
                                    index_dim=32, topk=64, decode_batch=2, decode_keys=512,
                                    moe=(512, 128, 64, 4))


@pytest.mark.skipif(_SKIP is not None, reason=f"optional extra gpu-check: {_SKIP}")
@pytest.mark.parametrize("kernel", check_triton_compile.KERNELS)
def test_compiles_at_defaults_without_spills(kernel, tmp_path):
  row = check_triton_compile.compile_kernel(kernel, SMALL, dump_dir=str(tmp_path))
  assert row["options"] == check_triton_compile.default_options(kernel)
  assert 0 < row["registers"] <= 255
  assert (row["spill_stores"], row["spill_loads"]) == (0, 0), row
  assert 0 < row["shared_bytes"] <= triton_offline.H100_SHARED_LIMIT, row
  assert row["fits"]
  if kernel == "mla_backward":  # its key-row atomics: relaxed vector (16-byte) reductions
    sass = (tmp_path / "mla_backward.sass").read_text()
    assert "REDG.E.ADD.F32x4" in sass and "MEMBAR.ALL.GPU" not in sass


@pytest.mark.skipif(_SKIP is not None, reason=f"optional extra gpu-check: {_SKIP}")
@pytest.mark.parametrize("kernel", check_triton_compile.MLA_BACKWARD_KERNELS)
def test_all_heads_backward_at_glm5_shapes(kernel, tmp_path):
  """The all-64-heads backward at GLM-5's shapes (docs/performance.md), plain and with the
  head-mean probabilities a GPU train step takes: at bt 16 no spill; at the default bt 32
  (measured faster on an H200) shared memory within the chip's and at most the 3 local-memory
  instructions in the slot loop that TritonMLAOptions documents."""
  row = check_triton_compile.compile_kernel(kernel, changes=dict(backward_block_t=16),
                                            dump_dir=str(tmp_path))
  assert row["options"]["backward_head_block"] == 64
  assert (row["spill_stores"], row["spill_loads"]) == (0, 0), row
  assert row["loop_spill_ops"] == 0
  assert row["fits"]
  row = check_triton_compile.compile_kernel(kernel, dump_dir=str(tmp_path))
  assert row["options"]["backward_block_t"] == 32
  assert row["shared_bytes"] <= triton_offline.H100_SHARED_LIMIT, row
  assert row["loop_spill_ops"] <= 3, row


def test_local_memory_ops_in_loops_counts_only_loop_bodies():
  sass = """
        /*0000*/                   STL [R1], R2 ;
.L_x_0:
        /*0010*/                   LDL.64 R4, [R1+0x8] ;
        /*0020*/                   HGMMA.64x16x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0030*/                   STL.64 [R1+0x10], R6 ;
        /*0040*/              @P0  BRA `(.L_x_0) ;
        /*0050*/                   LDL.LU R3, [R1] ;
        /*0060*/                   BRA `(.L_x_1) ;
.L_x_1:
        /*0070*/                   EXIT ;
"""
  assert triton_offline.local_memory_ops_in_loops(sass) == 2


def test_table_marks_a_program_that_does_not_fit():
  row = dict(kernel="k", options=dict(block_t=32), changed={}, registers=255, spill_stores=8,
             spill_loads=4, shared_bytes=300 * 1024, fits=False, compile_s=1.0)
  assert check_triton_compile.table([row]).splitlines()[-1] == (
      "| k | block_t=32 (default) | 255 | 8 / 4 | 300 | NO | 1.0 |")


def test_adapter_names_the_jax_function_when_it_moved(monkeypatch):
  from jax._src.pallas.triton import pallas_call_registration  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(pallas_call_registration, "lowering", object())
  with pytest.raises(triton_offline.TritonLoweringAdapterError,
                     match="lowering.lower_jaxpr_to_triton_module"):
    triton_offline.capture_ttir(lambda x: x, 1.0)
