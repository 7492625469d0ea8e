"""tests/speculate_cases.py (MTP speculative decoding in the engine), run in a fresh process.

In a long-lived xdist worker, compiling these programs after many other files' tests has
crashed the worker inside XLA:CPU (jaxlib 0.10.2: SIGSEGV / SIGABRT in `backend_compile_and_load`
and in `executable.serialize`, three times in three full runs, always in this file), while the
file alone passes every time, compile cache on or off. A dead worker ends the whole run
(setup.cfg), so these cases get a process with no history; a failure shows their pytest output.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # a pytest subprocess: ~2.5 min of compiles
def test_speculative_decoding_cases_in_a_fresh_process():
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
       "-o", "addopts=-ra", os.path.join("tests", "speculate_cases.py")],
      cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
      timeout=1200)
  assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
  assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
