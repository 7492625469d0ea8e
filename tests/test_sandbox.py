"""The sandbox contains hostile programs, for a root caller and for a normal user's
(glm5_jax/posttrain/sandbox.py; the probes: tests/sandbox_probes.py).

Each probe runs in a subprocess of its own (`python tests/sandbox_probes.py`, the command the
report uses), so its stand-in machine (home, project, TMPDIR, host sockets) never touches this
process. CI runs as root: the normal-user case drops to uid 4242 in that subprocess. Where
bubblewrap cannot run (`isolation().mode == "none"`) those tests skip and say why; the refusal
test runs everywhere.
"""

import json
import os
import subprocess
import sys

import pytest

from glm5_jax.posttrain import sandbox
from glm5_jax.posttrain.sandbox import Limits

ISO = sandbox.isolation()
isolated = pytest.mark.skipif(ISO.mode == "none", reason=f"no sandbox here: {ISO.reason}")
PROBES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_probes.py")
FAST = Limits(wall_seconds=3.0, cpu_seconds=2, processes=8, memory_bytes=256 << 20,
              output_bytes=4096)
NORMAL_UID = 4242


def probe_report(*flags) -> dict:
  proc = subprocess.run([sys.executable, PROBES, *flags], capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def escapes(report: dict) -> dict:
  assert "probes" in report, report
  return {name: p["why"] for name, p in report["probes"].items() if not p["contained"]}


@isolated
@pytest.mark.skipif(os.geteuid() != 0, reason="the caller is not root")
def test_every_probe_is_contained_for_a_root_caller():
  report = probe_report()
  assert report["mode"] == "bwrap" and len(report["probes"]) >= 39, report
  assert escapes(report) == {}


@isolated
def test_every_probe_is_contained_for_a_normal_user():
  report = probe_report(f"--as-uid={NORMAL_UID}") if os.geteuid() == 0 else probe_report()
  if "skipped" in report:
    pytest.skip(report["skipped"])
  assert report["uid"] != 0 and report["mode"] == "bwrap", report
  # A normal user cannot make a cgroup here: the caller's watchdog holds the run's totals.
  assert (report["memory"], report["cpu"]) == ("watchdog", "watchdog"), report
  assert escapes(report) == {}


@isolated
def test_a_good_program_runs_with_its_files_and_the_allow_list_only(monkeypatch, tmp_path):
  files = {"main.py": "import json, os, lib\nprint(json.dumps([lib.f(3), os.listdir('/'), "
                      "os.getcwd()]))\n", "lib.py": "f = lambda x: x * 2\n", "pkg/data.txt": ""}
  monkeypatch.chdir(tmp_path)
  r = sandbox.run_python(files, "main.py", limits=FAST)
  assert r.ok and r.mode == "bwrap", r
  value, root, cwd = json.loads(r.output)
  assert value == 6 and cwd == sandbox.BOX, r.output
  assert not {"root", "home", "run", "var", "work"} & set(root), root


@isolated
def test_a_hidden_path_inside_a_mounted_one_is_refused(monkeypatch):
  monkeypatch.setattr(sandbox, "_HIDDEN", set())
  inside = os.path.join(os.path.realpath(sys.base_prefix), "lib")
  with pytest.raises(sandbox.SandboxError, match=f"hidden path {inside} is inside"):
    sandbox.run_python({"main.py": ""}, "main.py", hide=[inside])
  sandbox.hide_in_this_process("gs://bucket/run", "", "/tmp/elsewhere")
  assert sandbox._HIDDEN == {"/tmp/elsewhere"}
  assert sandbox.run_python({"main.py": "print(1)"}, "main.py", limits=FAST).ok


def test_refuses_without_a_sandbox_unless_unsafe(monkeypatch, tmp_path):
  monkeypatch.setattr(sandbox, "isolation", lambda: sandbox.Isolation("none", "test: no bwrap"))
  with pytest.raises(sandbox.SandboxError, match="refusing to run untrusted code: test: no "
                     "bwrap; or pass allow_unsafe=True"):
    sandbox.run_python({"main.py": "print(1)"}, "main.py")
  monkeypatch.setenv("TMPDIR", str(tmp_path))
  monkeypatch.setattr("tempfile.tempdir", None)
  # Unsafe: the program runs in a fresh directory, which is removed even when it made a
  # subdirectory unreadable.
  program = ("import os\nprint(os.environ.get('HOME'))\nos.makedirs('d/e')\nos.chmod('d', 0)\n")
  r = sandbox.run_python({"main.py": program}, "main.py", limits=FAST, allow_unsafe=True)
  assert r.ok and r.mode == "none" and "glm5-sandbox-" in r.output, r
  assert os.listdir(tmp_path) == []


def test_unsafe_runs_are_still_held_to_the_run_totals(monkeypatch):
  """Without a sandbox the watchdog reads the boot's process tree in the host's /proc."""
  monkeypatch.setattr(sandbox, "isolation", lambda: sandbox.Isolation("none", "test: no bwrap"))
  spin = ("import os, time\nfor _ in range(3):\n  if os.fork() == 0:\n"
          "    while time.process_time() < 0.2:\n      pass\n    os._exit(0)\n"
          "for _ in range(3):\n  os.wait()\nprint('not stopped')\n")
  limits = Limits(wall_seconds=10.0, cpu_seconds=0.3)
  r = sandbox.run_python({"main.py": spin}, "main.py", allow_unsafe=True, limits=limits)
  assert (r.killed_by, r.exit_code, r.ok) == ("cpu_seconds", -9, False), r
  assert "not stopped" not in r.output
  assert sandbox.stop_reason(r, limits) == "used more than 0.3 s of CPU (the whole run)"


def test_bubblewrap_missing_is_one_line_naming_the_install(monkeypatch):
  monkeypatch.setattr(sandbox, "_bwrap_path", lambda: None)
  iso = sandbox.isolation.__wrapped__()
  assert iso.mode == "none" and "apt-get install -y bubblewrap" in iso.reason, iso
  assert "\n" not in iso.reason


@pytest.mark.parametrize("field", ["wall_seconds", "cpu_seconds", "memory_bytes", "processes",
                                   "file_bytes", "open_files", "output_bytes", "tmpfs_bytes"])
def test_a_limit_of_zero_or_below_is_an_error_naming_it(field):
  for bad in (0, -1):
    with pytest.raises(ValueError, match=f"sandbox.{field}: must be a finite number > 0"):
      sandbox.run_python({"main.py": ""}, "main.py", limits=Limits(**{field: bad}))


def test_file_paths_must_stay_in_the_box():
  for bad in ("../x.py", "/etc/x.py", "a//b.py", ""):
    with pytest.raises(ValueError, match="must be relative"):
      sandbox.run_python({"main.py": "", bad: ""}, "main.py")


def test_an_rl_config_with_a_code_env_needs_a_sandbox_or_allow_unsafe(monkeypatch):
  from glm5_jax.config import ConfigError
  from glm5_jax.posttrain import tasks
  from glm5_jax.posttrain.config import rl_config
  monkeypatch.setattr(sandbox, "isolation", lambda: sandbox.Isolation("none", "no bwrap"))
  rl = rl_config(env="code")
  with pytest.raises(ConfigError, match=r"^config.rl.sandbox.allow_unsafe: environment 'code' "
                     r"runs model-written code and this machine has no sandbox \(no bwrap\)"):
    tasks.validate_tasks(rl)
  rl.sandbox.allow_unsafe = True
  tasks.validate_tasks(rl)
