"""Atomic file writes: a reader sees the whole new file or none of it, never a part.

Locally the data goes to a temporary name in the target's directory (`.<name>.tmp-<8 hex>`, a
dot name that no listing in this repository matches), is flushed and fsynced, then renamed
onto the target (`os.replace`, atomic on POSIX), and the directory is fsynced so the rename
itself survives a crash. `exclusive=True` refuses an existing target instead of replacing it.

On a remote path (`gs://...`, etils) rename is a copy and a delete, not atomic; but an object
becomes visible only once its upload is complete, so there the file is written in place, in
one upload.

This module imports nothing of glm5_jax: every floor may use it.
"""

import os
import uuid

from etils import epath

TEMPORARY_INFIX = ".tmp-"


def temporary_name(name: str) -> str:
  """The temporary name `write_atomic` writes `name` under first (crash leftovers match
  `is_temporary`)."""
  return f".{name}{TEMPORARY_INFIX}{uuid.uuid4().hex[:8]}"


def is_temporary(name: str, of: str | None = None) -> bool:
  """Whether `name` is a leftover temporary of `write_atomic` (of the file named `of`)."""
  if not name.startswith(".") or TEMPORARY_INFIX not in name:
    return False
  target = name[1:name.rindex(TEMPORARY_INFIX)]
  return of is None or target == of


def write_atomic(path, data: str | bytes, *, exclusive: bool = False, mode: int = 0o644) -> None:
  """Writes `data` (text as UTF-8) to `path` atomically (module docstring); creates the parent
  directory.

  Args:
    exclusive: raise FileExistsError (and leave nothing behind) when `path` exists.
    mode: the file's permission bits (local files).
  """
  path = epath.Path(path)
  raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
  if exclusive and path.exists():
    raise FileExistsError(f"{path} exists")
  if "://" in str(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    return
  directory = os.path.dirname(os.path.abspath(str(path)))
  os.makedirs(directory, exist_ok=True)
  tmp = os.path.join(directory, temporary_name(os.path.basename(str(path))))
  try:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
      f.write(raw)
      f.flush()
      os.fsync(f.fileno())
    if exclusive:
      os.link(tmp, str(path))  # fails with FileExistsError if another writer got there first
      os.unlink(tmp)
    else:
      os.replace(tmp, str(path))
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
