"""docs/scaling.md's compiled rows, recompiled by one command and printed as its tables.

  python tools/scaling_rows.py --out_dir=/work/plan_artifacts/rows              # every row
  python tools/scaling_rows.py --out_dir=... --rows=headline,long_128k            # some rows
  python tools/scaling_rows.py --out_dir=... --print_only                         # tables only
  python tools/scaling_rows.py --dry_run                                          # the commands

Each row is one `tools/plan_memory.py` run with the TPU compiler ahead of time (the `tpu-aot`
extra; no TPU): the full model depth compiled whole (nothing extrapolated), its optimized module
saved (`<row>.hlo.gz`, for `tools/plan_cost.py`), its output (`<row>.log`, whose last line is
the JSON the tables are built from) and `<row>.meta.json` (the commit and command it was
compiled from, the wall time). A row whose log is complete is not compiled again; one compiled
from a commit whose code (`CODE_PATHS`: the package, the kernels, the configs, the planner)
differs from the checkout's is printed marked "older than the code" until `--stale=recompile`
compiles it again. The rows run one at a time (each takes
14-20 GB of host memory and 15-50 minutes on 2 cores; a swap file helps), so a long run can be
stopped and rerun: finished rows stay.

The tables: per row, memory per device, collectives per step, the TPU compiler's own estimate
(compute per category, collectives on the torus and what the schedule leaves exposed, the step
time and MFU three ways: the compiled schedule's overlap, none, ideal) and the roofline bound
beside it, each labelled as what it is.
"""

import datetime
import json
import os
import shlex
import subprocess
import sys
import time

from absl import app, flags

from glm5_jax.planning.scaling_rows import (BY_NAME, CODE_PATHS, ROWS, Row, command,
                                            format_tables, is_stale, read_row)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/glm5_scaling_rows", "Where each row's log, "
                               "module and meta go (kept between runs).")
_ROWS = flags.DEFINE_list("rows", [row.name for row in ROWS], "Rows to compile and print, in "
                          "this order: " + ", ".join(row.name for row in ROWS) + ".")
_PRINT_ONLY = flags.DEFINE_bool("print_only", False, "Compile nothing: the tables from the "
                                "rows already in --out_dir.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print each row's command and stop.")
_STALE = flags.DEFINE_enum("stale", "mark", ["mark", "recompile"], "A row compiled from "
                           "older code: printed marked (mark) or compiled again.")


def git_commit() -> str:
  """The checkout's commit, with `+changes` when its code (`CODE_PATHS`) differs from it."""
  rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                       capture_output=True, text=True).stdout.strip() or "unknown"
  dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *CODE_PATHS],
                         cwd=ROOT).returncode != 0
  return rev + ("+changes" if dirty else "")


def compile_row(row: Row, out_dir: str, commit: str) -> None:
  """Runs the row's plan_memory command; the log and meta are written only when it finished
  (a stopped or failed compile leaves `<row>.log.partial` and the error's tail printed)."""
  cmd = command(row, out_dir)
  partial = os.path.join(out_dir, row.name + ".log.partial")
  print(f"[{row.name}] compiling: {shlex.join(cmd[1:])}", flush=True)
  start = time.time()
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  with open(partial, "w") as out:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.PIPE,
                          text=True)
  seconds = time.time() - start
  if proc.returncode != 0:
    raise SystemExit(f"[{row.name}] plan_memory.py failed after {seconds:.0f} s (exit "
                     f"{proc.returncode}); its output: {partial}\n{proc.stderr[-2000:]}")
  with open(os.path.join(out_dir, row.name + ".meta.json"), "w") as f:
    json.dump({"row": row.name, "commit": commit, "command": shlex.join(cmd[1:]),
               "wall_s": round(seconds, 1),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="seconds")}, f, indent=1)
  os.replace(partial, os.path.join(out_dir, row.name + ".log"))
  print(f"[{row.name}] done in {seconds:.0f} s", flush=True)


def main(argv):
  del argv
  unknown = [name for name in _ROWS.value if name not in BY_NAME]
  if unknown:
    raise SystemExit(f"--rows: unknown {unknown}; the rows are {list(BY_NAME)}")
  rows = [BY_NAME[name] for name in _ROWS.value]
  out_dir = _OUT_DIR.value
  if _DRY_RUN.value:
    for row in rows:
      print(f"# {row.name}: {row.title}\n{shlex.join(command(row, out_dir)[1:])}")
    return
  os.makedirs(out_dir, exist_ok=True)
  commit = git_commit()
  if not _PRINT_ONLY.value:
    for i, row in enumerate(rows):
      _, meta = read_row(out_dir, row.name)
      if meta is not None and (_STALE.value == "mark" or not is_stale(row, meta, out_dir, ROOT)):
        print(f"[{row.name}] compiled from {meta['commit']} ({meta['date']}): kept "
              f"({i + 1} of {len(rows)})", flush=True)
        continue
      print(f"[{row.name}] row {i + 1} of {len(rows)}", flush=True)
      compile_row(row, out_dir, commit)
  found = []
  for row in rows:
    plan, meta = read_row(out_dir, row.name)
    if plan is None:
      print(f"[{row.name}] not compiled yet: left out of the tables")
      continue
    found.append((row, plan, meta))
  print(f"\n== docs/scaling.md's rows, from {out_dir} (checkout {commit}) ==\n")
  print(format_tables(found, {row.name for row, _, meta in found
                             if is_stale(row, meta, out_dir, ROOT)}))


if __name__ == "__main__":
  app.run(main)
