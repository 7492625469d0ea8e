"""Hostile programs against glm5_jax/posttrain/sandbox.py, run as the env's caller runs them.

  python tests/sandbox_probes.py [--sandbox=PATH] [--as-uid=UID] [--only=a,b]   # JSON report

Stdlib only, and the sandbox module is loaded by its file path, so this also runs as a normal
user (`--as-uid`: the test drops to that uid in a subprocess, with an interpreter and a copy of
the sandbox files (SIBLINGS) that uid can read). Each probe is (program, limits, host check): the
program prints a line starting "ESCAPED" when its attack worked; the host check looks for what
the program may have left or done outside (a file, a process, a changed byte) and returns a
text when it finds one. A probe is contained when neither reports anything.

The setup stands in for a trainer's machine: a home with `~/.bashrc` and a 0600 credentials
file, a project (the caller's cwd) with source files, the run's workdir (registered with
`hide_in_this_process`), another run's checkpoint, TMPDIR outside /tmp, and host services: a
TCP and a UDP port on 127.0.0.1, UNIX sockets in the abstract namespace, in /tmp and under /run.
"""

import argparse
import contextlib
import functools
import glob
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
SANDBOX = os.path.join(HERE, "..", "glm5_jax", "posttrain", "sandbox.py")
SECRET = "hunter2"
SIBLINGS = ("sandbox_boot.py", "sandbox_budget.py")  # the modules sandbox.py imports


def load_file(name: str, path: str):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def load_sandbox(path: str = SANDBOX):
  """sandbox.py and its siblings (SIBLINGS) from their files, under empty stand-ins for
  their packages (no jax; a normal user may not be able to read the installed package). Only
  in a process of its own (the script), never beside the real package."""
  for package in ("glm5_jax", "glm5_jax.posttrain"):
    sys.modules[package] = types.ModuleType(package)
  path = os.path.abspath(path)
  for sibling in SIBLINGS:
    name = sibling[:-len(".py")]
    module = load_file(f"glm5_jax.posttrain.{name}", os.path.join(os.path.dirname(path), sibling))
    setattr(sys.modules["glm5_jax.posttrain"], name, module)
  return load_file("glm5_jax.posttrain.sandbox", path)


def write(path: str, text: str, mode: int = 0o644) -> str:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(text)
  os.chmod(path, mode)
  return path


@contextlib.contextmanager
def machine(base: str):
  """The stand-in trainer machine under `base` (a dir the caller owns); yields a dict."""
  token = f"glm5probe{os.getpid()}x{int(time.time() * 1000) % 100000}"
  m = {"token": token, "base": base, "home": f"{base}/home", "project": f"{base}/project",
       "cwd": f"{base}/cwd", "tmpdir": f"{base}/tmpdir", "seen_boxes": set(), "workdir": f"{base}/runs/this",
       "lock_file": f"/run/lock/{token}", "run_socket": f"/run/lock/{token}.sock",
       "tmp_socket": f"/tmp/{token}.sock", "abstract": f"\0{token}", "caller": os.getpid()}
  write(f"{m['home']}/.bashrc", "ORIGINAL")
  write(f"{m['home']}/.config/gcloud/credentials.db", SECRET, 0o600)
  os.chmod(f"{m['home']}/.config/gcloud", 0o700)
  write(f"{m['project']}/glm5_jax/model.py", "ORIGINAL")
  write(f"{m['cwd']}/notes.txt", SECRET)
  write(f"{m['workdir']}/checkpoint", SECRET)
  write(f"{base}/runs/other/checkpoint", "ORIGINAL")
  os.makedirs(m["tmpdir"], exist_ok=True)
  servers = []
  try:
    servers = open_services(m)
    yield m
  finally:
    for s in servers:
      s.close()
    for path in (m["run_socket"], m["tmp_socket"], m["lock_file"]):
      with contextlib.suppress(OSError):
        os.unlink(path)


def open_services(m: dict) -> list:
  tcp = socket.socket()
  tcp.bind(("127.0.0.1", 0))
  tcp.listen(4)
  udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  udp.bind(("127.0.0.1", 0))
  m["tcp_port"], m["udp_port"] = tcp.getsockname()[1], udp.getsockname()[1]
  servers = [tcp, udp]
  for name in ("abstract", "tmp_socket", "run_socket"):
    s = socket.socket(socket.AF_UNIX)
    s.bind(m[name])
    if not m[name].startswith("\0"):
      os.chmod(m[name], 0o777)  # a service open to every local user (e.g. a bus socket)
    s.listen(4)
    servers.append(s)
  for s in servers:
    s.setblocking(False)
  m["servers"] = servers
  return servers


