"""Rollout batches from the workers to the trainer: durable files, consumed exactly once.

A rollout worker writes each generation batch as ONE file `<rollouts>/<batch_index>-<worker>.npz`
(`write_batch`, `glm5_jax.files.write_atomic`): to a temporary dot name in the same directory
(never listed), fsynced, then renamed to its final name, so a listed file is complete; on GCS
uploaded under its final name directly (an object becomes visible only when its upload
completes). Names sort by batch index first (zero-padded), then worker, so the
trainer's order interleaves the workers and is the same for every listing of the same files.

Why npz: numpy reads it with no other dependency; every member is stored raw with its dtype
(token ids and float32 log-probs round-trip bit for bit) and carries a zip CRC-32, so damaged
bytes raise on read instead of loading as other numbers; one batch of a few hundred samples
is a few MB at most, read whole. msgpack has no checksum; array_record is built for random
access into many records (grain), which a read-once batch file does not need.

File contents (samples are ragged: one flat array per field plus offsets, a CSR layout; sample
n is `[offsets[n], offsets[n + 1])`):
  format      int64 scalar (FORMAT)
  offsets     int64 [N + 1]
  tokens      int32 [sum n]    prompt + response token ids, exactly as generated (never text)
  logp        float32 [sum n]  the engine's raw log-prob of each token (0 off the loss mask)
  loss_mask   float32 [sum n]  1 on generated tokens, 0 on prompt and tool observations
  versions    int32 [sum n]    the policy version that generated each token (-1 off the mask);
                               with partial rollouts one sample holds several versions
  reward      float32 [N]      the environment's reward of each sample
  routing_<kind>  int32 [sum n, layers, k]   optional (routing replay, `glm5_jax.routing_replay`:
                               kinds "moe", "dsa"), present when every record carries routing;
                               files without it read as routing None
  meta        uint8 JSON: {"worker", "batch_index", "samples": [per-sample dict, ...]}

The trainer's `TrajectoryLedger` is the set of files it has trained on. It is saved in the same
orbax checkpoint as the train state (`ocp.args.JsonSave(ledger.to_json())`), so a restart
restores the ledger of exactly the restored params: files consumed after that checkpoint are
pending again and are trained on once in the run that survives, and no file is skipped.
A file that cannot be read (damaged bytes, a bad layout) is QUARANTINED rather than stopping the
run: moved to `<rollouts>/quarantine/`, recorded in the ledger with the error, and logged as a
warning. Losing one batch of samples costs RL little; halting every slice for it costs a lot.
"""

import dataclasses
import io
import json
import re

from absl import logging
from etils import epath
import numpy as np

from glm5_jax.files import TEMPORARY_INFIX, is_temporary, write_atomic

FORMAT = 1
QUARANTINE = "quarantine"
_NAME = re.compile(r"^(\d{10})-([A-Za-z0-9_]+)\.npz$")
_WORKER = re.compile(r"^[A-Za-z0-9_]+$")


class CorruptTrajectoryError(ValueError):
  """A rollout file cannot be read or is inconsistent; the message names it."""


@dataclasses.dataclass
class TrajectoryRecord:
  """One sample. Arrays `[n]`: tokens (int32), logp (float32), loss_mask (float32), versions
  (int32); reward: the env's reward; meta: JSON-able (env, task index, rollout id, group, ...);
  routing: None, or `{kind: int32 [n, layers, k]}` (`glm5_jax.posttrain.rollout.Sample`)."""
  tokens: np.ndarray
  logp: np.ndarray
  loss_mask: np.ndarray
  versions: np.ndarray
  reward: float
  meta: dict = dataclasses.field(default_factory=dict)
  routing: dict | None = None


@dataclasses.dataclass
class TrajectoryBatch:
  name: str
  worker: str
  batch_index: int
  records: list


def batch_name(worker: str, batch_index: int) -> str:
  if not _WORKER.match(worker):
    raise ValueError(f"worker name {worker!r}: expected letters, digits and '_' only")
  if not 0 <= batch_index < 10**10:
    raise ValueError(f"batch_index {batch_index}: expected 0 <= index < 1e10")
  return f"{batch_index:010d}-{worker}.npz"


