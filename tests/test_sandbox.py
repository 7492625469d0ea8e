"""The sandbox contains hostile programs: each scores 0, leaves no process or file behind, and
the caller keeps working (glm5_jax/posttrain/sandbox.py).

Every hostile program prints ESCAPED and exits 0 only if its attack worked, so "scored 0" is
`not result.ok` and ESCAPED absent. Where this OS cannot isolate (`isolation().mode ==
"none"`) the isolation tests skip and say why; the refusal test runs everywhere.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from glm5_jax.posttrain import sandbox
from glm5_jax.posttrain.sandbox import Limits

ISO = sandbox.isolation()
isolated = pytest.mark.skipif(ISO.mode == "none", reason=f"this OS cannot isolate: {ISO.reason}")
FAST = Limits(wall_seconds=3.0, cpu_seconds=2, processes=8, memory_bytes=256 << 20,
              output_bytes=4096)


def _user_mode_works() -> bool:
  r = sandbox._run({"m.py": "print('ok')"}, "m.py", FAST, (), "user")
  return r.ok and r.output.strip() == "ok"


def _group_members(pgid: int) -> list[int]:
  """Processes whose process group or session is `pgid`."""
  pids = []
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/stat") as f:
          fields = f.read().rsplit(")", 1)[1].split()
      except OSError:
        continue
      if int(fields[2]) == pgid or int(fields[3]) == pgid:
        pids.append(int(name))
  return pids


def _uid_processes(uid: int) -> int:
  n = 0
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        n += os.stat(f"/proc/{name}").st_uid == uid
      except OSError:
        pass
  return n


def _boxes() -> set:
  return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("glm5-sandbox-")}


def contained(program: str, limits: Limits = FAST, *, mode: str | None = None, hide=()):
  """Runs `program`; asserts it scored 0 and left no process or box behind; returns it."""
  boxes = _boxes()
  if mode is None:
    r = sandbox.run_python({"main.py": program}, "main.py", limits=limits, hide=hide)
  else:
    r = sandbox._run({"main.py": program}, "main.py", limits,
                     [os.getcwd(), *map(os.path.abspath, hide)], mode)
  assert not r.ok and not re.search("^ESCAPED", r.output, re.M), r
  assert len(r.output.encode()) <= limits.output_bytes + 4, len(r.output)
  time.sleep(0.05)
  assert _group_members(r.pgid) == [], "processes left in the run's group"
  assert _boxes() <= boxes, "the run's directory was not removed"
  return r


@isolated
def test_infinite_loop_is_killed_by_the_cpu_limit():
  r = contained("while True:\n  pass\n", Limits(wall_seconds=10.0, cpu_seconds=1))
  assert not r.timed_out and r.exit_code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL), r
  assert r.seconds < 5


@isolated
def test_sleeping_past_the_timeout_is_killed():
  r = contained("import time\ntime.sleep(60)\nprint('ESCAPED')\n", Limits(wall_seconds=1.0))
  assert r.timed_out and r.seconds < 3, r


@isolated
def test_fork_bomb_is_bounded_and_leaves_nothing():
  before = _uid_processes(FAST.uid) if ISO.mode == "root" else 0
  program = ("import os, time\n"
             "n = 0\n"
             "while time.time() < 1e12:\n"
             "  try:\n"
             "    os.fork(); n += 1\n"
             "  except OSError:\n"
             "    time.sleep(0.01)\n")
  contained(program, Limits(wall_seconds=1.5, cpu_seconds=3, processes=8))
  if ISO.mode == "root":
    assert _uid_processes(FAST.uid) <= before


@isolated
def test_setsid_double_fork_dies_with_the_run():
  token = f"{os.getpid() % 1000}.{int(time.time()) % 997}1"
  program = ("import os\n"
             "if os.fork() == 0:\n"
             "  os.setsid()\n"
             "  if os.fork() == 0:\n"
             f"    os.execv('/bin/sleep', ['sleep', '3600.{token}'])\n"
             "  os._exit(0)\n"
             "os.wait()\n"
             "raise SystemExit(3)\n")
  contained(program)
  time.sleep(0.1)
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/cmdline", "rb") as f:
          assert f"3600.{token}".encode() not in f.read(), "the detached child survived"
      except OSError:
        pass


@isolated
def test_memory_bomb_fails_inside():
  r = contained("x = bytearray(4 << 30)\nprint('ESCAPED')\n")
  assert "MemoryError" in r.output
  contained("chunks = []\nwhile True:\n  chunks.append(bytearray(16 << 20))\n")


@isolated
def test_a_gigabyte_of_output_is_cut_off():
  program = ("import sys\nblock = b'x' * (1 << 20)\n"
             "for _ in range(1024):\n  sys.stdout.buffer.write(block)\nprint('ESCAPED')\n")
  r = contained(program, Limits(wall_seconds=10.0, output_bytes=4096))
  assert r.output_truncated and not r.timed_out and r.seconds < 5, r
  assert r.output == "x" * 4096


@isolated
@pytest.mark.parametrize("mode", ["default", "user"])
def test_no_network_not_even_the_callers_loopback(mode):
  if mode == "user" and not _user_mode_works():
    pytest.skip("user namespaces are not allowed here")
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    program = ("import socket\n"
               f"socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'x')\n"
               "print('ESCAPED')\n")
    r = contained(program, mode=None if mode == "default" else "user")
    assert "Error" in r.output, r.output
    with pytest.raises(BlockingIOError):
      server.accept()
  contained("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\n"
            "print('ESCAPED')\n")


@pytest.fixture(params=["tmp", "elsewhere"])
def caller_dir(request, tmp_path):
  """A caller's workdir under /tmp (which the sandbox covers whole) and one elsewhere (under
  this checkout: only the hiding of the caller's cwd and `hide` covers it)."""
  if request.param == "tmp":
    yield tmp_path
    return
  path = tempfile.mkdtemp(prefix=".sandbox-test-", dir=os.path.dirname(os.path.abspath(__file__)))
  try:
    yield __import__("pathlib").Path(path)
  finally:
    shutil.rmtree(path)


