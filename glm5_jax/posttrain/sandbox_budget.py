"""A sandbox run's totals, every process of the run together: memory and CPU seconds.

Stdlib only, and of glm5_jax only sandbox_boot (tests/sandbox_probes.py loads the three by
their file paths). Each limit
is counted one of two ways, chosen when the run starts (`Budget.memory_by`, `.cpu_by`):

  "cgroup"    a root caller that can make cgroup-v1 children here (`_cgroup_root`): one memory
              cgroup per run holds the run (every process and its tmpfs pages) to
              `memory_bytes` in the kernel, so the run never holds more: past it the kernel
              reclaims or OOM-kills inside the run, and the next poll ends the run (its
              `oom_kill` counter rose). One cpuacct cgroup per run counts its CPU time exactly
              (`cpuacct.usage`: every process that was ever in it, the boot and bwrap included).
  "watchdog"  a normal user (the cgroups here are root's, and there is no systemd user session
              to delegate one): the caller reads the run through the sandbox's own procfs,
              /proc/<the sandbox's pid 1>/root/proc, which lists exactly the run's processes
              (its pid namespace) and nothing of the host's. Memory: the sum of their
              proportional set sizes (smaps_rollup `Pss`: a page shared by n processes counts
              1/n in each, so forked copies of the interpreter are not counted n times), the
              memfds they hold open, and the bytes used in the run's tmpfs. System V IPC and
              POSIX message queues, which hold memory no process shows, are refused to every
              run (`seccomp_filter`). CPU: the larger of two lower bounds, the last
              utime + stime seen of every process ever seen in the run, and utime + stime +
              cutime + cstime of the live ones (children reaped by a wait, orphans reaped by
              pid 1 included).

Either way the caller polls every POLL_SECONDS while it waits for the run, and ends the run
(SIGKILL to its pid 1, so to everything in it) when a total passes its limit; `Result.killed_by`
names the limit. What the watchdog cannot do, honestly:
  - it acts after the fact: between two polls a run can hold up to `processes x memory_bytes`
    (RLIMIT_AS still bounds each process) and use up to POLL_SECONDS of CPU per core past its
    budget, plus the time one poll takes (a few ms);
  - a process that lives less than one poll and is reaped with SIGCHLD ignored (the kernel then
    adds its time to no one's cutime) is never counted; the wall clock still bounds such a run;
  - kernel memory (page tables, pipe and socket buffers) is not counted; a memfd passed to
    another process of the run counts once per holder (too much, never too little).
In unsafe mode (no sandbox) the watchdog reads the host's /proc: the run is the boot's process
tree (the boot is its children's subreaper), and there is no tmpfs.
"""

import functools
import itertools
import os
import struct
import time

from glm5_jax.posttrain import sandbox_boot

POLL_SECONDS = 0.1  # how often the caller reads a run's totals (the watchdog's overshoot window)
TICKS = os.sysconf("SC_CLK_TCK")
_RUNS = itertools.count()


@functools.cache
def _cgroup_root(controller: str) -> str | None:
  """This process's cgroup-v1 directory of `controller`, if a child cgroup can be made there."""
  try:
    with open("/proc/self/cgroup") as f:
      path = next(line.strip().split(":", 2)[2] for line in f
                  if controller in line.split(":")[1].split(","))
    with open("/proc/self/mountinfo") as f:
      mount = next(line.split()[4] for line in f
                   if " - cgroup " in line and controller in line.split()[-1].split(","))
  except (OSError, StopIteration, IndexError):
    return None
  base = os.path.join(mount, path.lstrip("/"))
  probe = os.path.join(base, f"glm5-sandbox-{os.getpid()}-probe")
  try:
    os.mkdir(probe)
    os.rmdir(probe)
  except OSError:
    return None
  return base


def counted_by(root_caller: bool) -> dict:
  """{"memory": "cgroup" | "watchdog", "cpu": ...}: how a run's totals are held here."""
  return {"memory": "cgroup" if root_caller and _cgroup_root("memory") else "watchdog",
          "cpu": "cgroup" if root_caller and _cgroup_root("cpuacct") else "watchdog"}


def _make_cgroup(controller: str, settings: dict, optional=()) -> str | None:
  """A new child cgroup of `controller` with `settings` ({file: value}, in order; those named
  in `optional` may be missing here), or None where none can be made."""
  base = _cgroup_root(controller)
  if base is None:
    return None
  path = os.path.join(base, f"glm5-sandbox-{os.getpid()}-{next(_RUNS)}")
  try:
    os.mkdir(path)
    for name, value in settings.items():
      if name in optional and not os.path.exists(os.path.join(path, name)):
        continue
      with open(os.path.join(path, name), "w") as f:
        f.write(str(value))
  except OSError:
    remove_cgroups([path])
    return None
  return path


