"""Runs untrusted (model-written) Python in a bubblewrap sandbox built from an allow-list.

  run_python(files, main, limits=Limits(), hide=(), allow_unsafe=False) -> Result
  isolation() -> Isolation       whether this machine can sandbox (probed once per process)

What a program sees (mode "bwrap": bubblewrap, https://github.com/containers/bubblewrap, a
system package: `apt-get install bubblewrap`; README, "System dependencies"):
  - a root filesystem made of an allow-list, read-only: /usr (and the /bin, /lib, /lib64, /sbin
    links or directories), /etc/ld.so.cache, the interpreter's prefix at /python without its
    site-packages, a new /proc (its own processes only) and a minimal /dev. Nothing else of
    the host exists inside: not /root, /home, /etc, /run, /var, the host's /tmp, the project,
    the workdirs, the caller's cwd;
  - one writable place, /tmp: a private tmpfs of `tmpfs_bytes` (the run's disk budget, gone
    with the run), holding the box /tmp/box (cwd and HOME) with `files`;
  - new user, pid, network, IPC, UTS and cgroup namespaces: no network and no host socket
    (not the caller's 127.0.0.1, not abstract or path UNIX sockets); pid 1 of its namespace is
    bubblewrap's, and when the program's main process ends everything it started dies
    (setsid, double fork, nohup, SIGTERM-ignoring children included); it cannot see or signal
    the caller's processes;
  - no capabilities, no new user namespaces, a cleared environment (PATH, HOME, LANG,
    PYTHONHASHSEED, TMPDIR), stdin /dev/null, the interpreter with `-E -s -S -B`; a seccomp
    filter refuses System V IPC and POSIX message queues (memory no process's pages show, so
    no watchdog could count it) and every syscall of another ABI (x86_64 and aarch64;
    elsewhere no filter);
  - per-run limits that share no budget with other runs (`isolation()` says what holds each):
    processes: RLIMIT_NPROC counts per user namespace, and each run has its own (a fork bomb
    in one run never stops another's fork). The program's uid is never 0 outside (the kernel
    exempts uid 0 from RLIMIT_NPROC): a root caller's boot drops to `Limits.uid` (nobody)
    first; a normal user's runs as that user. Memory (`memory_bytes`: every process and the
    tmpfs together) and CPU (`cpu_seconds`: every process together, reaped ones included):
    a root caller gives each run a memory cgroup (the kernel holds the run to the limit) and
    a cpuacct cgroup (an exact count), `isolation().memory == .cpu == "cgroup"`; a normal user
    cannot make a cgroup here, so the caller's watchdog sums the run's processes from the
    sandbox's own /proc every 0.1 s ("watchdog"; it can overshoot by up to one poll, and
    misses processes shorter than a poll that nobody waits for: sandbox_budget says exactly).
    Past either total the run is killed, `Result.killed_by` naming the limit;
  - rlimits per process besides: CPU seconds and address space (both the run's limits, so no
    single process passes them between two polls), file size, open files, no core files;
  - a wall-clock timeout and an output cap (stdout and stderr together; reading stops at
    `output_bytes`): either kills the sandbox's pid 1, and so everything in it.
The spec (files, limits) reaches the sandbox through inherited file descriptors, never a
command line (`/proc/1/cmdline` inside reads `bwrap --args 3`).

"none": bubblewrap is missing or cannot run here (`isolation().reason` says why). Then
`run_python` refuses with a one-line SandboxError unless `allow_unsafe=True`, which runs the
program in the caller's namespaces with only the rlimits (RLIMIT_NPROC then counts all the
caller's processes), the watchdog's totals, the cleared environment, a fresh cwd, the timeout
and the kill of its descendants: it CAN reach the network, read and write every
file the caller can and signal the caller's processes. For trusted code only.

`hide` and `hide_in_this_process` (the RL loop registers its workdir and checkpoints): paths
that must stay unseen. Nothing outside the allow-list is mounted, so they are hidden already;
`run_python` refuses (SandboxError) if one lies inside a mounted path (the interpreter's prefix).
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

from glm5_jax.posttrain import sandbox_boot, sandbox_budget

BOOT = sandbox_boot.__file__
MODES = ("bwrap", "none")
BOX = "/tmp/box"
PYTHON = "/python"  # the interpreter's prefix inside (when it is not under /usr)
ROOT_LINKS = ("bin", "lib", "lib32", "lib64", "libx32", "sbin")
INSTALL = "install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap)"

_HIDDEN: set = set()  # paths every run of this process must not see (`hide_in_this_process`)


def hide_in_this_process(*paths) -> None:
  """Registers `paths` (local; remote URLs like gs://... are ignored) that no run of this
  process may see: the RL loop, trainer and workers register their workdir and checkpoints.
  They are outside the allow-list already; `run_python` checks that they stay so."""
  for path in paths:
    if path and "://" not in str(path):
      _HIDDEN.add(os.path.abspath(str(path)))


class SandboxError(RuntimeError):
  """The sandbox could not run a program (never raised for what the program itself does)."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-run limits; every field must be > 0 (`check`)."""
  wall_seconds: float = 10.0  # wall clock, then the sandbox (everything in it) is killed
  cpu_seconds: float = 5.0  # the run's total (every process); RLIMIT_CPU: its ceiling
  memory_bytes: int = 512 << 20  # the run's total (with its tmpfs); also RLIMIT_AS per process
  processes: int = 16  # RLIMIT_NPROC, counted in the run's own user namespace
  file_bytes: int = 4 << 20  # RLIMIT_FSIZE: the largest file a program may write
  open_files: int = 64  # RLIMIT_NOFILE
  output_bytes: int = 64 << 10  # stdout + stderr kept; past it the run is killed
  tmpfs_bytes: int = 64 << 20  # the run's writable space (/tmp, with the box)
  uid: int = 65534  # root caller: the uid and gid the sandbox runs as (nobody)
  gid: int = 65534

  def check(self, where: str = "sandbox") -> None:
    """ValueError naming `<where>.<field>` for a limit <= 0 (or not a number)."""
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0
          or value != value or value == float("inf")):
        raise ValueError(f"{where}.{field.name}: must be a finite number > 0, got {value!r}")
    for name in ("memory_bytes", "processes", "file_bytes", "open_files",
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
  # The limit with which the sandbox ended the run ("" when it did not): "wall_seconds",
  # "output_bytes", or a run total, "memory_bytes" or "cpu_seconds" (sandbox_budget).
  killed_by: str = ""

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and not self.killed_by


STOPPED = {"wall_seconds": "timed out after {wall_seconds:g} s",
           "output_bytes": "printed more than {output_bytes} bytes",
           "memory_bytes": "used more than {memory_bytes} bytes of memory (the whole run)",
           "cpu_seconds": "used more than {cpu_seconds:g} s of CPU (the whole run)"}


def stop_reason(result: Result, limits: Limits) -> str:
  """Why the sandbox ended the run, in words ("" when it did not)."""
  return STOPPED[result.killed_by].format(**dataclasses.asdict(limits)) if result.killed_by else ""


@dataclasses.dataclass(frozen=True)
class Isolation:
  """What contains a run here, and what holds each of its per-run limits."""
  mode: str  # one of MODES
  reason: str  # why "bwrap" is not available ("" when it is)
  memory: str = "watchdog"  # the run's total: "cgroup" (root callers) | "watchdog"
  cpu: str = "watchdog"  # the run's total CPU seconds: "cgroup" (cpuacct) | "watchdog"
  processes: str = "user namespace"  # RLIMIT_NPROC in the run's own user namespace
  disk: str = "tmpfs"  # the run's private tmpfs of tmpfs_bytes


def _python_paths() -> tuple[str, str]:
  """(the caller's base interpreter's prefix, the interpreter's path inside the prefix)."""
  prefix = os.path.realpath(sys.base_prefix)
  exe = os.path.realpath(sys.executable)
  if not exe.startswith(prefix + os.sep):  # a venv's interpreter: use the base one
    exe = os.path.join(prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
  return prefix, exe[len(prefix):]


def _inside(prefix: str) -> str:
  """Where the interpreter's prefix is inside the sandbox."""
  return prefix if prefix == "/usr" or prefix.startswith("/usr/") else PYTHON


def bwrap_args(prefix_source: str, prefix: str, limits: Limits, spec_fd: int,
               seccomp_fd: int | None = None) -> tuple[list[str], list[str]]:
  """bubblewrap's (options, command): the options build the allow-list root, namespaces and
  the box (they go through `--args FD`: no host path on a command line); the command is the
  INNER boot, which reads the program's spec from `spec_fd`. `seccomp_fd`: the filter
  (sandbox_budget.seccomp_filter) to load, if any."""
  args = ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
          "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
  if seccomp_fd is not None:
    args += ["--seccomp", str(seccomp_fd)]
  if "--disable-userns" in _bwrap_help():  # bubblewrap >= 0.8
    args.append("--disable-userns")
  for name in ROOT_LINKS:  # merged-/usr systems link these into /usr; others are directories
    path = f"/{name}"
    if os.path.islink(path):
      args += ["--symlink", os.readlink(path), path]
    elif os.path.isdir(path):
      args += ["--ro-bind", path, path]
  args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
  inside = _inside(prefix)
  if inside == PYTHON:
    args += ["--ro-bind", prefix_source, PYTHON]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    if os.path.isdir(os.path.join(prefix, "lib", version, "site-packages")):
      # The installed packages (this project's editable install among them): not the program's.
      args += ["--tmpfs", f"{PYTHON}/lib/{version}/site-packages"]
  args += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmpfs_bytes),
           "--perms", "1777", "--tmpfs", "/tmp", "--remount-ro", "/dev", "--remount-ro", "/",
           "--chdir", "/tmp", "--clearenv"]
  for name, value in _environment(BOX, inside + "/lib").items():
    args += ["--setenv", name, value]
  exe = inside + _python_paths()[1]
  return args, [exe, "-I", "-S", "-B", "-c", sandbox_boot.INNER, str(spec_fd)]