@isolated
@pytest.mark.parametrize("mode", ["default", "user"])
def test_secrets_and_the_callers_workdir_stay_unseen(mode, caller_dir, monkeypatch):
  if mode == "user" and not _user_mode_works():
    pytest.skip("user namespaces are not allowed here")
  workdir = caller_dir / "run"
  workdir.mkdir()
  (workdir / "secret.txt").write_text("hunter2")
  os.chmod(caller_dir, 0o755)  # readable by anyone on the host: only the sandbox hides it
  os.chmod(workdir, 0o755)
  os.chmod(workdir / "secret.txt", 0o644)
  monkeypatch.setenv("GLM5_SECRET", "hunter2")
  monkeypatch.chdir(workdir)
  m = None if mode == "default" else "user"
  r = contained("import os\nv = os.environ.get('GLM5_SECRET')\n"
                "if v: print('ESCAPED', v)\nraise SystemExit(1)\n", mode=m)
  assert "hunter2" not in r.output
  reader = f"print(open({str(workdir / 'secret.txt')!r}).read())\n"
  # The control: with nothing hidden, a world-readable file outside /tmp IS readable (so the
  # checks below can fail); under /tmp the private tmpfs hides it even then.
  control = sandbox._run({"main.py": reader}, "main.py", FAST, [], m or ISO.mode)
  under_tmp = str(caller_dir).startswith(tempfile.gettempdir() + "/")
  assert ("hunter2" in control.output) == (not under_tmp), control
  for path in (workdir / "secret.txt", "../secret.txt"):
    r = contained(f"print('ESCAPED', open({str(path)!r}).read())\n", mode=m)
    assert "hunter2" not in r.output
  other = caller_dir / "elsewhere"  # a path outside the cwd, named in `hide`
  other.mkdir()
  (other / "key").write_text("hunter2")
  os.chmod(other, 0o755)
  os.chmod(other / "key", 0o644)
  r = contained(f"print('ESCAPED', open({str(other / 'key')!r}).read())\n", mode=m,
                hide=[str(other)])
  assert "hunter2" not in r.output


