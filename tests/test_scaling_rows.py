"""docs/scaling.md's rows (glm5_jax/planning/scaling_rows.py, tools/scaling_rows.py): each row's
flags exist, and the tables read the rows' plan_memory JSON as written."""

import json
import pathlib
import re
import subprocess
import sys

from configs import glm5_744b
from glm5_jax.layers.remat import REMAT_POLICIES
from glm5_jax.planning import scaling_rows

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_rows_flags_are_plan_memorys_flags_or_config_fields():
  defined = set(re.findall(r'flags\.DEFINE_\w+\(\s*"(\w+)"',
                           (ROOT / "tools" / "plan_memory.py").read_text()))
  config = glm5_744b.get_config()
  for row in scaling_rows.ROWS:
    for arg in row.args:
      name, _, value = arg.removeprefix("--").partition("=")
      if name.startswith("config."):
        node = config
        for part in name.split(".")[1:]:
          assert part in node, f"row {row.name}: {arg}: no config field {part!r}"
          node = node[part]
      else:
        assert name in defined | {"config"}, f"row {row.name}: {arg}: not a plan_memory flag"
      if name == "remat_policy":
        assert value in REMAT_POLICIES, f"row {row.name}: {arg}: not a remat policy"
    assert len(set(a.partition("=")[0] for a in row.args)) == len(row.args), row.name
    command = scaling_rows.command(row, "/out")
    assert command[1] == "tools/plan_memory.py" and "--json" in command
    assert f"--hlo_out=/out/{row.name}.hlo.gz" in command
  assert len(scaling_rows.BY_NAME) == len(scaling_rows.ROWS)


def _plan(compute, dsa, mfu_schedule, host=False):
  estimate = {"compute_by_category": {"DSA sparse": dsa, "experts and FFN": compute - dsa},
              "kernels_by_category": {"experts and FFN": 1.0},
              "times": {"compute": compute, "collectives": 2.0, "schedule": compute + 0.5,
                        "none": compute + 2.0, "ideal": compute},
              "mfu": {"schedule": mfu_schedule, "none": 0.1, "ideal": 0.2},
              "tokens_per_chip": 8192.0}
  if host:  # a remat policy's residuals in host memory
    estimate["host_transfers"] = {"to host": {"seconds": 1.25, "bytes": 2e10},
                                  "from host": {"seconds": 1.5, "bytes": 2.4e10}}
  return {"total": 90 * 2 ** 30, "compiler_estimate": estimate,
          "estimate": {"mfu": {"overlap": 0.5, "serial": 0.4}},
          "compiled": [{"compile_s": 1229.4, "memory": {"host_temp": 18 * 2 ** 30 * host},
                        "collectives_per_step": {"op": {
              "all-gather": {"bytes": 3 * 2 ** 30}, "all-reduce": {"bytes": 0}}}}]}


def test_tables_mark_rows_older_than_the_code_and_label_each_figure(tmp_path):
  rows = scaling_rows.ROWS[:2]
  for row, commit, plan in ((rows[0], "aaa", _plan(10.0, 4.0, 0.171)),
                            (rows[1], "bbb", _plan(9.0, 3.0, 0.178, host=True))):
    (tmp_path / f"{row.name}.log").write_text("plan: ...\n" + json.dumps(plan) + "\n")
    (tmp_path / f"{row.name}.meta.json").write_text(json.dumps(
        {"commit": commit, "date": "2026-11-30T14:00:00+00:00"}))
  # a compile that did not finish has no JSON line: not a row yet
  (tmp_path / "long_128k.log").write_text("compiling depth 78 ...\n")
  (tmp_path / "long_128k.meta.json").write_text("{}")
  assert scaling_rows.read_row(str(tmp_path), "long_128k") == (None, None)
  assert scaling_rows.read_row(str(tmp_path), "long_200k") == (None, None)
  found = [(row, *scaling_rows.read_row(str(tmp_path), row.name)) for row in rows]
  text = scaling_rows.format_tables(found, stale={rows[0].name})
  first, second = text.split("\n\n")
  assert "aaa, 2026-11-30 (older than the code)" in first
  assert "bbb, 2026-11-30 |" in first and "90.00 GiB" in first
  assert "3.0 GiB (all-gather 3.0)" in first and "1,229 s" in first
  assert "| per step per device (compiler estimate) | headline | headline_dense_keys |" in second
  assert "| DSA sparse | 4.00 s | 3.00 s |" in second
  assert "| experts and FFN | 6.00 s (custom calls 1.00 s) | 6.00 s (custom calls 1.00 s) |" in second
  assert "**10.50 s (17.1%)**" in second and "**9.50 s (17.8%)**" in second
  assert "| collectives on the torus / exposed in the schedule | 2.00 / 0.50 s |" in second
  assert "| bound (roofline): MFU overlap / none | 50.0% / 40.0% |" in second
  assert "| 90.00 GiB (+ 18.00 GiB in host memory) |" in first
  assert "| 90.00 GiB |" in first
  assert ("| host link, to / from host memory (the chip's stated host link) | - / - | "
          "1.25 / 1.50 s |") in second


def test_an_unknown_row_is_an_error_naming_the_rows():
  proc = subprocess.run([sys.executable, "tools/scaling_rows.py", "--rows=headline,nope"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0 and "--rows: unknown ['nope']" in proc.stderr
  assert "headline_dense_keys" in proc.stderr


def test_a_row_is_older_than_the_code_by_its_flags_or_its_code():
  row = scaling_rows.BY_NAME["long_128k"]
  command = " ".join(scaling_rows.command(row, "/out")[1:])
  head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                        text=True).stdout.strip()
  same_code = not scaling_rows.code_changed_since(head, str(ROOT))
  assert scaling_rows.is_stale(row, {"command": command, "commit": head}, "/out",
                               str(ROOT)) != same_code
  # other flags, uncommitted changes, a commit git does not know: older, whatever the code
  for meta in ({"command": command + " --layers=4", "commit": head},
               {"command": command, "commit": head[:12] + "+changes"},
               {"command": command, "commit": "0" * 40}):
    assert scaling_rows.is_stale(row, meta, "/out", str(ROOT)), meta