def _environment(box: str, lib: str) -> dict:
  """The program's whole environment (a shared libpython is found through LD_LIBRARY_PATH:
  the interpreter's runpath names its prefix outside)."""
  return {"PATH": "/usr/bin:/bin", "HOME": box, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
          "TMPDIR": os.path.dirname(box), "LD_LIBRARY_PATH": lib}


def _program_spec(files: dict, main: str, limits: Limits, box: str, python: str,
                  lib: str) -> dict:
  limits_dict = {k: getattr(limits, k) for k in ("cpu_seconds", "memory_bytes", "processes",
                                                 "file_bytes", "open_files")}
  # -E -s -S: no PYTHON* variables, user site or site-packages (-I would also drop the
  # script's directory from sys.path, and the program imports its sibling files).
  return {"box": box, "files": files, "argv": [python, "-E", "-s", "-S", "-B", main],
          "env": _environment(box, lib), "limits": limits_dict,
          "rlimits": sandbox_boot.rlimits(limits_dict)}


def _memfd(data: bytes) -> int:
  """An inheritable file descriptor reading `data` from its start."""
  fd = os.memfd_create("glm5-sandbox", 0)
  os.write(fd, data)
  os.lseek(fd, 0, os.SEEK_SET)
  os.set_inheritable(fd, True)
  return fd


