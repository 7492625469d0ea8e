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


def _under_root(*parts: str) -> property:
  """The path `<root>/<parts...>` of a run directory, as a property of `RunDirs`."""
  return property(lambda dirs: dirs.root.joinpath(*parts))


@dataclasses.dataclass(frozen=True)
class RunDirs:
  """The paths of the module docstring's table, under `root`."""
  root: epath.Path

  policy = _under_root("policy")
  rollouts = _under_root("rollouts")
  workers = _under_root("workers")
  control = _under_root("control")
  done = _under_root("control", "done")
  trainer_stats = _under_root("control", "trainer.json")

  @classmethod
  def at(cls, root) -> "RunDirs":
    return cls(epath.Path(root))

  def worker_stats(self, name: str) -> epath.Path:
    return self.workers / f"{name}.json"


def write_json(path: epath.Path, data: dict) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  write_atomic(path, json.dumps(data))


def read_json(path: epath.Path) -> dict | None:
  """The JSON object at `path`, or None when there is none yet."""
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    return None
