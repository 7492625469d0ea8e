"""The sandbox's own code outside `sandbox.py`: stdlib only, and no import of glm5_jax when run.

Three parts (`sandbox.py`'s docstring has the whole picture):

  INNER        the source of the first process inside the bubblewrap sandbox (`python -I -S -B
               -c INNER FD`): it reads the spec (the program's files, the rlimits) from an
               inherited file descriptor, writes the files into the box, sets the rlimits and
               runs the program as `__main__` in the same interpreter (its directory first on
               sys.path). The spec never appears on a command line.
  `host` mode  `python -I -S -B sandbox_boot.py host ARGS_FD SPEC_JSON_FD`, for a ROOT caller:
               in a private mount namespace (the host's mounts are untouched) it binds the
               interpreter's prefix at STAGED (the sandbox user cannot enter e.g. /root, where
               pyenv installs it), joins the run's cgroups if the caller made them, drops to the
               sandbox uid/gid (never uid 0: the kernel exempts it from RLIMIT_NPROC) and execs
               `bwrap --args ARGS_FD -- COMMAND`, which then runs unprivileged in its own user namespace.
  `unsafe` mode  `python -I -S -B sandbox_boot.py unsafe SPEC_JSON`: only with the caller's
               `allow_unsafe`, where no sandbox works: the program runs in the caller's
               namespaces with the rlimits, a cleared environment, a fresh cwd, and this process
               as the subreaper that kills its descendants when it ends or on SIGTERM.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 32, 4096, 16384, 1 << 18
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38
STAGED = "/tmp/.glm5-python"  # root caller: the interpreter's prefix, in the boot's own /tmp

# The sandbox's first process (argv[1]: the spec's fd), which then becomes the program: one
# interpreter start per run inside. Paths were checked by the caller.
INNER = r"""
import json, os, resource, runpy, sys
with os.fdopen(int(sys.argv[1]), "rb") as f:
    spec = json.loads(f.read())
os.mkdir(spec["box"], 0o700)
for path, text in spec["files"].items():
    full = os.path.join(spec["box"], path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w", encoding="utf-8") as f:
        f.write(text)
os.chdir(spec["box"])
for name, value in spec["rlimits"].items():
    resource.setrlimit(getattr(resource, name), tuple(value))
main = spec["argv"][-1]
sys.argv, sys.path[0:0] = [main], [spec["box"]]
del spec, f, path, text, full, name, value
runpy.run_path(main, run_name="__main__")
"""

libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
  if result != 0:
    errno = ctypes.get_errno()
    raise OSError(errno, f"sandbox: {what}: {os.strerror(errno)}")


def mount(source, target: str, fstype, flags: int, data=None) -> None:
  enc = lambda s: None if s is None else s.encode()
  check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
        f"mount {source} on {target}")


def rlimits(limits: dict) -> dict:
  """{RLIMIT_*: (soft, hard)} for the spec's limits. CPU (whole seconds: the run's budget
  rounded up): SIGXCPU at the limit, SIGKILL a second later; NPROC counts in the run's own user
  namespace (the sandbox's per-run budget)."""
  cpu = int(-(-limits["cpu_seconds"] // 1))
  return {"RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_AS": (limits["memory_bytes"],) * 2,
          "RLIMIT_NPROC": (limits["processes"],) * 2,
          "RLIMIT_FSIZE": (limits["file_bytes"],) * 2,
          "RLIMIT_NOFILE": (limits["open_files"],) * 2, "RLIMIT_CORE": (0, 0)}


def host(args_fd: int, spec: dict) -> None:
  """Root caller: stage the interpreter, join the cgroup, drop privileges, exec bwrap."""
  check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
  mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
  mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID, "size=64k,mode=755")  # this namespace's only
  os.mkdir(STAGED, 0o755)
  mount(spec["python_prefix"], STAGED, None, MS_BIND | MS_REC)
  mount(None, STAGED, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
  for procs in spec["cgroups"]:  # the caller's per-run cgroups (memory, pids)
    with open(procs, "w") as f:
      f.write(str(os.getpid()))
  os.setgroups([])
  os.setresgid(spec["gid"], spec["gid"], spec["gid"])
  os.setresuid(spec["uid"], spec["uid"], spec["uid"])
  check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
  os.execv(spec["bwrap"], ["bwrap", "--args", str(args_fd), "--", *spec["command"]])


# ---- unsafe mode ---------------------------------------------------------------------------


def wait_for(pid: int) -> int:
  """Reaps children until `pid` exits; its status as an exit code (128 + signal if killed)."""
  while True:
    done, status = os.wait()
    if done == pid:
      return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else (
          128 + os.WTERMSIG(status))


def children_of(parent: int) -> list[int]:
  """The live children of process `parent`."""
  kids = []
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/stat") as f:
          if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
            kids.append(int(name))
      except (OSError, ValueError, IndexError):
        pass
  return kids


def kill_children() -> None:
  """SIGKILLs the live children of this process (orphans included: it is their subreaper)."""
  for pid in children_of(os.getpid()):
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def unsafe(spec: dict) -> None:
  """Runs the program in the caller's namespaces; kills its descendants when it ends or on
  SIGTERM (the caller's timeout), reaps them, and exits with its status."""
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
  check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
  program = os.fork()
  if program == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.chdir(spec["box"])
    for name, value in rlimits(spec["limits"]).items():
      resource.setrlimit(getattr(resource, name), value)
    os.execve(spec["argv"][0], spec["argv"], spec["env"])
  done = []
  signal.signal(signal.SIGTERM, lambda *_: None if done else kill_children())
  signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
  code = wait_for(program)
  done.append(True)  # `program` is reaped: its pid may be reused, never signal it again
  kill_children()
  while True:
    try:
      os.wait()
    except ChildProcessError:
      os._exit(code)


if __name__ == "__main__":
  try:
    if sys.argv[1] == "host":
      with os.fdopen(int(sys.argv[3]), "rb") as f:
        host(int(sys.argv[2]), json.loads(f.read()))
    else:
      unsafe(json.loads(sys.argv[2]))
  except OSError as e:
    os.write(2, f"{e}\n".encode())
    os._exit(125)
