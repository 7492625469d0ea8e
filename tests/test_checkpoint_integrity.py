"""Checkpoint integrity: a damaged step is refused naming its directory; `ckpt.restore_fallback`
resumes from the step before it, with a warning; the fingerprint sees every flipped bit."""

import glob
import logging
import os
import subprocess
import sys

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from glm5_jax.train import checkpoint as ckpt
from glm5_jax.train import integrity
from glm5_jax.train.loop import train
from glm5_jax.train.state import TrainState
from test_train import ROOT, read_losses, small_config
from tests.conftest import host_devices_xla_flags


def _flip_bytes(step_dir, item="params"):
  """XORs 4 bytes in the middle of the item's largest array data file."""
  files = glob.glob(os.path.join(step_dir, item, "**", "d", "*"), recursive=True)
  path = max(files, key=os.path.getsize)
  middle = os.path.getsize(path) // 2
  with open(path, "r+b") as f:
    f.seek(middle)
    data = f.read(4)
    f.seek(middle)
    f.write(bytes(b ^ 0x5A for b in data))


@pytest.mark.slow
def test_flipped_bytes_are_refused_and_fallback_resumes_from_the_step_before(tmp_path, caplog):
  workdir = str(tmp_path / "run")
  # Every run has steps=8 (which shapes the LR schedule) and stops early through its budget:
  # one compiled train step for all three runs, the one other 8-step tests compile too.
  config = small_config(steps=8)
  config.ckpt.every_steps = 2
  train(config, workdir, stop_after_steps=4)  # saves steps 2 and 4
  first = read_losses(workdir)
  damaged = os.path.join(workdir, "checkpoints", "4")
  _flip_bytes(damaged)

  with pytest.raises(ckpt.CheckpointCorruptError, match=rf"(?s){damaged}: damaged checkpoint.*"
                     r"params\['.*restore_fallback"):
    train(config, workdir)

  config.ckpt.restore_fallback = True
  with caplog.at_level(logging.WARNING):
    summary = train(config, workdir, stop_after_steps=4)  # steps 3..6
  assert "skipping damaged step 4" in caplog.text and "resumed from step 2" in caplog.text
  assert summary["steps"] == 6
  assert os.path.isdir(os.path.join(workdir, "checkpoints_damaged", "4"))  # kept, not deleted
  saved = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
  assert saved == [2, 4, 6]  # step 4 written again by the resumed run

  # The run from step 2 is the same run: its losses match the first run's where they overlap,
  # steps 3 and 4, the first two after the restore, where a state or data position restored
  # wrong shows. (A third, straight run to step 6 compared 5 and 6 too: exact resume beyond
  # the first steps is test_train.py's test_loss_drops_and_resume_is_exact.)
  got = read_losses(workdir)  # the resumed run's records come last: they win
  assert sorted(got) == list(range(1, 7))
  np.testing.assert_allclose([got[s] for s in (3, 4)], [first[s] for s in (3, 4)], rtol=1e-6)


class _TinyRun:
  """Checkpoints of a small hand-made state (no model, no compile) in `workdir`."""

  def __init__(self, workdir):
    self.config = ml_collections.ConfigDict(dict(
        model=dict(width=4096), data=dict(seed=0), optim=dict(lr=0.1),
        train=dict(dsa_stage="sparse")))
    self.manager = ckpt.make_manager(workdir, every_steps=1, keep=5, async_save=True)
    self.data = iter(grain.MapDataset.range(100).to_iter_dataset())

  def state(self, step):
    rng = np.random.default_rng(step)
    return TrainState(step=jnp.int32(step),
                      params={"w": jnp.asarray(rng.standard_normal(4096), jnp.float32)},
                      opt_state={"m": jnp.asarray(rng.standard_normal(4096), jnp.bfloat16)},
                      rng=jax.random.key_data(jax.random.key(step)))

  def save(self, step):
    next(self.data)
    ckpt.save(self.manager, self.state(step), self.data, self.config, force=True)
    self.manager.wait_until_finished()

  def restore(self, **kwargs):
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                      self.state(0))
    state, _ = ckpt.restore_latest(self.manager, abstract, self.data, self.config, **kwargs)
    return state


