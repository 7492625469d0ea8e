"""Runs untrusted (model-written) Python in an isolated, resource-limited child process.

  run_python(files, main, limits=Limits(), hide=(), allow_unsafe=False) -> Result
  isolation() -> Isolation       what this machine allows (probed once per process)

What a program gets (the child is `sandbox_boot.py`; its docstring has the process tree):
  - a fresh directory holding `files` as its cwd (`/tmp/box` inside), removed afterwards;
  - a cleared environment (PATH, HOME, LANG, PYTHONHASHSEED only), stdin /dev/null, the
    interpreter with `-E -s -S -B` (no PYTHON* variables, site-packages or user paths);
  - rlimits: CPU seconds, address space, processes, file size, open files, no core files;
  - a wall-clock timeout and an output cap: either kills its whole process group (SIGKILL);
  - stdout and stderr together, at most `output_bytes` kept (reading stops there; the rest is
    never buffered).

Isolation modes (`isolation().mode`, decided once by trying it):
  "root"  the caller is root (a container): new mount, network, pid, IPC and UTS namespaces
          made as root, then the program runs as `Limits.uid`/`gid` (default nobody), without
          capabilities.
  "user"  an unprivileged caller where user namespaces are allowed: the same namespaces inside
          a new user namespace (the caller's uid mapped to 0), the program in a nested one so
          the hiding mounts are locked.
  In both: no network (a new network namespace with only a down loopback: nothing, not even
  the caller's 127.0.0.1, is reachable); a new pid namespace whose init is the sandbox, so
  every process the program starts dies with it, setsid or double-fork included; private
  tmpfs /tmp, /var/tmp and /dev/shm (writes there vanish with the run); a new /proc (or an
  empty one where the container forbids it); the caller's cwd and `hide` paths covered by an
  empty unreadable tmpfs (paths under the private dirs need none); the caller's interpreter
  bound read-only at /tmp/.python, so hiding its directory does not stop the program.
  Elsewhere the program sees the machine's filesystem with the sandbox user's permissions: in mode "root" nobody's (world-readable files stay readable, and
  it can write only where nobody may: its box and the private tmpfs); in mode "user" the
  caller's own permissions, so `hide` must name every directory of the caller's that holds
  secrets. RLIMIT_NPROC counts per user: in mode "root" every process of the sandbox uid on the
  machine (give runs their own uid if something else runs as nobody), in mode "user" the
  processes of the program's user namespace only. Memory is per process (RLIMIT_AS), so a
  program's total is at most `processes * memory_bytes`.
  "none"  neither works (a seccomp profile that forbids unshare, say): `run_python` refuses
          with a SandboxError unless `allow_unsafe=True`, which runs the program in the
          caller's namespaces with only the rlimits, the cleared environment, the fresh cwd,
          the timeout and the kill of its descendants (the boot process is their subreaper):
          it CAN reach the network, read every file the caller can (the caller's workdir
          included), write wherever the caller can and signal the caller's processes (as
          root RLIMIT_NPROC does not bind either). For trusted code only.
"""

import dataclasses
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_boot.py")
MODES = ("root", "user", "none")


_HIDDEN: set = set()  # paths every run of this process hides (`hide_in_this_process`)


def hide_in_this_process(*paths) -> None:
  """Hides `paths` (local directories or files; remote URLs like gs://... are ignored) from
  every later run in this process: the RL loop, trainer and workers register their run's
  workdir and the checkpoints they read, so a program never sees them."""
  for path in paths:
    if path and "://" not in str(path):
      _HIDDEN.add(os.path.abspath(str(path)))