def remove_cgroups(paths) -> None:
  for path in paths:
    for _ in range(50):  # its last processes may still be exiting
      try:
        os.rmdir(path)
        break
      except FileNotFoundError:
        break
      except OSError:
        time.sleep(0.01)


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def _stat_fields(text: str) -> list[str]:
  """/proc/<pid>/stat's fields after the command name (which may hold spaces and ')')."""
  return text.rsplit(")", 1)[1].split()


def _parents(proc: str) -> dict:
  """{pid: parent pid} of every process in the procfs at `proc`."""
  out = {}
  for name in os.listdir(proc):
    if name.isdigit():
      try:
        out[int(name)] = int(_stat_fields(_read(f"{proc}/{name}/stat"))[1])
      except (OSError, ValueError, IndexError):
        pass
  return out


class Budget:
  """One run's memory and CPU totals. `cgroup_procs()` for the root boot to join before it
  execs bwrap; `over(top)` while the run lives (top: the caller's child, bwrap or the unsafe
  boot); `close()` after it is reaped."""

  def __init__(self, memory_bytes: int, cpu_seconds: float, root_caller: bool, sandboxed: bool):
    self.memory_bytes, self.cpu_seconds, self.sandboxed = memory_bytes, cpu_seconds, sandboxed
    self.memory_cgroup = self.cpu_cgroup = None
    if root_caller and sandboxed:
      # memsw (memory + swap, where swap is accounted): swapping out never makes room.
      self.memory_cgroup = _make_cgroup(
          "memory", {"memory.limit_in_bytes": memory_bytes,
                     "memory.memsw.limit_in_bytes": memory_bytes},
          optional=("memory.memsw.limit_in_bytes",))
      self.cpu_cgroup = _make_cgroup("cpuacct", {})
    self.memory_by = "cgroup" if self.memory_cgroup else "watchdog"
    self.cpu_by = "cgroup" if self.cpu_cgroup else "watchdog"
    self._pid1 = None
    self._seen_cpu = {}  # (pid, start time) -> its last utime + stime, in ticks

  def cgroup_procs(self) -> list[str]:
    return [os.path.join(d, "cgroup.procs") for d in (self.memory_cgroup, self.cpu_cgroup) if d]

  def close(self) -> None:
    remove_cgroups([d for d in (self.memory_cgroup, self.cpu_cgroup) if d])

  def over(self, top: int) -> str | None:
    """"memory_bytes" or "cpu_seconds" when the run's total passed that limit, else None."""
    try:
      memory, cpu = self.usage(top)
    except OSError:  # the run ended while it was read
      return None
    if memory > self.memory_bytes:
      return "memory_bytes"
    if cpu > self.cpu_seconds:
      return "cpu_seconds"
    return None

  def usage(self, top: int) -> tuple[float, float]:
    """(memory bytes, CPU seconds) of the run now. A cgroup's memory reads as over the limit
    once the kernel OOM-killed in it (it never holds more than the limit)."""
    memory = cpu = 0.0
    if self.memory_cgroup:
      memory = self.memory_bytes + 1 if self.oom_killed() else 0
    if self.cpu_cgroup:
      cpu = int(_read(os.path.join(self.cpu_cgroup, "cpuacct.usage"))) / 1e9
    if self.memory_by == "watchdog" or self.cpu_by == "watchdog":
      watched_memory, watched_cpu = self._watch(top)
      memory = memory if self.memory_cgroup else watched_memory
      cpu = cpu if self.cpu_cgroup else watched_cpu
    return memory, cpu

  def oom_killed(self) -> bool:
    """Whether the kernel OOM-killed a process of the run in its memory cgroup."""
    try:
      oom = _read(os.path.join(self.memory_cgroup, "memory.oom_control")).split()
    except (OSError, TypeError):  # no cgroup
      return False
    return "oom_kill" in oom and int(oom[oom.index("oom_kill") + 1]) > 0  # kernels >= 4.13

  def _watch(self, top: int) -> tuple[int, float]:
    """(memory, CPU seconds) summed over the run's processes as /proc shows them."""
    proc, pids, tmp = self._processes(top)
    memory, live_cpu = 0, 0
    for pid in pids:
      try:
        fields = _stat_fields(_read(f"{proc}/{pid}/stat"))
        utime, stime, cutime, cstime = map(int, fields[11:15])
        self._seen_cpu[(pid, fields[19])] = utime + stime
        live_cpu += utime + stime + cutime + cstime
        if self.memory_by == "watchdog":
          memory += _pss(f"{proc}/{pid}/smaps_rollup") + _memfd_bytes(proc, pid)
      except (OSError, ValueError, IndexError):  # it exited between the listing and the read
        pass
    if tmp and self.memory_by == "watchdog":
      try:
        st = os.statvfs(tmp)
        memory += (st.f_blocks - st.f_bfree) * st.f_frsize
      except OSError:
        pass
    return memory, max(live_cpu, sum(self._seen_cpu.values())) / TICKS

  def _processes(self, top: int) -> tuple[str, list[int], str | None]:
    """(a procfs path, the run's pids in it, the run's tmpfs or None)."""
    if not self.sandboxed:  # the unsafe boot's tree, in the host's /proc
      parents, tree = _parents("/proc"), [top]
      for pid in tree:
        tree += [child for child, parent in parents.items() if parent == pid]
      return "/proc", tree, None
    if self._pid1 is None:  # bwrap's child: pid 1 of the run's pid namespace
      kids = sandbox_boot.children_of(top)
      if not kids:
        return "/proc", [], None
      self._pid1 = kids[0]
    inside = f"/proc/{self._pid1}/root"
    if os.stat(f"{inside}/proc").st_dev == os.stat("/proc").st_dev:
      return "/proc", [], None  # bwrap is still building the root: nothing of the run runs yet
    return (f"{inside}/proc", [int(n) for n in os.listdir(f"{inside}/proc") if n.isdigit()],
            f"{inside}/tmp")


