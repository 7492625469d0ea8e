"""What is live at a compiled program's memory peak (glm5_jax/planning/peak_memory.py), read
from XLA's dump of a TPU-compiled program whose peak is known from its shapes
(tests/fixtures/peak_memory/make_fixtures.py; text files, no libtpu needed)."""

import pathlib

import pytest

from glm5_jax.planning import peak_memory

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "peak_memory"
MIB = 2 ** 20


def _report():
  return peak_memory.peak_report((FIXTURES / "wide.live-range.txt").read_text(),
                                 (FIXTURES / "wide.hlo").read_text())


def test_the_wide_product_is_the_largest_buffer_at_the_peak():
  report = _report()
  size, count, shape, op_name = report.by_source[0]
  # tanh(x @ w1) kept as bf16 [2048, 8192] for the second product: 32 MiB
  assert (size, count, shape, op_name) == (32 * MIB, 1, "bf16[2048,8192]",
                                           "jit(wide)/wide/dot_general")
  # the inputs x [2048, 1024], w1 [1024, 8192], w2 [8192, 256], bf16, all live at the peak
  assert report.arguments == report.by_category["arguments"] == 24 * MIB
  assert report.total == sum(report.by_category.values())
  assert report.total == sum(b for b, *_ in report.by_source)


def test_on_chip_copies_are_kept_out_of_the_hbm_total():
  report = _report()
  # the compiler prefetches w1 and w2 into VMEM (layout S(1)): live, but not HBM
  assert report.on_chip >= 20 * MIB
  assert all("S(1)" not in shape for _, _, shape, _ in report.by_source)
  assert peak_memory.memory_space("bf16[8,128]{1,0:T(8,128)(2,1)S(1)}") == 1
  assert peak_memory.memory_space("bf16[8,128]{1,0:T(8,128)(2,1)}") == 0
  text = peak_memory.format_report(report, compiler_temp=40 * MIB)
  assert "32.00 MiB    1 x bf16[2048,8192]" in text and "on-chip memories" in text


def test_a_dump_without_the_peak_section_is_an_error_naming_it(tmp_path):
  with pytest.raises(ValueError, match="Live ranges at N"):
    peak_memory.live_at_peak("HloLiveRange (max 3):\n  InstructionSequence:\n")
  with pytest.raises(FileNotFoundError, match="live-range"):
    peak_memory.find_dump(str(tmp_path))