@isolated
def test_writes_outside_its_directory_do_not_land(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  token = f"glm5-escape-{os.getpid()}"
  targets = [f"/tmp/{token}", f"/var/tmp/{token}", f"/dev/shm/{token}", f"../{token}",
             f"../../{token}", str(tmp_path / token), f"/{token}"]
  program = ("import os\nwrote = []\n"
             f"for path in {targets!r}:\n"
             "  try:\n"
             "    open(path, 'w').write('x'); wrote.append(path)\n"
             "  except OSError:\n"
             "    pass\n"
             "print('wrote (inside the sandbox):', wrote)\nraise SystemExit(1)\n")
  contained(program)
  for path in targets:
    assert not os.path.exists(path if path.startswith("/") else tmp_path / path), path
  assert not os.path.exists(f"/tmp/{token}")


@isolated
def test_killing_its_parent_and_everyone_leaves_the_caller_working():
  bystander = subprocess.Popen(["sleep", "30"])
  try:
    program = ("import os, signal\n"
               "for pid in (os.getppid(), 1, -1, " + str(os.getpid()) + f", {bystander.pid}):\n"
               "  try:\n"
               "    os.kill(pid, signal.SIGKILL)\n"
               "  except OSError:\n"
               "    pass\n"
               "raise SystemExit(1)\n")
    contained(program)
    assert bystander.poll() is None, "the sandbox killed a process outside it"
  finally:
    bystander.kill()
    bystander.wait()
  r = sandbox.run_python({"main.py": "print(6 * 7)"}, "main.py", limits=FAST)
  assert r.ok and r.output.strip() == "42", r  # and the sandbox still works


@isolated
@pytest.mark.parametrize("mode", ["default", "user"])
def test_a_good_program_runs_with_its_files(mode, monkeypatch):
  """Also when the caller's cwd is /tmp, and when the interpreter's directory is hidden."""
  if mode == "user" and not _user_mode_works():
    pytest.skip("user namespaces are not allowed here")
  files = {"main.py": "import lib\nprint(lib.f(3))\n", "lib.py": "f = lambda x: x * 2\n"}
  monkeypatch.chdir("/tmp")
  for hide in ([], [os.path.dirname(os.path.realpath(sys.base_prefix))]):
    if mode == "default":
      r = sandbox.run_python(files, "main.py", limits=FAST, hide=hide)
    else:
      r = sandbox._run(files, "main.py", FAST, ["/tmp", *hide], "user")
    assert r.ok and r.output == "6\n" and r.mode == (ISO.mode if mode == "default" else "user"), r


def test_refuses_without_isolation_unless_unsafe(monkeypatch):
  monkeypatch.setattr(sandbox, "isolation", lambda: sandbox.Isolation("none", "test: no ns"))
  with pytest.raises(sandbox.SandboxError, match="allow_unsafe=True"):
    sandbox.run_python({"main.py": "print(1)"}, "main.py")
  r = sandbox.run_python({"main.py": "import os\nprint(os.environ.get('HOME'))"}, "main.py",
                         limits=FAST, allow_unsafe=True)
  assert r.ok and r.mode == "none" and "glm5-sandbox-" in r.output, r


@pytest.mark.parametrize("field", ["wall_seconds", "cpu_seconds", "memory_bytes", "processes",
                                   "file_bytes", "open_files", "output_bytes"])
def test_a_limit_of_zero_or_below_is_an_error_naming_it(field):
  for bad in (0, -1):
    with pytest.raises(ValueError, match=f"sandbox.{field}: must be a finite number > 0"):
      sandbox.run_python({"main.py": ""}, "main.py", limits=Limits(**{field: bad}))


@isolated
def test_paths_hidden_for_the_process_stay_hidden(caller_dir, monkeypatch):
  """The RL loop registers its workdir (`hide_in_this_process`): later runs cannot read it."""
  monkeypatch.setattr(sandbox, "_HIDDEN", set())
  run = caller_dir / "rl_workdir"
  run.mkdir()
  (run / "checkpoint").write_text("hunter2")
  for path in (caller_dir, run, run / "checkpoint"):
    os.chmod(path, 0o755 if path.is_dir() else 0o644)
  reader = f"print('ESCAPED', open({str(run / 'checkpoint')!r}).read())\n"
  sandbox.hide_in_this_process(str(run), "gs://bucket/run", "")
  assert sandbox._HIDDEN == {str(run)}
  r = contained(reader)
  assert "hunter2" not in r.output