# ---- memory no process maps: refused (SysV IPC) or counted (memfds) --------------------------

# System V IPC objects (shared memory segments, message queues, semaphores) and POSIX message
# queues outlive every mapping and every process of the run's IPC namespace, so no /proc file
# of a process shows them: a detached segment of any size is in no process's Pss. The sandbox
# refuses their creation (EPERM) with a seccomp filter (bwrap --seccomp); a memory cgroup would
# charge them, the watchdog cannot see them. {machine: (AUDIT_ARCH_*, {name: syscall nr})}.
REFUSED = {"x86_64": (0xC000003E, {"shmget": 29, "semget": 64, "msgget": 68, "mq_open": 240}),
           "aarch64": (0xC00000B7, {"shmget": 194, "semget": 190, "msgget": 186,
                                    "mq_open": 180})}
X32_BIT = 0x40000000  # x86_64's x32 ABI: the same calls under other numbers, all refused


def seccomp_filter(machine: str) -> bytes | None:
  """The classic-BPF program (struct sock_filter[]) refusing REFUSED on `machine` and every
  syscall of another ABI (i386 int 0x80, x32), or None on a machine REFUSED does not list."""
  if machine not in REFUSED:
    return None
  arch, calls = REFUSED[machine]
  load, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JSET|K, RET|K
  allow, refuse = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
  tests = ([(jset, X32_BIT)] if machine == "x86_64" else []) + [(jeq, n) for n in calls.values()]
  # (code, jump if true, jump if false, k); a jump skips that many instructions. Another arch,
  # or a match of a test, jumps to the last instruction (refuse).
  body = [(load, 0, 0, 4), (jeq, 0, len(tests) + 2, arch), (load, 0, 0, 0)]
  body += [(op, len(tests) - i, 0, k) for i, (op, k) in enumerate(tests)]
  body += [(ret, 0, 0, allow), (ret, 0, 0, refuse)]
  return b"".join(struct.pack("=HBBI", *ins) for ins in body)


def _memfd_bytes(proc: str, pid: int) -> int:
  """Bytes held in memfds (anonymous shmem files) that process `pid` has open: like /tmp's
  files, memory that no mapping shows until someone maps it."""
  total, fds = 0, f"{proc}/{pid}/fd"
  for fd in os.listdir(fds):
    try:
      if os.readlink(f"{fds}/{fd}").startswith("/memfd:"):
        total += os.stat(f"{fds}/{fd}").st_blocks * 512
    except OSError:  # closed meanwhile
      pass
  return total


def _pss(path: str) -> int:
  """A process's proportional set size in bytes (0 for a zombie or a kernel thread)."""
  for line in _read(path).splitlines():
    if line.startswith("Pss:"):
      return int(line.split()[1]) * 1024
  return 0