def _bwrap_path() -> str | None:
  return shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin:/usr/sbin")


@functools.cache
def _bwrap_help() -> str:
  proc = subprocess.run([_bwrap_path(), "--help"], capture_output=True, text=True, check=False)
  return proc.stdout + proc.stderr


@functools.cache
def isolation() -> Isolation:
  """Whether bubblewrap runs a program here (tried once per process)."""
  # Unsafe: the caller's namespaces; RLIMIT_NPROC counts every process of the caller's uid.
  unsafe = dict(processes="per uid (shared with the caller)", disk="none")
  if _bwrap_path() is None:
    return Isolation("none", f"bubblewrap (bwrap) is not installed: {INSTALL}", **unsafe)
  try:
    result = _run({"main.py": "print('isolated')"}, "main.py", Limits(), "bwrap")
  except OSError as e:
    return Isolation("none", f"bubblewrap could not start: {e}", **unsafe)
  if not (result.ok and result.output.strip() == "isolated"):
    return Isolation("none", f"bubblewrap failed here: exit {result.exit_code}, "
                     f"{' '.join(result.output.split())[:200]!r}", **unsafe)
  return Isolation("bwrap", "", **sandbox_budget.counted_by(os.geteuid() == 0))


def run_python(files: dict, main: str, *, limits: Limits = Limits(), hide=(),
               allow_unsafe: bool = False) -> Result:
  """Runs `python main` in the sandbox with `files` ({relative path: text}) in its cwd.

  Args:
    files: the program's files; paths relative, without "..".
    main: the file to run (a key of `files`).
    limits: `Limits` (checked: every field > 0).
    hide: more paths that must stay unseen (see the module docstring).
    allow_unsafe: where no sandbox works (`isolation().mode == "none"`), run anyway with the
      limits only (module docstring: what that does not contain). Without it: SandboxError.
  Raises:
    ValueError: a bad limit or file path. SandboxError: no sandbox and not allow_unsafe, or a
      hidden path inside a mounted one.
  """
  limits.check()
  _check_files(files, main)
  iso = isolation()
  if iso.mode == "none" and not allow_unsafe:
    raise SandboxError(f"sandbox: refusing to run untrusted code: {iso.reason}; or pass "
                       "allow_unsafe=True (rl.sandbox.allow_unsafe) to run it unconfined")
  if iso.mode == "bwrap":
    _check_hidden([*sorted(_HIDDEN), *map(os.path.abspath, hide)])
  return _run(files, main, limits, iso.mode)