class SandboxError(RuntimeError):
  """The sandbox could not run a program (never raised for what the program itself does)."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-run limits; every field must be > 0 (`check`)."""
  wall_seconds: float = 10.0  # wall clock, then the whole process group is killed
  cpu_seconds: int = 5  # RLIMIT_CPU, per process
  memory_bytes: int = 512 << 20  # RLIMIT_AS, per process (the interpreter alone maps ~30 MB)
  processes: int = 16  # RLIMIT_NPROC (module docstring: what it counts)
  file_bytes: int = 4 << 20  # RLIMIT_FSIZE: the largest file a program may write
  open_files: int = 64  # RLIMIT_NOFILE
  output_bytes: int = 64 << 10  # stdout + stderr kept; past it the run is killed
  tmpfs_bytes: int = 64 << 20  # each private tmpfs (/tmp, /var/tmp, /dev/shm)
  uid: int = 65534  # mode "root": the program's uid and gid (nobody)
  gid: int = 65534

  def check(self, where: str = "sandbox") -> None:
    """ValueError naming `<where>.<field>` for a limit <= 0 (or not a number)."""
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0
          or value != value or value == float("inf")):
        raise ValueError(f"{where}.{field.name}: must be a finite number > 0, got {value!r}")
    for name in ("cpu_seconds", "memory_bytes", "processes", "file_bytes", "open_files",
                 "output_bytes", "tmpfs_bytes", "uid", "gid"):
      if not isinstance(getattr(self, name), int):
        raise ValueError(f"{where}.{name}: must be an int, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class Result:
  """What a run did. `ok`: exited 0, in time, within the output cap."""
  exit_code: int  # 128 + signal when killed by one; -9 when the sandbox killed it
  output: str  # stdout + stderr, decoded (invalid UTF-8 replaced), at most output_bytes
  timed_out: bool
  output_truncated: bool
  seconds: float
  mode: str
  pgid: int  # the run's process group (tests check nothing is left in it)

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and not self.timed_out and not self.output_truncated


@dataclasses.dataclass(frozen=True)
class Isolation:
  mode: str  # one of MODES
  reason: str  # why the better modes were not available ("" for "root"/"user")


def _python_paths() -> tuple[str, str, str]:
  """(interpreter, its prefix, the interpreter's path inside the prefix)."""
  prefix = os.path.realpath(sys.base_prefix)
  exe = os.path.realpath(sys.executable)
  if not exe.startswith(prefix + os.sep):  # a venv's interpreter: use the base one
    exe = os.path.join(prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
  return exe, prefix, exe[len(prefix):]


def _spec(mode: str, box: str, argv, limits: Limits, hide) -> dict:
  python, prefix, inside = _python_paths()
  return {"mode": mode, "box": box, "argv": list(argv), "python": python,
          "python_prefix": prefix, "python_in_prefix": inside, "hide": list(hide),
          "uid": limits.uid, "gid": limits.gid, "tmpfs_bytes": limits.tmpfs_bytes,
          "limits": {k: getattr(limits, k) for k in ("cpu_seconds", "memory_bytes", "processes",
                                                     "file_bytes", "open_files")}}


@functools.cache
def isolation() -> Isolation:
  """The best mode that works here, found by running a program in it (once per process)."""
  candidates = ["root", "user"] if os.geteuid() == 0 else ["user"]
  reasons = []
  for mode in candidates:
    result = _run({"main.py": "print('isolated')"}, "main.py", Limits(), (), mode)
    if result.ok and result.output.strip() == "isolated":
      return Isolation(mode, "")
    reasons.append(f"mode {mode!r}: exit {result.exit_code}, {result.output.strip()[:200]!r}")
  return Isolation("none", "; ".join(reasons))


def run_python(files: dict, main: str, *, limits: Limits = Limits(), hide=(),
               allow_unsafe: bool = False) -> Result:
  """Runs `python main` in a sandbox whose cwd holds `files` ({relative path: text}).

  Args:
    files: the program's files; paths relative, without "..".
    main: the file to run (a key of `files`).
    limits: `Limits` (checked: every field > 0).
    hide: more paths the program must not see; the caller's cwd and the paths registered
      with `hide_in_this_process` (the RL run's workdir) are always hidden.
    allow_unsafe: where the OS cannot isolate (`isolation().mode == "none"`), run anyway with
      the limits only (module docstring: what that does not contain). Without it: SandboxError.
  Raises:
    ValueError: a bad limit or file path. SandboxError: no isolation and not allow_unsafe.
  """
  limits.check()
  iso = isolation()
  if iso.mode == "none" and not allow_unsafe:
    raise SandboxError("sandbox: this OS cannot isolate a program (no usable mount/network/pid "
                       f"namespaces: {iso.reason}); refusing to run untrusted code. Pass "
                       "allow_unsafe=True (config: sandbox.allow_unsafe) to run it with "
                       "resource limits only: it could then use the network and read and "
                       "write the caller's files")
  if main not in files:
    raise ValueError(f"sandbox: main {main!r} is not one of the files {sorted(files)}")
  hidden = [os.getcwd(), *sorted(_HIDDEN)] + [os.path.abspath(p) for p in hide]
  return _run(files, main, limits, [p for p in hidden if p != "/"], iso.mode)


def _write_files(box: str, files: dict, limits: Limits, mode: str) -> None:
  for path, text in files.items():
    parts = path.split("/")
    if not path or path.startswith("/") or ".." in parts or "" in parts:
      raise ValueError(f"sandbox: file path {path!r} must be relative, without '..' or '//'")
    full = os.path.join(box, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w", encoding="utf-8") as f:
      f.write(text)
  if mode == "root":  # the program runs as limits.uid: its box must be its own
    for root, dirs, names in os.walk(box):
      for name in [root] + [os.path.join(root, n) for n in dirs + names]:
        os.chown(name, limits.uid, limits.gid)


def _run(files: dict, main: str, limits: Limits, hide, mode: str) -> Result:
  work = tempfile.mkdtemp(prefix="glm5-sandbox-")
  box = os.path.join(work, "box")
  os.mkdir(box, 0o700)
  start = time.monotonic()
  try:
    _write_files(box, files, limits, mode)
    spec = _spec(mode, box, [main], limits, hide)
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", BOOT, json.dumps(spec)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=work, env={"PATH": "/usr/bin:/bin"},
                            start_new_session=True, close_fds=True)
    try:
      output, timed_out, truncated = _collect(proc, limits)
    finally:
      _stop(proc)
    code = -9 if (timed_out or truncated) else proc.returncode
    if code < 0 and not (timed_out or truncated):
      code = 128 - code  # the boot script itself killed by a signal
    return Result(code, output.decode("utf-8", errors="replace"), timed_out, truncated,
                  time.monotonic() - start, mode, proc.pid)
  finally:
    shutil.rmtree(work, ignore_errors=True)


def _collect(proc, limits: Limits) -> tuple[bytes, bool, bool]:
  """Reads the output pipe until EOF, the wall clock or the cap; (output, timed_out,
  truncated). Never holds more than output_bytes + one read."""
  deadline = time.monotonic() + limits.wall_seconds
  chunks, size = [], 0
  with selectors.DefaultSelector() as sel:
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
      left = deadline - time.monotonic()
      if left <= 0:
        return b"".join(chunks), True, False
      if not sel.select(timeout=left):
        continue
      data = os.read(proc.stdout.fileno(), 65536)
      if not data:  # EOF: every writer closed the pipe (a program may close it and go on)
        while not _exited(proc):
          if time.monotonic() > deadline:
            return b"".join(chunks), True, False
          time.sleep(0.005)
        return b"".join(chunks), False, False
      chunks.append(data[:limits.output_bytes - size])
      size += len(data)
      if size > limits.output_bytes:
        return b"".join(chunks), False, True


def _stop(proc, grace: float = 5.0) -> None:
  """Ends the run and reaps it. SIGTERM asks the boot process to kill the program's tree and
  reap it (a zombie handed to this machine's init may never be reaped); only if it has not
  exited after `grace` seconds is the whole group SIGKILLed. The group is signalled while the
  boot process is an unreaped zombie, so its id cannot have been reused."""
  if not _exited(proc):
    proc.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + grace
  while not _exited(proc) and time.monotonic() < deadline:
    time.sleep(0.005)
  try:
    os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group (none when the boot exited)
  except (ProcessLookupError, PermissionError):
    pass
  proc.wait()


def _exited(proc) -> bool:
  """Whether the boot process has exited, without reaping it (its pid stays reserved)."""
  return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