def test_unreadable_or_damaged_steps_name_their_directory(tmp_path, caplog):
  run = _TinyRun(str(tmp_path))
  run.save(1)
  run.save(2)
  step2 = os.path.join(str(tmp_path), "checkpoints", "2")
  restored = run.restore()
  assert int(restored.step) == 2
  np.testing.assert_array_equal(restored.params["w"], run.state(2).params["w"])
  assert next(run.data) == 2  # the data position came back too

  _flip_bytes(step2, "opt_state")
  with pytest.raises(ckpt.CheckpointCorruptError,
                     match=rf"(?s){step2}: damaged checkpoint.*opt_state\['m'\].*restore_fallback"):
    run.restore()

  for path in glob.glob(os.path.join(step2, "params", "**", "d", "*"), recursive=True):
    with open(path, "r+b") as f:  # a torn write: every params data file cut short
      f.truncate(os.path.getsize(path) // 3)
  with pytest.raises(ckpt.CheckpointCorruptError, match=rf"{step2}: could not restore") as e:
    run.restore()
  assert len(str(e.value).splitlines()[0]) < 500, str(e.value)[:2000]  # one line, no dump

  with caplog.at_level(logging.WARNING):
    restored = run.restore(fallback=True)
  assert int(restored.step) == 1
  np.testing.assert_array_equal(restored.params["w"], run.state(1).params["w"])
  assert "skipping damaged step 2" in caplog.text
  assert run.manager.all_steps() == [1]
  assert os.listdir(os.path.join(str(tmp_path), "checkpoints_damaged")) == ["2"]
  run.save(2)  # the run can write step 2 again
  run.manager.close()


def test_a_restored_state_is_placed_as_the_restore_target(tmp_path):
  """Every leaf comes back with the restore target's sharding (the train step's output
  shardings), the step counter and rng (read from the JSON meta) included: an unplaced step and
  rng once made the first step after every resume compile the train step a second time."""
  run = _TinyRun(str(tmp_path))
  run.save(1)
  mesh = jax.make_mesh((len(jax.devices()),), ("data",))
  spec = lambda x: jax.sharding.PartitionSpec("data") if x.ndim else jax.sharding.PartitionSpec()
  abstract = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                     sharding=jax.sharding.NamedSharding(mesh, spec(x))),
      run.state(0))
  abstract = abstract.replace(rng=jax.ShapeDtypeStruct(
      abstract.rng.shape, abstract.rng.dtype,
      sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
  state, _ = ckpt.restore_latest(run.manager, abstract, run.data, run.config)
  targets = jax.tree_util.tree_flatten_with_path(abstract)[0]
  for (path, target), leaf in zip(targets, jax.tree_util.tree_leaves(state)):
    assert leaf.sharding == target.sharding, (jax.tree_util.keystr(path), leaf.sharding)
  assert int(state.step) == 1
  np.testing.assert_array_equal(state.rng, run.state(1).rng)
  run.manager.close()


def test_a_checkpoint_from_before_fingerprints_restores_with_a_warning(tmp_path, caplog):
  run = _TinyRun(str(tmp_path))
  state = run.state(3)
  run.manager.save(3, args=ocp.args.Composite(  # what the previous version wrote
      params=ocp.args.StandardSave(state.params),
      opt_state=ocp.args.StandardSave(state.opt_state),
      meta=ocp.args.JsonSave({"step": 3, "rng": np.asarray(state.rng).tolist(),
                              "config": {k: run.config[k].to_dict()
                                         for k in ("model", "data", "optim")}}),
      data=grain.checkpoint.CheckpointSave(run.data)), force=True)
  run.manager.wait_until_finished()
  with caplog.at_level(logging.WARNING):
    assert int(run.restore().step) == 3
  assert "has no fingerprint" in caplog.text
  run.manager.close()


def test_fingerprint_sees_every_single_bit_flip_and_moved_words():
  x = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32),
       "b": jnp.asarray(np.arange(6), jnp.bfloat16), "n": jnp.asarray(3, jnp.int32),
       "m": jnp.asarray([True, False])}
  base = integrity.tree_fingerprint(x)
  assert set(base) == {"['w']", "['b']", "['n']", "['m']"}
  words = np.asarray(x["w"]).view(np.uint32).copy()
  for bit in (0, 7, 22, 31):
    flipped = words.copy()
    flipped.flat[13] ^= np.uint32(1 << bit)
    changed = integrity.tree_fingerprint({**x, "w": jnp.asarray(flipped.view(np.float32))})
    assert integrity.mismatches(base, changed) == ["['w']"]
  swapped = np.asarray(x["w"])[::-1].copy()  # same words, other places: the sum alone is blind
  changed = integrity.tree_fingerprint({**x, "w": jnp.asarray(swapped)})
  assert changed["['w']"][0] == base["['w']"][0] and integrity.mismatches(base, changed)
  b = np.asarray(x["b"]).copy()
  b[2] = -b[2]
  assert integrity.mismatches(base, integrity.tree_fingerprint({**x, "b": jnp.asarray(b)})) == [
      "['b']"]


