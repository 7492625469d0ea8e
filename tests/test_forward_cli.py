"""experiments/forward.py runs end to end and reports sane numbers."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow  # a subprocess running the CLI


def test_forward_cli_reports_init_loss_near_ln_vocab():
  # Unrolled: a scanned run does not return its layers' top-k selections, so the "DSA keeps"
  # lines exist only with scan_layers=False (the CLI's docstring says so).
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "forward.py"),
                         "--seq=32", f"--config={os.path.join(ROOT, 'configs', 'tiny.py')}",
                         "--config.model.scan_layers=False"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  loss, ln_vocab = map(float, re.search(r"init loss ([\d.]+) \(ln vocab = ([\d.]+)\)",
                                        proc.stdout).groups())
  assert abs(loss - ln_vocab) < 0.5
  assert len(re.findall(r"MTP depth \d loss", proc.stdout)) == 3
  assert "DSA keeps" in proc.stdout and "expert load" in proc.stdout