def _check_files(files: dict, main: str) -> None:
  if main not in files:
    raise ValueError(f"sandbox: main {main!r} is not one of the files {sorted(files)}")
  for path in files:
    parts = path.split("/")
    if not path or path.startswith("/") or ".." in parts or "" in parts:
      raise ValueError(f"sandbox: file path {path!r} must be relative, without '..' or '//'")


def _check_hidden(paths) -> None:
  mounted = ["/usr", os.path.realpath(sys.base_prefix)]
  for path in paths:
    real = os.path.realpath(path)
    for m in mounted:
      if real == m or real.startswith(m + "/"):
        raise SandboxError(f"sandbox: hidden path {path} is inside {m}, which the sandbox "
                           "mounts (read-only): move it elsewhere")


def _run(files: dict, main: str, limits: Limits, mode: str) -> Result:
  start = time.monotonic()
  budget = sandbox_budget.Budget(limits.memory_bytes, limits.cpu_seconds,
                                 root_caller=os.geteuid() == 0, sandboxed=mode == "bwrap")
  try:
    if mode == "none":
      proc, cleanup = _start_unsafe(files, main, limits)
    else:
      proc, cleanup = _start_bwrap(files, main, limits, budget)
    try:
      try:
        output, killed_by = _collect(proc, limits, budget)
      finally:
        _stop(proc, unsafe=mode == "none")
      if not killed_by and budget.oom_killed():  # in a run that ended before the next poll
        killed_by = "memory_bytes"
      code = -9 if killed_by else proc.returncode
      if code < 0 and not killed_by:
        code = 128 - code  # bwrap or the boot itself killed by a signal
      return Result(code, output.decode("utf-8", errors="replace"), killed_by == "wall_seconds",
                    killed_by == "output_bytes", time.monotonic() - start, mode, proc.pid,
                    killed_by)
    finally:
      cleanup()
  finally:
    budget.close()


def _start_bwrap(files: dict, main: str, limits: Limits, budget):
  """Starts bwrap (through the root boot for a root caller); (process, cleanup)."""
  prefix, in_prefix = _python_paths()
  root = os.geteuid() == 0
  inside = _inside(prefix)
  spec_fd = _memfd(json.dumps(_program_spec(files, main, limits, BOX, inside + in_prefix,
                                            inside + "/lib")).encode())
  source = sandbox_boot.STAGED if root else prefix
  seccomp = sandbox_budget.seccomp_filter(os.uname().machine)
  fds = [spec_fd] + ([_memfd(seccomp)] if seccomp else [])
  options, command = bwrap_args(source, prefix, limits, spec_fd, fds[1] if seccomp else None)
  args_fd = _memfd(b"".join(a.encode() + b"\0" for a in options))
  fds.append(args_fd)
  try:
    if root:
      host = {"python_prefix": prefix, "uid": limits.uid, "gid": limits.gid,
              "bwrap": _bwrap_path(), "command": command, "cgroups": budget.cgroup_procs()}
      fds.append(_memfd(json.dumps(host).encode()))
      argv = [sys.executable, "-I", "-S", "-B", BOOT, "host", str(args_fd), str(fds[-1])]
    else:
      argv = [_bwrap_path(), "--args", str(args_fd), "--", *command]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd="/", env={"PATH": "/usr/bin:/bin"},
                            start_new_session=True, pass_fds=fds)
  finally:
    for fd in fds:
      os.close(fd)
  return proc, lambda: None


