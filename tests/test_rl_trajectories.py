"""Rollout batch files and the trainer's exactly-once ledger (glm5_jax/rl/trajectories.py)."""

import json

import numpy as np
import pytest

from glm5_jax.rl import trajectories as tj


def _records(seed, n=3):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    length = int(rng.integers(1, 9))
    mask = (np.arange(length) >= length // 2).astype(np.float32)
    out.append(tj.TrajectoryRecord(
        tokens=rng.integers(0, 1000, length).astype(np.int32),
        logp=(-rng.random(length) * mask).astype(np.float32), loss_mask=mask,
        versions=np.where(mask > 0, seed + i % 2, -1).astype(np.int32),
        reward=float(rng.random()), meta={"rollout_id": f"r{seed}-{i}", "env": "addition"}))
  return out


def test_round_trip_bitwise(tmp_path):
  records = _records(4, n=5) + [tj.TrajectoryRecord(*(np.zeros(0, t) for t in (
      np.int32, np.float32, np.float32, np.int32)), reward=0.0)]  # an empty sample survives
  path = tj.write_batch(tmp_path, records, worker="w1", batch_index=12)
  assert path.name == "0000000012-w1.npz"
  batch = tj.read_batch(path)
  assert (batch.worker, batch.batch_index, len(batch.records)) == ("w1", 12, 6)
  for a, b in zip(records, batch.records):
    for field in ("tokens", "logp", "loss_mask", "versions"):
      x, y = getattr(a, field), getattr(b, field)
      assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), field
    assert np.float32(a.reward) == b.reward and a.meta == b.meta
  with pytest.raises(FileExistsError, match="already wrote batch 12"):
    tj.write_batch(tmp_path, records, worker="w1", batch_index=12)
  assert tj.next_batch_index(tmp_path, "w1") == 13 and tj.next_batch_index(tmp_path, "w2") == 0
  with pytest.raises(ValueError, match="worker name 'w-1'"):
    tj.write_batch(tmp_path, records, worker="w-1", batch_index=0)
  bad = tj.TrajectoryRecord(np.zeros(3, np.int32), np.zeros(2), np.zeros(3), np.zeros(3), 0.0)
  with pytest.raises(ValueError, match="record 0 needs 1-D"):
    tj.write_batch(tmp_path, [bad], worker="w1", batch_index=13)


def test_exactly_once_across_restart(tmp_path):
  rollouts, written = tmp_path / "rollouts", []
  for index in range(3):
    for worker in ("w0", "w1"):
      written.append(tj.write_batch(rollouts, _records(index), worker=worker,
                                    batch_index=index).name)
  ledger = tj.TrajectoryLedger()
  order = tj.pending(rollouts, ledger)
  assert order == sorted(written) and order[:2] == ["0000000000-w0.npz", "0000000000-w1.npz"]
  trained = []  # what the surviving run trained on, in order

  def consume(ledger, k):
    batches = tj.load_pending(rollouts, ledger, max_files=k)
    ledger.mark_consumed(b.name for b in batches)
    return [b.name for b in batches]

  trained += consume(ledger, 3)
  checkpoint = json.dumps(ledger.to_json())  # saved with the train state
  consume(ledger, 2)  # trained on, then the trainer is killed before its next checkpoint
  ledger = tj.TrajectoryLedger.from_json(json.loads(checkpoint))
  written.append(tj.write_batch(rollouts, _records(9), worker="w0", batch_index=3).name)
  while tj.pending(rollouts, ledger):
    trained += consume(ledger, 2)
  assert sorted(trained) == sorted(written) and len(trained) == len(set(trained))
  with pytest.raises(ValueError, match="consumed twice"):
    ledger.mark_consumed(trained[0])


def test_temporaries_never_listed(tmp_path):
  tj.write_batch(tmp_path, _records(0), worker="w0", batch_index=0)
  # A worker killed mid-write leaves a temporary file (here: half of a real batch).
  whole = (tmp_path / "0000000000-w0.npz").read_bytes()
  (tmp_path / ".0000000001-w0.npz.tmp-0123abcd").write_bytes(whole[:len(whole) // 2])
  (tmp_path / "notes.txt").write_text("not a batch")
  assert tj.pending(tmp_path, tj.TrajectoryLedger()) == ["0000000000-w0.npz"]
  assert tj.remove_temporaries(tmp_path, "w1") == 0
  assert tj.remove_temporaries(tmp_path, "w0") == 1
  assert not (tmp_path / ".0000000001-w0.npz.tmp-0123abcd").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_file_is_named_and_quarantined(tmp_path, damage):
  for index in range(2):
    tj.write_batch(tmp_path, _records(index, n=40), worker="w0", batch_index=index)
  path = tmp_path / "0000000000-w0.npz"
  data = bytearray(path.read_bytes())
  if damage == "truncate":
    data = data[:len(data) // 2]
  else:  # one byte inside the token ids
    data[data.index(b"tokens.npy") + 200] ^= 0xFF
  path.write_bytes(bytes(data))
  with pytest.raises(tj.CorruptTrajectoryError, match="0000000000-w0.npz: damaged rollout file"):
    tj.read_batch(path)
  ledger = tj.TrajectoryLedger()
  batches = tj.load_pending(tmp_path, ledger)
  assert [b.name for b in batches] == ["0000000001-w0.npz"]
  assert list(ledger.quarantined) == ["0000000000-w0.npz"]
  assert (tmp_path / tj.QUARANTINE / "0000000000-w0.npz").exists() and not path.exists()
  assert tj.pending(tmp_path, ledger) == ["0000000001-w0.npz"]
  assert tj.next_batch_index(tmp_path, "w0") == 2