def reached(m: dict) -> str | None:
  """Whether any host service got a connection or a datagram."""
  for s in m["servers"]:
    try:
      if s.type == socket.SOCK_DGRAM:
        s.recv(16)
      else:
        s.accept()[0].close()
      return f"a host service ({s.getsockname()!r}) was reached"
    except (BlockingIOError, OSError):
      pass
  return None


def try_all(calls: list[str], report: bool = True) -> str:
  """A program that runs each statement, printing ESCAPED and the statement when one works
  (`report`; a write is judged by the host check instead: inside, it may land in the box)."""
  tell = "print('ESCAPED', {!r})" if report else "pass"
  body = "".join(f"try:\n  {c}\n  {tell.format(c)}\nexcept Exception:\n  pass\n"
                 for c in calls)
  return "import os, socket\n" + body


def changed(*paths) -> str | None:
  for path in paths:
    if not os.path.exists(path):
      return f"{path} was removed"
    if open(path).read() not in ("ORIGINAL", SECRET):
      return f"{path} was modified"
  return None


def leftover(m: dict) -> str | None:
  """A process whose command line holds the token, or a box left in TMPDIR."""
  time.sleep(0.02)
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/cmdline", "rb") as f:
          if m["token"].encode() in f.read() and int(name) != os.getpid():
            return f"process {name} outlived the run"
      except OSError:
        pass
  boxes = set(glob.glob(f"{m['tmpdir']}/glm5-sandbox-*")) - m["seen_boxes"]
  m["seen_boxes"] |= boxes  # reported once, by the probe that left it
  return f"left {sorted(boxes)}" if boxes else None


