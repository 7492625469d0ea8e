"""tools/bench_serve.py end to end on the tiny model: the server and its engine process, client
processes of both modes, every request answered once with all its tokens (the tool asserts it),
no compile after warm-up (counted in the engine's process), and the direct baseline in the
engine process that served."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # a server, an engine process and client processes (~25 s)
def test_bench_serve_runs_every_level_and_the_direct_baseline():
  proc = subprocess.run(
      [sys.executable, "tools/bench_serve.py", "--clients=1,2", "--requests_per_client=1",
       "--max_tokens=4", "--client_processes=1", "--slots=2", "--deadline_s=120"],
      cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT),
      capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  levels = re.findall(r"^(stream|whole) clients +(\d+): .* 0 compiles \(engine process\)  "
                      r"\((\d+) requests, none lost or repeated\)", proc.stdout, re.M)
  assert levels == [("stream", "1", "1"), ("stream", "2", "2"), ("whole", "1", "1"),
                    ("whole", "2", "2")], proc.stdout
  assert re.search(r"^engine direct \(the engine process that served\), 32 requests, 2 slots: "
                   r"[\d.]+ tok/s", proc.stdout, re.M), proc.stdout