def _encode(records, worker, batch_index) -> dict:
  fields = {"tokens": np.int32, "logp": np.float32, "loss_mask": np.float32,
            "versions": np.int32}
  for i, r in enumerate(records):
    lengths = {f: np.shape(getattr(r, f)) for f in fields}
    if len(set(lengths.values())) != 1 or len(lengths["tokens"]) != 1:
      raise ValueError(f"write_batch: record {i} needs 1-D tokens, logp, loss_mask and versions "
                       f"of one length, got {lengths}")
  lengths = [len(r.tokens) for r in records]
  out = {f: (np.concatenate([np.asarray(getattr(r, f), t) for r in records]) if records
             else np.zeros((0,), t)) for f, t in fields.items()}
  out.update(_encode_routing(records))
  meta = {"worker": worker, "batch_index": batch_index, "samples": [r.meta for r in records]}
  out.update(format=np.asarray(FORMAT, np.int64),
             offsets=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
             reward=np.asarray([r.reward for r in records], np.float32),
             meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
  return out


def _encode_routing(records) -> dict:
  """`routing_<kind>` members (module docstring), or {} when no record has routing."""
  has = [r.routing is not None for r in records]
  if not any(has):
    return {}
  if not all(has):
    raise ValueError(f"write_batch: records {[i for i, h in enumerate(has) if not h][:5]} have no "
                     "routing while others do")
  kinds = set(records[0].routing)
  out = {}
  for i, r in enumerate(records):
    if set(r.routing) != kinds:
      raise ValueError(f"write_batch: record {i} has routing {sorted(r.routing)}, record 0 "
                       f"{sorted(kinds)}")
    for kind, x in r.routing.items():
      if np.ndim(x) != 3 or len(x) != len(r.tokens):
        raise ValueError(f"write_batch: record {i} routing[{kind!r}] has shape {np.shape(x)}, "
                         f"expected [n, layers, k] with n = {len(r.tokens)} tokens")
  for kind in sorted(kinds):
    out[f"routing_{kind}"] = np.concatenate([np.asarray(r.routing[kind], np.int32)
                                             for r in records])
  return out


def write_batch(directory, records, *, worker: str, batch_index: int) -> epath.Path:
  """Writes `records` (TrajectoryRecords) durably as `<directory>/<batch_index>-<worker>.npz`.

  Raises:
    FileExistsError: that file exists (each (worker, batch_index) is written once; a restarted
      worker continues at `next_batch_index`).
    ValueError: a bad worker name, index or record.
  """
  directory = epath.Path(directory)
  name = batch_name(worker, batch_index)
  final = directory / name
  buffer = io.BytesIO()
  np.savez(buffer, **_encode(records, worker, batch_index))
  try:
    write_atomic(final, buffer.getvalue(), exclusive=True)
  except FileExistsError as e:
    raise FileExistsError(f"{final} exists: worker {worker!r} already wrote batch "
                          f"{batch_index}") from e
  return final


def next_batch_index(directory, worker: str) -> int:
  """1 + the highest batch index `worker` has written (quarantined files included); 0 if none."""
  directory = epath.Path(directory)
  indices = [-1]
  for d in (directory, directory / QUARANTINE):
    for p in d.iterdir() if d.exists() else ():
      m = _NAME.match(p.name)
      if m and m.group(2) == worker:
        indices.append(int(m.group(1)))
  return max(indices) + 1


def remove_temporaries(directory, worker: str) -> int:
  """Deletes `worker`'s temporary files left by a crash (call it only from that worker, before
  it writes); returns how many."""
  directory = epath.Path(directory)
  stale = [p for p in (directory.iterdir() if directory.exists() else ())
           if is_temporary(p.name)
           and (m := _NAME.match(p.name[1:p.name.rindex(TEMPORARY_INFIX)]))
           and m.group(2) == worker]
  for p in stale:
    p.unlink(missing_ok=True)
  return len(stale)


def read_batch(path) -> TrajectoryBatch:
  """Reads one rollout file. Raises CorruptTrajectoryError naming it when it is damaged or
  inconsistent."""
  path = epath.Path(path)
  m = _NAME.match(path.name)
  if not m:
    raise CorruptTrajectoryError(f"{path}: not a rollout file name (<10 digits>-<worker>.npz)")
  try:
    with np.load(io.BytesIO(path.read_bytes()), allow_pickle=False) as z:
      data = {k: z[k] for k in z.files}  # reading every member checks its CRC-32
    if int(data["format"]) != FORMAT:
      raise ValueError(f"format {int(data['format'])}, expected {FORMAT}")
    meta = json.loads(data["meta"].tobytes())
    offsets, n = data["offsets"], len(data["reward"])
    total = len(data["tokens"])
    if (offsets.shape != (n + 1,) or offsets[0] != 0 or offsets[-1] != total
        or np.any(np.diff(offsets) < 0) or len(meta["samples"]) != n
        or any(len(data[f]) != total for f in ("logp", "loss_mask", "versions"))):
      raise ValueError("inconsistent offsets or field lengths")
    routing_kinds = [k[len("routing_"):] for k in data if k.startswith("routing_")]
    if any(data[f"routing_{k}"].ndim != 3 or len(data[f"routing_{k}"]) != total
           for k in routing_kinds):
      raise ValueError("inconsistent routing lengths")
    if (meta["worker"], meta["batch_index"]) != (m.group(2), int(m.group(1))):
      raise ValueError(f"its meta says worker {meta['worker']!r} batch {meta['batch_index']}")
  except FileNotFoundError:
    raise
  except Exception as e:  # zipfile, numpy and json raise many types for damaged bytes
    raise CorruptTrajectoryError(f"{path}: damaged rollout file ({type(e).__name__}: {e})") from e
  records = [TrajectoryRecord(*(data[f][a:b] for f in ("tokens", "logp", "loss_mask", "versions")),
                              reward=float(data["reward"][i]), meta=meta["samples"][i],
                              routing={k: data[f"routing_{k}"][a:b] for k in routing_kinds}
                              if routing_kinds else None)
             for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))]
  return TrajectoryBatch(path.name, m.group(2), int(m.group(1)), records)


