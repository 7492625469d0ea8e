"""The shared directory of an asynchronous RL run: the only thing its processes share.

  <root>/checkpoints/   the trainer's orbax checkpoints (state + ledger + staleness counts)
  <root>/metrics.jsonl  the trainer's metrics (and TensorBoard files)
  <root>/policy/        published policy versions (`param_sync`)
  <root>/orders/        rollout orders, trainer -> workers (`orders`)
  <root>/rollouts/      rollout files, workers -> trainer (`trajectories`)
  <root>/workers/       each worker's counters `<name>.json` (busy / idle seconds, versions)
  <root>/control/       `done` (the trainer finished: workers exit), `trainer.json`
                        (its pid and counters)

`<root>` is a local path or `gs://...` (etils paths); experiments/rl.py uses `<workdir>/rl`, the
synchronous loop's directory, so both modes resume the same way.
"""

import dataclasses
import json

from etils import epath

from glm5_jax.files import write_atomic


@dataclasses.dataclass(frozen=True)
class RunDirs:
  root: epath.Path

  @classmethod
  def at(cls, root) -> "RunDirs":
    return cls(epath.Path(root))

  @property
  def policy(self) -> epath.Path:
    return self.root / "policy"

  @property
  def rollouts(self) -> epath.Path:
    return self.root / "rollouts"

  @property
  def workers(self) -> epath.Path:
    return self.root / "workers"

  @property
  def control(self) -> epath.Path:
    return self.root / "control"

  @property
  def done(self) -> epath.Path:
    return self.control / "done"

  def worker_stats(self, name: str) -> epath.Path:
    return self.workers / f"{name}.json"

  @property
  def trainer_stats(self) -> epath.Path:
    return self.control / "trainer.json"


def write_json(path: epath.Path, data: dict) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  write_atomic(path, json.dumps(data))


def read_json(path: epath.Path) -> dict | None:
  """The JSON object at `path`, or None when there is none yet."""
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    return None
