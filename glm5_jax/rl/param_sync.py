"""Policy versions from the trainer to the rollout workers, through orbax on a shared directory.

Layout of the policy directory (`<workdir>/policy`, a local path or `gs://...`):

  steps/<v>/params/...          orbax CheckpointManager steps, one per published version v
  published/<v>.json            the publisher's marker of v: the only proof that v is complete
  leases/<v>.reader-<pid>-<id>  a reader's lease on v (JSON: host, pid, time)

Protocol.
  Publish v (trainer, `PolicyPublisher.publish`): orbax saves `steps/<v>` (asynchronously when
  asked); once the save is finalized (`wait_until_finished` returned without error, and orbax
  reports the step directory finalized: renamed from its temporary name on a local file system,
  `commit_success.txt` present on GCS), process 0 writes `published/<v>.json` holding v, the
  time and the fingerprint of the params (every leaf's shape, dtype and the two bit checksums
  of `glm5_jax.train.integrity`). Readers trust only markers, never orbax's `latest_step()`: a
  step can be listed whose background commit later failed, or whose publisher was killed before
  the marker (the marker is written after the commit, so neither is ever visible).
  Read v (worker, `PolicySubscriber.restore`): write the lease first, THEN read the marker; no
  marker means v was retired meanwhile (`VersionGoneError`, the lease is dropped; ask again for
  the latest). Restore `steps/<v>/params` into the worker's own abstract tree and shardings
  (orbax reshards), check it against the marker's fingerprint, drop the lease.
  Retire v (publisher, after each publish): versions beyond the newest `keep` are retired
  unless leased: the marker is deleted FIRST, leases are listed AGAIN, and the step directory
  is deleted only when still unleased. A reader either wrote its lease before that second
  listing (the step stays: it is deleted by a later cleanup, after the lease is gone) or
  after the marker was deleted (it finds no marker and never reads the step).
  Leases end when their reader releases them; a lease of a dead process on this host (pid no
  longer running) or one older than `lease_ttl_s` from another host is expired by cleanup.
  Restart (a new publisher on the same directory): committed steps without a marker (the
  publisher died between commit and marker) and orbax's temporary directories are deleted;
  versions are published in increasing order only (a version that already has a marker is
  refused: the trainer resumes from its checkpoint and publishes only later versions).

Atomic small files: markers and leases are written with `glm5_jax.files.write_atomic` (a
reader sees the whole file or nothing; on GCS in place, in one upload). The lease's liveness by
pid cannot be checked across hosts, hence the TTL.

Several trainer processes: the save and the fingerprint are collectives (every process calls
`publish`); process 0 alone writes markers and deletes old versions.
"""

import datetime
import json
import os
import socket
import time
import uuid

from absl import logging
from etils import epath
import jax
import orbax.checkpoint as ocp

from glm5_jax.files import write_atomic
from glm5_jax.train import integrity

STEPS, PUBLISHED, LEASES = "steps", "published", "leases"


class VersionGoneError(RuntimeError):
  """The version has no marker (never completed, or retired by the publisher)."""


class PolicyMismatchError(ValueError):
  """The published params differ from the reader's abstract tree, or from their fingerprint."""


def _is_remote(path: epath.Path) -> bool:
  return "://" in str(path)


def _versions(directory: epath.Path) -> list[int]:
  """Sorted versions named by `<v>.json` files of `directory` (temporary files skipped)."""
  if not directory.exists():
    return []
  out = []
  for p in directory.iterdir():
    stem = p.name[:-len(".json")] if p.name.endswith(".json") else ""
    if stem.isdigit():
      out.append(int(stem))
  return sorted(out)


