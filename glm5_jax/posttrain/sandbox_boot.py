"""The sandbox's child process: isolates itself, then runs the untrusted program.

Executed by path (`python -I -S -B sandbox_boot.py SPEC_JSON`), never imported: it must not
import glm5_jax (the caller's tree may be hidden from it). `glm5_jax.posttrain.sandbox` starts
it in a new session (its own process group) with the output pipe as stdout/stderr and
/dev/null as stdin; the spec's fields are `sandbox._spec`'s.

Process tree of an isolated run (mode "root" or "user"):

  B  this script, in the caller's namespaces: unshares the namespaces, forks I, waits for it
     and exits with its status. The caller's wall-clock kill (SIGKILL to B's process group)
     reaches B and I.
  I  pid 1 of the new pid namespace: mounts (new /proc, private /tmp /var/tmp /dev/shm, the
     box bound at /tmp/box, the interpreter's prefix bound read-only at /tmp/.python, hidden
     paths covered), forks P, reaps every orphan and exits with
     P's status once P is gone. When I exits the kernel kills everything left in the
     namespace, so a program that double-forks or calls setsid leaves nothing behind.
  P  drops privileges (mode "root": to the sandbox uid/gid; mode "user": a nested user
     namespace, in which the mounts above are locked and cannot be unmounted), sets the
     rlimits and execs the interpreter (from /tmp/.python) on the program with a cleared
     environment.

Mode "none" (the caller's explicit unsafe flag): B sets the rlimits and execs the program
directly, in the caller's namespaces, with the box as its cwd.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38
BOX = "/tmp/box"
PYTHON = "/tmp/.python"  # the interpreter's prefix, bound read-only
PRIVATE = ("/tmp", "/var/tmp", "/dev/shm")  # each a fresh tmpfs

libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
  if result != 0:
    errno = ctypes.get_errno()
    raise OSError(errno, f"sandbox: {what}: {os.strerror(errno)}")


def unshare(flags: int) -> None:
  check(libc.unshare(flags), f"unshare({flags:#x})")


def mount(source, target: str, fstype, flags: int, data=None) -> None:
  enc = lambda s: None if s is None else s.encode()
  check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
        f"mount {source} on {target}")


def write(path: str, text: str) -> None:
  with open(path, "w") as f:
    f.write(text)


def map_self(uid: int, gid: int) -> None:
  """Maps uid/gid 0 of a just-created user namespace to `uid`/`gid` (the one mapping an
  unprivileged process may write for itself)."""
  write("/proc/self/setgroups", "deny")
  write("/proc/self/uid_map", f"0 {uid} 1")
  write("/proc/self/gid_map", f"0 {gid} 1")


def set_limits(limits: dict) -> None:
  cpu = limits["cpu_seconds"]
  pairs = {resource.RLIMIT_CPU: (cpu, cpu + 1),  # SIGXCPU at cpu, SIGKILL a second later
           resource.RLIMIT_AS: (limits["memory_bytes"],) * 2,
           resource.RLIMIT_NPROC: (limits["processes"],) * 2,
           resource.RLIMIT_FSIZE: (limits["file_bytes"],) * 2,
           resource.RLIMIT_NOFILE: (limits["open_files"],) * 2,
           resource.RLIMIT_CORE: (0, 0)}
  for which, value in pairs.items():
    resource.setrlimit(which, value)


def exec_program(spec: dict, python: str, env: dict) -> None:
  # -E -s -S: no PYTHON* variables, user site or site-packages (-I would also drop the
  # script's directory from sys.path, and the program imports its sibling files).
  os.execve(python, [python, "-E", "-s", "-S", "-B", *spec["argv"]], env)


def mount_private_dirs(spec: dict, box_fd: int, python_fd: int) -> None:
  """In I (pid 1 of the new namespaces): the mounts every program sees."""
  try:
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  except OSError:  # a container that masks parts of /proc forbids a new one: hide it whole
    mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k")
  size = f"size={spec['tmpfs_bytes']},mode=1777"
  for path in PRIVATE:
    if os.path.isdir(path):
      mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, size)
  os.mkdir(BOX)
  mount(f"/proc/self/fd/{box_fd}", BOX, None, MS_BIND)
  os.close(box_fd)
  # The interpreter, bound read-only where the program can reach it whatever is hidden or
  # unreadable (mode "root": nobody cannot enter e.g. /root, where pyenv installs it).
  os.mkdir(PYTHON, 0o755)
  mount(f"/proc/self/fd/{python_fd}", PYTHON, None, MS_BIND | MS_REC)
  mount(None, PYTHON, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
  os.close(python_fd)
  for path in spec["hide"]:
    if any(path == d or path.startswith(d + "/") for d in PRIVATE):
      continue  # private already (and covering /tmp would hide the box)
    if os.path.isdir(path):
      mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
            "size=4k,mode=000")
    elif os.path.exists(path):
      mount("/dev/null", path, None, MS_BIND)


def run_program(spec: dict) -> None:
  """In P: drop privileges, set the limits, exec (never returns)."""
  mode = spec["mode"]
  python = PYTHON + spec["python_in_prefix"]
  if mode == "root":
    os.setgroups([])
    os.setresgid(spec["gid"], spec["gid"], spec["gid"])
    os.setresuid(spec["uid"], spec["uid"], spec["uid"])
  elif mode == "user":
    # A nested user namespace: the mounts made above become locked (a namespace less
    # privileged than the one that made them cannot unmount them to uncover what they hide).
    unshare(CLONE_NEWUSER | CLONE_NEWNS)
    map_self(0, 0)
  check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
  set_limits(spec["limits"])  # after the namespaces: RLIMIT_NPROC counts in the innermost one
  env = {"PATH": "/usr/bin:/bin", "HOME": BOX, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
         # A shared libpython is found through the runpath, which names the real prefix.
         "LD_LIBRARY_PATH": PYTHON + "/lib"}
  exec_program(spec, python, env)


def wait_for(pid: int) -> int:
  """Reaps children until `pid` exits; its status as an exit code (128 + signal if killed)."""
  while True:
    done, status = os.wait()
    if done == pid:
      return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else (
          128 + os.WTERMSIG(status))


def children() -> list[int]:
  """The live children of this process (orphans included, it being their subreaper)."""
  me, kids = os.getpid(), []
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/stat") as f:
          if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
            kids.append(int(name))
      except (OSError, ValueError, IndexError):
        pass
  return kids


def kill_children() -> None:
  for pid in children():
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def supervise(child: int, on_term, *, after: bool) -> None:
  """B: waits for `child` and exits with its status; SIGTERM (the caller's timeout) runs
  `on_term`, and so does the child's end when `after`. B reaps what it kills: a zombie left to
  the machine's init may never be reaped (a container's pid 1 often does not)."""
  done = []
  signal.signal(signal.SIGTERM, lambda *_: None if done else on_term())
  signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
  code = wait_for(child)
  done.append(True)  # `child` is reaped: its pid may be reused, never signal it again
  if after:  # mode "none": the program's leftover descendants
    on_term()
  while True:
    try:
      os.wait()
    except ChildProcessError:
      os._exit(code)


def fork_child() -> int:
  pid = os.fork()
  if pid == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
  return pid


def main() -> None:
  spec = json.loads(sys.argv[1])
  mode = spec["mode"]
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # until B's handler is set
  if mode == "none":
    # B stays the program's parent and, as subreaper, every descendant's: it kills and reaps
    # them all when the program ends or the caller's timeout arrives (SIGTERM).
    check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    program = fork_child()
    if program == 0:
      os.chdir(spec["box"])
      set_limits(spec["limits"])
      exec_program(spec, spec["python"], {"PATH": "/usr/bin:/bin", "HOME": spec["box"],
                                          "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"})
    supervise(program, kill_children, after=True)
  uid, gid = os.getuid(), os.getgid()
  flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
  unshare(flags | (CLONE_NEWUSER if mode == "user" else 0))
  if mode == "user":
    map_self(uid, gid)
  mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the caller
  # Opened in the new mount namespace (a bind from another namespace's mount is refused), and
  # before /tmp is covered: the box and the interpreter stay reachable through these.
  box_fd = os.open(spec["box"], os.O_PATH | os.O_DIRECTORY)
  python_fd = os.open(spec["python_prefix"], os.O_PATH | os.O_DIRECTORY)
  init = fork_child()
  if init:  # B: killing I (pid 1 of the namespace) kills everything inside
    supervise(init, lambda: kill_quietly(init), after=False)
  mount_private_dirs(spec, box_fd, python_fd)  # I, pid 1
  os.chdir(BOX)
  program = os.fork()
  if program == 0:
    try:
      run_program(spec)
    except BaseException as e:  # pylint: disable=broad-except
      os.write(2, f"sandbox: could not start the program: {e}\n".encode())
      os._exit(126)
  os._exit(wait_for(program))


def kill_quietly(pid: int) -> None:
  try:
    os.kill(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


if __name__ == "__main__":
  try:
    main()
  except OSError as e:
    os.write(2, f"{e}\n".encode())
    os._exit(125)