_SHARDED_SCRIPT = """
import jax, numpy as np
from glm5_jax.train import integrity
x = jax.numpy.asarray(np.random.default_rng(1).standard_normal((8, 16)), jax.numpy.float32)
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
spec = jax.sharding.PartitionSpec("a", "b")
sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
assert len(sharded.sharding.device_set) == 8
assert integrity.tree_fingerprint([x]) == integrity.tree_fingerprint([sharded])
print("OK")
"""


def test_fingerprint_does_not_depend_on_sharding():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=host_devices_xla_flags(8))
  proc = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_corrupt_checkpoint_metadata_names_the_step(tmp_path):
  """experiments/eval.py's reader: one line naming the step, not a bare JSONDecodeError."""
  from glm5_jax.eval.checkpoints import read_run_meta  # pylint: disable=import-outside-toplevel
  run = _TinyRun(str(tmp_path))
  run.save(1)
  run.manager.close()
  step1 = os.path.join(str(tmp_path), "checkpoints", "1")
  files = [f for f in glob.glob(os.path.join(step1, "meta", "**"), recursive=True)
           if os.path.isfile(f)]
  assert files
  for path in files:
    with open(path, "w") as f:
      f.write("{not json")
  with pytest.raises(ckpt.CheckpointCorruptError,
                     match=rf"^{step1}: unreadable checkpoint metadata \(\w*Error"):
    read_run_meta(str(tmp_path))


def test_a_checkpoint_from_before_an_added_field_resumes_under_its_old_value():
  """`ckpt.ADDED_FIELDS`: a fingerprint saved before `optim.ns_dtype` existed matches a config
  with the old behaviour's value (fp32) and differs from any other."""
  from glm5_jax.optim import optim_config
  current = {"optim": optim_config().to_dict()}
  saved = {"optim": {k: v for k, v in current["optim"].items() if k != "ns_dtype"}}
  filled = ckpt.with_added_fields(saved)
  assert "ns_dtype" not in saved["optim"]  # a copy
  assert ckpt._differences(filled, current) == []
  changed = {"optim": {**current["optim"], "ns_dtype": "bfloat16"}}
  assert ckpt._differences(filled, changed) == [
      "optim.ns_dtype: checkpoint 'float32' vs now 'bfloat16'"]


def test_a_checkpoint_from_before_a_later_model_field_resumes_under_its_old_value():
  """Every `config.LATER_FIELDS` entry is an added field of the model section: a checkpoint
  written before `model.moe_dispatch_chunks` existed resumes under 1, and only under 1."""
  from glm5_jax.config import model_config
  current = {"model": model_config().to_dict()}
  saved = {"model": {k: v for k, v in current["model"].items() if k != "moe_dispatch_chunks"}}
  assert ckpt._differences(ckpt.with_added_fields(saved), current) == []
  changed = {"model": {**current["model"], "moe_dispatch_chunks": 2}}
  assert ckpt._differences(ckpt.with_added_fields(saved), changed) == [
      "model.moe_dispatch_chunks: checkpoint 1 vs now 2"]