@dataclasses.dataclass
class TrajectoryLedger:
  """The trainer's record of rollout files: consumed (trained on) and quarantined (unreadable,
  name -> error). Saved with the train state; see the module docstring."""
  consumed: set = dataclasses.field(default_factory=set)
  quarantined: dict = dataclasses.field(default_factory=dict)

  def mark_consumed(self, names) -> None:
    names = [names] if isinstance(names, str) else list(names)
    again = sorted(set(names) & self.consumed)
    if again:
      raise ValueError(f"rollout files consumed twice: {again[:5]}")
    self.consumed.update(names)

  def to_json(self) -> dict:
    return {"consumed": sorted(self.consumed),
            "quarantined": dict(sorted(self.quarantined.items()))}

  @classmethod
  def from_json(cls, data: dict) -> "TrajectoryLedger":
    return cls(set(data["consumed"]), dict(data["quarantined"]))


def pending(directory, ledger: TrajectoryLedger) -> list[str]:
  """Names of the complete rollout files not yet consumed or quarantined, in the deterministic
  order (batch index, then worker)."""
  directory = epath.Path(directory)
  names = [p.name for p in (directory.iterdir() if directory.exists() else ())
           if _NAME.match(p.name)]
  done = ledger.consumed | set(ledger.quarantined)
  return sorted(n for n in names if n not in done)


def quarantine(directory, name: str, ledger: TrajectoryLedger, error: Exception) -> epath.Path:
  """Moves a damaged rollout file to `<directory>/quarantine/` and records it in `ledger`."""
  directory = epath.Path(directory)
  target = directory / QUARANTINE / name
  target.parent.mkdir(parents=True, exist_ok=True)
  (directory / name).rename(target)
  ledger.quarantined[name] = str(error)
  logging.warning("quarantined the damaged rollout file %s (moved to %s): %s", name, target, error)
  return target


def quarantined_names(directory) -> set[str]:
  """Names of the rollout files in `<directory>/quarantine/`."""
  directory = epath.Path(directory) / QUARANTINE
  return {p.name for p in (directory.iterdir() if directory.exists() else ())
          if _NAME.match(p.name)}


def load_pending(directory, ledger: TrajectoryLedger, max_files: int | None = None) -> list:
  """The next pending batches (up to `max_files`), in order; damaged files are quarantined on
  the way. The caller marks the names consumed once they are in a train step whose state is
  saved together with the ledger."""
  out = []
  for name in pending(directory, ledger):
    if max_files is not None and len(out) >= max_files:
      break
    try:
      out.append(read_batch(epath.Path(directory) / name))
    except CorruptTrajectoryError as e:
      quarantine(directory, name, ledger, e)
  return out
