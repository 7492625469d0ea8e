"""`tools/bench_dsa.py --quick` runs end to end and prints its table and summary."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow  # a subprocess running the benchmark CLI


def test_bench_dsa_quick():
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_dsa.py"), "--quick",
                         "--repeats=1", "--json"],
                        capture_output=True, text=True, timeout=300, cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  for path in ("dense", "dense_mask", "xla", "pallas (interpret)", "indexer_reference",
               "indexer_xla", "indexer_pallas (interpret)"):
    assert f" {path} " in out, f"row {path!r} missing:\n{out}"
  assert "fwd+bwd" in out and "x dense" in out
  assert "DSA (indexer_xla + xla) vs dense, fwd+bwd: dense time / DSA time = L=256" in out
  assert out.count('"path": ') == 2 * (4 * 2 + 3)  # 2 lengths x (4 paths x 2 passes + 3 indexers)