SLEEPER = "os.execv('/bin/sleep', ['sleep', '3600.{token}'])"
SPIN = "    while time.process_time() < {seconds}:\n      pass\n"  # in a child, 4 spaces in
PROBES = {
    # ---- network and host sockets ----
    "tcp_loopback": lambda m: try_all([
        f"socket.create_connection(('127.0.0.1', {m['tcp_port']}), timeout=1)"]),
    "udp_loopback": lambda m: try_all([
        f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', "
        f"{m['udp_port']}))"], False),  # its own loopback may take it: the host check decides
    "dns_and_internet": lambda m: try_all(["socket.getaddrinfo('example.com', 80)",
                                           "socket.create_connection(('1.1.1.1', 53), 1)"]),
    "abstract_socket": lambda m: try_all([f"socket.socket(socket.AF_UNIX).connect({m['abstract']!r})"]),
    "tmp_socket": lambda m: try_all([f"socket.socket(socket.AF_UNIX).connect({m['tmp_socket']!r})"]),
    "run_socket": lambda m: try_all([f"socket.socket(socket.AF_UNIX).connect({m['run_socket']!r})"]),
    # ---- reading what the caller has ----
    "read_registered_workdir": lambda m: try_all([f"print(open({m['workdir']!r} + '/checkpoint').read())"]),
    "read_callers_cwd": lambda m: try_all([f"print(open({m['cwd']!r} + '/notes.txt').read())",
                                           "print(open('../notes.txt').read())"]),
    "read_credentials": lambda m: try_all([
        f"print(open({m['home']!r} + '/.config/gcloud/credentials.db').read())"]),
    "read_root_home": lambda m: try_all(["print(os.listdir('/root'))"]),
    "read_callers_proc": lambda m: try_all([f"print(open('/proc/{m['caller']}/environ').read())"]),
    "environment": lambda m: "import os\nif 'GLM5_PROBE_SECRET' in str(os.environ): print('ESCAPED')\n",
    "boot_command_line": lambda m: (
        "import os\nfor p in os.listdir('/proc'):\n  try:\n"
        "    t = open('/proc/' + p + '/cmdline').read()\n  except Exception:\n    continue\n"
        f"  if {m['workdir']!r} in t or {m['base']!r} in t: print('ESCAPED', t[:300])\n"),
    # ---- writing outside the box ----
    "write_project_source": lambda m: try_all([
        f"open({m['project']!r} + '/glm5_jax/model.py', 'a').write('x')"], False),
    "write_bashrc": lambda m: try_all([f"open({m['home']!r} + '/.bashrc', 'a').write('x')"], False),
    "write_other_checkpoint": lambda m: try_all([
        f"open({m['base']!r} + '/runs/other/checkpoint', 'a').write('x')"], False),
    "write_world_writable": lambda m: try_all([f"open({m['lock_file']!r}, 'w').write('x')"] + [
        f"open({p!r}, 'w').write('x')" for p in (f"/tmp/{m['token']}", f"/var/tmp/{m['token']}",
                                                 f"/dev/shm/{m['token']}", f"/{m['token']}")], False),
    "write_elsewhere_in_tree": lambda m: try_all([f"open('../{m['token']}', 'w').write('x')",
                                                  f"open('../../{m['token']}', 'w').write('x')",
                                                  f"open('/usr/{m['token']}', 'w').write('x')"], False),
    "disk_fill": lambda m: (  # 96 MiB in 2 MiB files (each under file_bytes), limit 32 MiB
        "import os\nn = 0\ntry:\n  for i in range(48):\n"
        "    open(f'f{i}', 'wb').write(b'x' * (2 << 20)); n += 1\nexcept OSError:\n  pass\n"
        "if n == 48: print('ESCAPED wrote 96 MiB')\n"),
    "file_size_limit": lambda m: try_all(["open('big', 'wb').write(b'x' * (64 << 20))"]),
    "undeletable_box": lambda m: (
        "import os\nos.makedirs('d/e')\nopen('d/e/f', 'w').write('x')\nos.chmod('d', 0)\n"),
    "concurrent_boxes": None,  # run by `concurrent_boxes` (two runs at once)
    # ---- processes ----
    "setsid_double_fork": lambda m: (
        "import os\nif os.fork() == 0:\n  os.setsid()\n  if os.fork() == 0:\n"
        f"    {SLEEPER.format(**m)}\n  os._exit(0)\nos.wait()\n"),
    "nohup": lambda m: f"import os\nos.system('nohup /bin/sleep 3600.{m['token']} >/dev/null 2>&1 &')\n",
    "sigterm_ignoring_child": lambda m: (
        "import os, signal\nif os.fork() == 0:\n  signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"  {SLEEPER.format(**m)}\n"),
    "cpu_spin": lambda m: "while True:\n  pass\n",
    "sleep_past_wall_clock": lambda m: "import time\ntime.sleep(60)\nprint('ESCAPED')\n",
    "fork_bomb": lambda m: (
        "import os, time\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n"
        "    time.sleep(0.01)\n"),
    "fork_bomb_starves_other_runs": None,  # run by `fork_bomb_starves_other_runs`
    "memory_4gib": lambda m: "x = bytearray(4 << 30)\nprint('ESCAPED allocated 4 GiB')\n",
    "memory_over_the_run_budget": lambda m: (  # 4 processes x 64 MiB touched, budget 128 MiB
        "import os, time\nkids = []\nfor _ in range(4):\n  pid = os.fork()\n  if pid == 0:\n"
        "    x = bytearray(64 << 20)\n    x[::4096] = b'x' * len(x[::4096])\n"
        "    open(f'held{os.getpid()}', 'w').close()\n    time.sleep(1.5)\n    os._exit(0)\n"
        "  kids.append(pid)\nend = time.time() + 2.0\nwhile time.time() < end:\n"
        "  held = [f for f in os.listdir('.') if f.startswith('held')]\n"
        "  if len(held) == 4: break\n  time.sleep(0.05)\n"
        "if len(held) == 4: print('ESCAPED 4 x 64 MiB held at once')\n"
        "for k in kids:\n  os.waitpid(k, 0)\n"),
    # Run totals: many processes, each under the per-process limit, together over the run's.
    "memory_plus_tmpfs_over_the_run_budget": lambda m: (  # 96 MiB of files + 64 MiB, budget 128
        "import time\nfor i in range(3):\n  open(f'f{i}', 'wb').write(b'x' * (32 << 20))\n"
        "x = bytearray(64 << 20)\nx[::4096] = b'x' * len(x[::4096])\ntime.sleep(1.0)\n"
        "print('ESCAPED 96 MiB of files and 64 MiB held for 1 s')\n"),
    "memory_out_of_sight": lambda m: (  # 160 MiB in no process's pages, budget 128 MiB
        "import ctypes, os, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.shmat.restype = ctypes.c_void_p\nheld, fds = [], []\n"
        "for i in range(5):  # SysV shared memory, detached: mapped by no one\n"
        "  sid = libc.shmget(0, 32 << 20, 0o1600)\n  if sid < 0:\n    break\n"
        "  addr = libc.shmat(sid, None, 0)\n  ctypes.memset(addr, 1, 32 << 20)\n"
        "  libc.shmdt(ctypes.c_void_p(addr))\n  held.append('shm')\n"
        "while len(held) < 5:  # then memfds, written, never mapped\n  try:\n"
        "    fd = os.memfd_create('m')\n    os.write(fd, b'x' * (32 << 20))\n"
        "  except OSError:\n    break\n  fds.append(fd)\n  held.append('memfd')\n"
        "time.sleep(1.0)\nif len(held) == 5: print('ESCAPED held 5 x 32 MiB', held)\n"),
    "cpu_over_the_run_budget": lambda m: (  # 4 processes x 0.3 s of CPU at once, budget 0.5 s
        f"import os, time\nkids = []\nfor _ in range(4):\n  pid = os.fork()\n  if pid == 0:\n"
        f"{SPIN.format(seconds=0.3)}    os._exit(0)\n  kids.append(pid)\n"
        "for k in kids:\n  os.waitpid(k, 0)\nprint('ESCAPED 1.2 s of CPU')\n"),
    "cpu_over_the_run_budget_unreaped": lambda m: (  # one after another, never waited for
        "import os, signal, time\nsignal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
        f"for _ in range(4):\n  pid = os.fork()\n  if pid == 0:\n{SPIN.format(seconds=0.3)}"
        "    os._exit(0)\n  while os.path.exists(f'/proc/{pid}'):  # gone once auto-reaped\n"
        "    time.sleep(0.02)\nprint('ESCAPED 1.2 s of CPU')\n"),
    "gigabyte_of_output": lambda m: (
        "import sys\nb = b'x' * (1 << 20)\nfor _ in range(1024):\n  sys.stdout.buffer.write(b)\n"
        "print('ESCAPED')\n"),
    # ---- the caller's processes ----
    "kill_caller": lambda m: try_all([f"os.kill({m['caller']}, 0)"]) + (
        "for pid in (os.getppid(), 1, -1):\n  try:\n    os.kill(pid, 9)\n  except OSError:\n"
        "    pass\n"),
    "ptrace_caller": lambda m: (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"if libc.ptrace(16, {m['caller']}, 0, 0) == 0: print('ESCAPED attached')\n"),
    "process_vm_readv_caller": lambda m: (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nbuf = ctypes.create_string_buffer(8)\n"
        "class IOV(ctypes.Structure):\n  _fields_ = [('b', ctypes.c_void_p), ('n', ctypes.c_size_t)]\n"
        "local = IOV(ctypes.addressof(buf), 8)\nremote = IOV(0x400000, 8)\n"
        f"if libc.process_vm_readv({m['caller']}, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) > 0:\n"
        "  print('ESCAPED read the caller')\n"),
}
LIMITS = {"cpu_spin": dict(wall_seconds=6.0, cpu_seconds=0.5),
          "sleep_past_wall_clock": dict(wall_seconds=1.0),
          "fork_bomb": dict(wall_seconds=1.0, cpu_seconds=3, processes=8),
          "disk_fill": dict(tmpfs_bytes=32 << 20, wall_seconds=6.0),
          "memory_over_the_run_budget": dict(memory_bytes=128 << 20, wall_seconds=6.0),
          "memory_plus_tmpfs_over_the_run_budget": dict(
              memory_bytes=128 << 20, tmpfs_bytes=256 << 20, file_bytes=32 << 20, wall_seconds=6.0),
          "memory_out_of_sight": dict(memory_bytes=128 << 20, file_bytes=32 << 20,
                                      wall_seconds=6.0),
          "cpu_over_the_run_budget": dict(cpu_seconds=0.5, wall_seconds=10.0),
          "cpu_over_the_run_budget_unreaped": dict(cpu_seconds=0.5, wall_seconds=10.0),
          "gigabyte_of_output": dict(wall_seconds=10.0, output_bytes=4096)}
def ended_by(limit: str, m: dict, r) -> str | None:
  """The sandbox, not the program, must have ended the run, with the run total `limit`."""
  killed_by = getattr(r, "killed_by", "")
  return None if killed_by == limit else (
      f"not ended by the run's {limit} (killed_by={killed_by!r}, exit {r.exit_code}, "
      f"{r.seconds:.1f} s)")


HOST_CHECKS = {
    "write_project_source": lambda m, r: changed(f"{m['project']}/glm5_jax/model.py"),
    "write_bashrc": lambda m, r: changed(f"{m['home']}/.bashrc"),
    "write_other_checkpoint": lambda m, r: changed(f"{m['base']}/runs/other/checkpoint"),
    "write_world_writable": lambda m, r: next((f"{p} stayed on the host" for p in (
        m["lock_file"], f"/tmp/{m['token']}", f"/var/tmp/{m['token']}", f"/dev/shm/{m['token']}",
        f"/{m['token']}") if os.path.exists(p)), None),
    "write_elsewhere_in_tree": lambda m, r: next((f"{p} stayed on the host" for p in glob.glob(
        f"{m['base']}/**/{m['token']}", recursive=True)), None),
    "cpu_spin": lambda m, r: None if (not r.timed_out and r.seconds < 5) else f"ran {r.seconds:.1f} s",
    "sleep_past_wall_clock": lambda m, r: None if (r.timed_out and r.seconds < 10) else (
        f"timed_out={r.timed_out} after {r.seconds:.1f} s"),
    "gigabyte_of_output": lambda m, r: None if (r.output_truncated and len(r.output) <= 4096) else (
        f"{len(r.output)} bytes kept"),
    "memory_4gib": lambda m, r: None if "MemoryError" in r.output else f"no MemoryError: {r.output[-80:]!r}",
    "kill_caller": lambda m, r: None,  # the caller reporting at all is the check
    **{name: functools.partial(ended_by, limit) for name, limit in (
        ("memory_over_the_run_budget", "memory_bytes"),
        ("memory_plus_tmpfs_over_the_run_budget", "memory_bytes"),
        ("cpu_over_the_run_budget", "cpu_seconds"),
        ("cpu_over_the_run_budget_unreaped", "cpu_seconds"))},
}


def run_one(sb, m: dict, name: str, limits=None):
  """(escape text or None, result) for probe `name`."""
  limits = limits or sb.Limits(**{**dict(wall_seconds=4.0, cpu_seconds=2, processes=16,
                                          memory_bytes=256 << 20, output_bytes=8192),
                                   **LIMITS.get(name, {})})
  r = sb.run_python({"main.py": PROBES[name](m)}, "main.py", limits=limits)
  lines = [ln for ln in r.output.splitlines() if ln.startswith("ESCAPED")]
  found = [lines[0][:200] if lines else None, HOST_CHECKS.get(name, lambda m, r: None)(m, r),
           reached(m), leftover(m)]  # every check runs: each clears what it found
  found = next((f for f in found if f), None)
  return found, r


def fork_bomb_starves_other_runs(sb, m: dict) -> str | None:
  """A fork bomb in one run; meanwhile another run, with the same limits, forks 3 children."""
  limits = sb.Limits(wall_seconds=2.0, cpu_seconds=3, processes=8)
  bomb = threading.Thread(target=run_one, args=(sb, m, "fork_bomb", limits))
  bomb.start()
  time.sleep(0.6)
  program = ("import os\nfor _ in range(3):\n  if os.fork() == 0:\n    os._exit(0)\n"
             "  os.wait()\nprint('forked 3')\n")
  r = sb.run_python({"main.py": program}, "main.py", limits=limits)
  bomb.join()
  return None if "forked 3" in r.output else f"the other run could not fork: {r.output[-120:]!r}"


def concurrent_boxes(sb, m: dict) -> str | None:
  """Two runs at once: the second looks for the first's box on the host (under TMPDIR)."""
  first = ("import time\nopen('marker', 'w').write('mine')\ntime.sleep(1.2)\n"
           "print('ESCAPED overwritten' if open('marker').read() != 'mine' else 'intact')\n")
  out = {}
  t = threading.Thread(target=lambda: out.update(r=sb.run_python(
      {"main.py": first}, "main.py", limits=sb.Limits(wall_seconds=5.0))))
  t.start()
  time.sleep(0.5)
  second = ("import glob\n"
            f"for p in glob.glob({m['tmpdir']!r} + '/glm5-sandbox-*/box/marker') + glob.glob('/tmp/*/box/marker'):\n"
            "  try:\n    open(p, 'w').write('theirs'); print('ESCAPED wrote', p)\n"
            "  except OSError:\n    pass\n")
  r = sb.run_python({"main.py": second}, "main.py", limits=sb.Limits(wall_seconds=4.0))
  t.join()
  hits = [ln for ln in (r.output + out["r"].output).splitlines() if ln.startswith("ESCAPED")]
  return hits[0] if hits else None


SPECIAL = {"fork_bomb_starves_other_runs": fork_bomb_starves_other_runs,
           "concurrent_boxes": concurrent_boxes}


def run_probes(sb, base: str, only=None) -> dict:
  """{probe: {"contained": bool, "why": text}} on a fresh stand-in machine under `base`."""
  report = {}
  os.environ["GLM5_PROBE_SECRET"] = SECRET
  with machine(base) as m:
    os.environ["TMPDIR"] = m["tmpdir"]
    tempfile.tempdir = None
    os.chdir(m["cwd"])
    sb.hide_in_this_process(m["workdir"])
    for name in only or PROBES:
      start = time.monotonic()
      try:
        found = SPECIAL[name](sb, m) if name in SPECIAL else run_one(sb, m, name)[0]
      except Exception as e:  # pylint: disable=broad-except  (the sandbox refusing is a result)
        found = None if type(e).__name__ == "SandboxError" else f"{type(e).__name__}: {e}"
        found = found and found[:200]
      report[name] = {"contained": found is None, "why": found or "",
                      "seconds": round(time.monotonic() - start, 2)}
  return report


def reachable(path: str) -> bool:
  """Whether every directory above `path` lets anyone through (o+x)."""
  parts = os.path.abspath(path).split("/")
  return all(os.stat("/".join(parts[:i]) or "/").st_mode & 0o001 for i in range(1, len(parts)))


def user_python() -> str | None:
  """An interpreter a normal user can run: this one's base, else the system's."""
  own = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")
  for exe in (own, "/usr/bin/python3"):
    if os.path.exists(exe) and reachable(exe):
      return exe
  return None


def as_user(uid: int, sandbox_path: str, only: str = "") -> dict:
  """(Root) runs this file as `uid` in a subprocess: the caller is a normal user, its home,
  project and TMPDIR its own. Returns that run's report."""
  python = user_python()
  if python is None:
    return {"skipped": "no interpreter a normal user can run"}
  parent = next(d for d in (HERE, "/home", "/var/tmp") if os.path.isdir(d) and reachable(d + "/x"))
  base = tempfile.mkdtemp(prefix=".glm5-probes-", dir=parent)
  try:
    os.chmod(base, 0o755)
    code = os.path.join(base, "code")
    os.mkdir(code)
    siblings = [os.path.join(os.path.dirname(sandbox_path), s) for s in SIBLINGS]
    for path in (sandbox_path, *siblings, os.path.abspath(__file__)):
      shutil.copy(path, code)
    os.mkdir(os.path.join(base, "m"))
    os.chown(os.path.join(base, "m"), uid, uid)
    argv = [python, "-S", os.path.join(code, "sandbox_probes.py"),
            f"--sandbox={code}/sandbox.py", f"--base={base}/m", f"--only={only}"]
    env = {"PATH": "/usr/bin:/bin", "HOME": f"{base}/m/home", "LANG": "C.UTF-8"}
    proc = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: (os.setgroups([]), os.setresgid(uid, uid, uid),
                                              os.setresuid(uid, uid, uid)))
    if proc.returncode:
      return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])
  finally:
    subprocess.run(["chmod", "-R", "u+rwx", base], check=False)
    shutil.rmtree(base, ignore_errors=True)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--sandbox", default=SANDBOX)
  parser.add_argument("--base", default="", help="a directory the caller owns (default: a new "
                      "one under the home or /var/tmp)")
  parser.add_argument("--only", default="")
  parser.add_argument("--as-uid", type=int, default=-1, help="(as root) run the probes as this "
                      "normal uid, from a copy of the sandbox files it can read")
  args = parser.parse_args()
  if args.as_uid >= 0:
    print(json.dumps(as_user(args.as_uid, args.sandbox, args.only)))
    return
  sb = load_sandbox(args.sandbox)
  base = args.base or tempfile.mkdtemp(prefix=".glm5-probes-", dir=HERE)
  try:
    report = run_probes(sb, base, [n for n in args.only.split(",") if n] or None)
  finally:
    shutil.rmtree(base, ignore_errors=True)
  iso = sb.isolation()
  print(json.dumps({"uid": os.getuid(), "mode": iso.mode, "memory": getattr(iso, "memory", ""),
                    "cpu": getattr(iso, "cpu", ""), "probes": report}))


if __name__ == "__main__":
  main()