def _start_unsafe(files: dict, main: str, limits: Limits):
  work = tempfile.mkdtemp(prefix="glm5-sandbox-")
  box = os.path.join(work, "box")
  os.mkdir(box, 0o700)
  for path, text in files.items():
    full = os.path.join(box, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w", encoding="utf-8") as f:
      f.write(text)
  prefix, in_prefix = _python_paths()
  spec = _program_spec(files, main, limits, box, prefix + in_prefix, prefix + "/lib")
  spec.pop("files")
  proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", BOOT, "unsafe", json.dumps(spec)],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, cwd=work, env={"PATH": "/usr/bin:/bin"},
                          start_new_session=True, close_fds=True)
  return proc, lambda: _remove_tree(work)


def _remove_tree(path: str) -> None:
  """rmtree that also removes directories the program made unreadable (mode 000)."""
  for root, dirs, _ in os.walk(path):
    for d in dirs:
      try:
        os.chmod(os.path.join(root, d), 0o700, follow_symlinks=False)
      except OSError:
        pass
  shutil.rmtree(path, ignore_errors=True)


# ---- output and stopping ---------------------------------------------------------------------


def _collect(proc, limits: Limits, budget) -> tuple[bytes, str]:
  """Reads the output pipe until EOF or a limit: (output, the limit that stopped it or "").
  Polls the run's totals every POLL_SECONDS. Never holds more than output_bytes + one read."""
  start = time.monotonic()
  deadline, next_poll = start + limits.wall_seconds, start
  chunks, size, eof = [], 0, False
  with selectors.DefaultSelector() as sel:
    sel.register(proc.stdout, selectors.EVENT_READ)
    while not (eof and _exited(proc)):  # a program may close its output and go on
      now = time.monotonic()
      if now >= deadline:
        return b"".join(chunks), "wall_seconds"
      if now >= next_poll:
        next_poll = now + sandbox_budget.POLL_SECONDS
        over = budget.over(proc.pid)
        if over:
          return b"".join(chunks), over
      wait = min(deadline, next_poll) - now
      if eof:
        time.sleep(min(wait, 0.005))
        continue
      if not sel.select(timeout=wait):
        continue
      data = os.read(proc.stdout.fileno(), 65536)
      eof = not data  # every writer closed the pipe
      chunks.append(data[:limits.output_bytes - size])
      size += len(data)
      if size > limits.output_bytes:
        return b"".join(chunks), "output_bytes"
  return b"".join(chunks), ""


def _stop(proc, unsafe: bool, grace: float = 5.0) -> None:
  """Ends the run and reaps it. bwrap: SIGKILL to its child, the sandbox's pid 1 (the kernel
  then kills everything in the sandbox, and bwrap reaps pid 1 and exits). Unsafe: SIGTERM asks
  the boot to kill and reap the program's tree. Only if that has not ended the run after
  `grace` seconds is the whole group SIGKILLed. The group is signalled while its leader is an
  unreaped zombie, so its id cannot have been reused."""
  if not _exited(proc):
    if unsafe:
      proc.send_signal(signal.SIGTERM)
    else:
      for pid in sandbox_boot.children_of(proc.pid):
        _kill(pid)
  deadline = time.monotonic() + grace
  while not _exited(proc) and time.monotonic() < deadline:
    time.sleep(0.005)
  try:
    os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group (none when it exited)
  except (ProcessLookupError, PermissionError):
    pass
  proc.wait()


def _kill(pid: int) -> None:
  try:
    os.kill(pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _exited(proc) -> bool:
  """Whether the process has exited, without reaping it (its pid stays reserved)."""
  return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