def params_fingerprint(params) -> dict:
  """{"shapes": {path: [shape, dtype]}, "checksums": {path: [sum, weighted]}} of a params tree
  of global arrays (a collective on several processes)."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  shapes = {jax.tree_util.keystr(p): [list(x.shape), str(x.dtype)] for p, x in leaves}
  return {"shapes": shapes, "checksums": integrity.tree_fingerprint(params)}


class PolicyPublisher:
  """The trainer's side: publishes policy versions and retires old ones.

  Args:
    directory: the policy directory (`<workdir>/policy`; local or `gs://`).
    keep: how many of the newest published versions to keep (>= 1); older ones are deleted
      once no reader holds a lease on them.
    async_save: orbax writes in the background; the marker is written by `poll()` / `wait()`
      once the save is finalized (`publish(..., block=True)` waits at once).
    lease_ttl_s: age after which another host's lease counts as abandoned.
  """

  def __init__(self, directory, keep: int, *, async_save: bool = True,
               lease_ttl_s: float = 6 * 3600):
    if keep < 1:
      raise ValueError(f"PolicyPublisher: keep={keep}, expected >= 1")
    self.directory = epath.Path(directory)
    self.keep = keep
    self.lease_ttl_s = lease_ttl_s
    self._primary = jax.process_index() == 0
    if self._primary:
      for sub in (STEPS, PUBLISHED, LEASES):
        (self.directory / sub).mkdir(parents=True, exist_ok=True)
    self._manager = ocp.CheckpointManager(
        self.directory / STEPS,
        options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                             cleanup_tmp_directories=True,
                                             enable_async_checkpointing=async_save))
    self._pending = None  # (version, marker dict) of a save not yet finalized
    self._remove_unpublished()

  def published_versions(self) -> list[int]:
    return _versions(self.directory / PUBLISHED)

  def publish(self, version: int, params, *, block: bool = False,
              extra: dict | None = None) -> None:
    """Starts saving `params` as `version` (> every published version). The marker is written
    when the save is finalized: now with `block`, else by the next `poll`, `wait`, `publish` or
    `close`. `extra` (JSON-able, e.g. the train step and the model config) is stored in the
    marker for readers. Raises ValueError for a version not above the published ones."""
    self.wait()
    published = self.published_versions()
    if published and version <= published[-1]:
      raise ValueError(f"{self.directory}: version {version} is not above the newest published "
                       f"version {published[-1]}; versions are published in increasing order")
    self._remove_unpublished()
    marker = {"version": int(version), "step_dir": f"{STEPS}/{version}", "extra": extra or {},
              **params_fingerprint(params)}  # before the save: it describes what is written
    self._manager.save(int(version), args=ocp.args.Composite(
        params=ocp.args.StandardSave(params)))
    self._pending = (int(version), marker)
    if block:
      self.wait()

  def poll(self) -> int | None:
    """Finishes a pending publish whose save is done (without blocking); returns its version."""
    if self._pending is None or self._manager.is_saving_in_progress():
      return None
    return self.wait()

  def wait(self) -> int | None:
    """Blocks until the pending save is finalized, writes its marker and retires old versions;
    returns the version published (None when nothing was pending). A failed background save
    raises here, and no marker is written for it."""
    if self._pending is None:
      return None
    version, marker = self._pending
    self._pending = None
    self._manager.wait_until_finished()  # raises the background commit's error, if any
    step_dir = self.directory / STEPS / str(version)
    if not ocp.step.is_path_finalized(step_dir):
      raise RuntimeError(f"{step_dir}: orbax reported the save of version {version} done but "
                         "the step is not finalized; not publishing it")
    if self._primary:
      marker["time"] = datetime.datetime.now().isoformat(timespec="seconds")
      self._write_marker(version, marker)
      self._retire()
    return version

  def close(self) -> None:
    self.wait()
    self._manager.close()

  def _write_marker(self, version: int, marker: dict) -> None:
    write_atomic(self.directory / PUBLISHED / f"{version}.json", json.dumps(marker))

  def _leased(self) -> set[int]:
    """Versions with a live lease; expired leases are deleted on the way."""
    out = set()
    for lease in list_leases(self.directory):
      if _lease_alive(lease, self.lease_ttl_s):
        out.add(lease["version"])
      else:
        logging.info("%s: expiring the lease %s (reader gone)", self.directory, lease["path"])
        lease["path"].unlink(missing_ok=True)
    return out

  def _retire(self) -> None:
    published = self.published_versions()
    old = published[:-self.keep]
    leased = self._leased()
    for version in old:
      if version in leased:
        continue
      (self.directory / PUBLISHED / f"{version}.json").unlink(missing_ok=True)
    self._delete_unpublished_steps()

  def _remove_unpublished(self) -> None:
    """Deletes orphan steps (committed but never marked, or retired) that no reader leases."""
    if self._primary:
      self._delete_unpublished_steps()
    self._manager.reload()

  def _delete_unpublished_steps(self) -> None:
    steps_dir = self.directory / STEPS
    published = set(self.published_versions())
    leased = self._leased()  # listed AFTER the markers were deleted (see the docstring)
    for p in steps_dir.iterdir() if steps_dir.exists() else ():
      if p.name.isdigit() and int(p.name) not in published and int(p.name) not in leased:
        logging.info("%s: deleting unpublished policy step %s", self.directory, p.name)
        p.rmtree()
    self._manager.reload()


def list_leases(directory) -> list[dict]:
  """Every lease file under `<directory>/leases/` as {"version", "path", "host", "pid", "time"}
  (host/pid/time None when the file cannot be read: it then counts as live until its TTL)."""
  leases_dir = epath.Path(directory) / LEASES
  out = []
  for p in leases_dir.iterdir() if leases_dir.exists() else ():
    head, _, tail = p.name.partition(".reader-")
    if not (head.isdigit() and tail):
      continue
    info = {"version": int(head), "path": p, "host": None, "pid": None, "time": None}
    try:
      info.update({k: v for k, v in json.loads(p.read_text()).items() if k in info})
    except (OSError, ValueError):
      try:
        info["time"] = p.stat().mtime
      except OSError:
        continue  # released meanwhile
    out.append(info)
  return out


def _lease_alive(lease: dict, ttl_s: float) -> bool:
  if lease["host"] == socket.gethostname() and lease["pid"] is not None:
    try:
      os.kill(int(lease["pid"]), 0)
    except ProcessLookupError:
      return False
    except PermissionError:
      pass  # alive, another user's process
    return True
  return lease["time"] is None or time.time() - float(lease["time"]) < ttl_s


class PolicySubscriber:
  """A rollout worker's side: finds the newest complete version and restores it.

  Args:
    directory: the policy directory the trainer publishes to.
  """

  def __init__(self, directory):
    self.directory = epath.Path(directory)

  def latest_version(self) -> int | None:
    """The newest version with a marker (None before the first publish)."""
    versions = _versions(self.directory / PUBLISHED)
    return versions[-1] if versions else None

  def marker(self, version: int) -> dict:
    """The marker of `version`; VersionGoneError when it has none."""
    try:
      return json.loads((self.directory / PUBLISHED / f"{version}.json").read_text())
    except FileNotFoundError:
      raise VersionGoneError(f"{self.directory}: version {version} is not published (never "
                             "completed, or retired)") from None

  def take_lease(self, version: int) -> epath.Path:
    leases = self.directory / LEASES
    if not _is_remote(leases):
      leases.mkdir(parents=True, exist_ok=True)
    path = leases / f"{version}.reader-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    write_atomic(path, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                    "time": time.time()}))
    return path

  def restore(self, version: int, abstract_params):
    """Restores `version` into `abstract_params` (a ShapeDtypeStruct tree whose `sharding`s are
    this worker's: orbax reshards from the trainer's layout), verified against its marker.

    Raises:
      VersionGoneError: `version` is not (or no longer) published.
      PolicyMismatchError: the tree's paths, shapes or dtypes differ from the published ones,
        or the restored arrays differ from the marker's checksums.
    """
    lease = self.take_lease(version)
    try:
      marker = self.marker(version)  # after the lease: see the module docstring
      where = self.directory / marker["step_dir"]
      expected = {jax.tree_util.keystr(p): [list(x.shape), str(x.dtype)]
                  for p, x in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
      bad = sorted(k for k in set(expected) | set(marker["shapes"])
                   if expected.get(k) != marker["shapes"].get(k))
      if bad:
        raise PolicyMismatchError(
            f"{where}: the published params differ from this worker's in {len(bad)} leaves, "
            "e.g. " + "; ".join(f"{k}: published {marker['shapes'].get(k, '<absent>')} vs "
                                f"here {expected.get(k, '<absent>')}" for k in bad[:5]))
      with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(where / "params", abstract_params)
      bad = integrity.mismatches(marker["checksums"], integrity.tree_fingerprint(params))
      if bad:
        raise PolicyMismatchError(f"{where}: restored params differ from the fingerprint "
                                  f"published with them in {', '.join(bad[:10])}")
      return params
    finally:
      lease.unlink(missing_ok=True)

  def restore_latest(self, abstract_params, *, attempts: int = 3):
    """`(version, params)` of the newest published version, retrying when the publisher
    retires it meanwhile; `(None, None)` before the first publish."""
    for _ in range(attempts):
      version = self.latest_version()
      if version is None:
        return None, None
      try:
        return version, self.restore(version, abstract_params)
      except VersionGoneError:
        continue
    raise VersionGoneError(f"{self.directory}: the newest version was retired {attempts} times "
                           "while restoring it; is the publisher keeping at least one version?")
