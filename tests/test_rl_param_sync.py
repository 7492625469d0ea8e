"""Policy versions through orbax: markers, leases, retirement, a publisher killed mid-publish,
restore onto another mesh (glm5_jax/rl/param_sync.py)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from glm5_jax.rl import param_sync as ps

from conftest import REPO_ROOT, run_on_host_devices


def _params(scale=1.0):
  return {"layer": {"w": scale * jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4)},
          "emb": jnp.full((5, 2), scale, jnp.bfloat16), "count": jnp.asarray(7, jnp.int32)}


def _abstract(params):
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), params)


def _equal(a, b):
  return all(jax.tree.leaves(jax.tree.map(
      lambda x, y: np.asarray(x).tobytes() == np.asarray(y).tobytes(), a, b)))


def test_round_trip_and_marker(tmp_path):
  publisher = ps.PolicyPublisher(tmp_path / "policy", keep=2)
  subscriber = ps.PolicySubscriber(tmp_path / "policy")
  assert subscriber.latest_version() is None
  assert subscriber.restore_latest(_abstract(_params())) == (None, None)
  publisher.publish(1, _params())  # async: no marker until the save is finalized
  assert publisher.wait() == 1
  publisher.publish(2, _params(3.0), block=True, extra={"step": 20})
  assert subscriber.latest_version() == 2
  marker = subscriber.marker(2)
  assert marker["version"] == 2 and marker["extra"] == {"step": 20}
  assert marker["shapes"]["['layer']['w']"] == [[3, 4], "float32"]
  version, params = subscriber.restore_latest(_abstract(_params()))
  assert version == 2 and _equal(params, _params(3.0))
  assert _equal(subscriber.restore(1, _abstract(_params())), _params())
  assert not os.listdir(tmp_path / "policy" / ps.LEASES)  # every lease released
  with pytest.raises(ValueError, match="not above the newest published version 2"):
    publisher.publish(2, _params())
  publisher.close()


def test_mismatch_errors(tmp_path):
  publisher = ps.PolicyPublisher(tmp_path / "policy", keep=2)
  publisher.publish(1, _params(), block=True)
  publisher.close()
  subscriber = ps.PolicySubscriber(tmp_path / "policy")
  wrong = dict(_params(), emb=jnp.zeros((5, 3), jnp.bfloat16))
  with pytest.raises(ps.PolicyMismatchError,
                     match=r"\['emb'\]: published \[\[5, 2\], 'bfloat16'\]"):
    subscriber.restore(1, _abstract(wrong))
  marker_path = tmp_path / "policy" / ps.PUBLISHED / "1.json"
  marker = json.loads(marker_path.read_text())
  marker["checksums"]["['layer']['w']"][0] += 1  # as if the stored array were damaged
  marker_path.write_text(json.dumps(marker))
  with pytest.raises(ps.PolicyMismatchError, match=r"fingerprint .* \['layer'\]\['w'\]"):
    subscriber.restore(1, _abstract(_params()))
  with pytest.raises(ps.VersionGoneError, match="version 9 is not published"):
    subscriber.restore(9, _abstract(_params()))
  assert not os.listdir(tmp_path / "policy" / ps.LEASES)


def test_keep_k_and_leases(tmp_path):
  root = tmp_path / "policy"
  publisher = ps.PolicyPublisher(root, keep=2)
  subscriber = ps.PolicySubscriber(root)
  publisher.publish(1, _params(1.0), block=True)
  lease = subscriber.take_lease(1)  # a reader is still reading version 1
  for v in (2, 3, 4):
    publisher.publish(v, _params(float(v)), block=True)
  steps = lambda: sorted(int(p) for p in os.listdir(root / ps.STEPS) if p.isdigit())
  assert steps() == [1, 3, 4] and publisher.published_versions() == [1, 3, 4]
  assert _equal(subscriber.restore(1, _abstract(_params())), _params(1.0))
  lease.unlink()
  # A lease of a dead process on this host expires: version 3 is retired regardless.
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  (root / ps.LEASES / f"3.reader-{dead.pid}-x").write_text(json.dumps(
      {"host": __import__("socket").gethostname(), "pid": dead.pid, "time": 0}))
  publisher.publish(5, _params(5.0), block=True)
  assert steps() == [4, 5] and publisher.published_versions() == [4, 5]
  assert not os.listdir(root / ps.LEASES)
  # A reader asking for a retired version finds no marker, and leaves no lease behind.
  with pytest.raises(ps.VersionGoneError):
    subscriber.restore(3, _abstract(_params()))
  assert not os.listdir(root / ps.LEASES)
  publisher.close()


def test_retired_marker_but_leased_step_survives(tmp_path):
  """The race of the protocol: a reader leases v just after the publisher's first lease listing
  (the marker is already gone): the step stays until a cleanup after the lease is released."""
  root = tmp_path / "policy"
  publisher = ps.PolicyPublisher(root, keep=1)
  publisher.publish(1, _params(), block=True)
  lease = ps.PolicySubscriber(root).take_lease(1)
  (root / ps.PUBLISHED / "1.json").unlink()  # the publisher's marker deletion came first
  publisher.publish(2, _params(2.0), block=True)
  assert (root / ps.STEPS / "1").exists()
  lease.unlink()
  publisher.publish(3, _params(3.0), block=True)
  assert not (root / ps.STEPS / "1").exists()
  publisher.close()


_KILLED_PUBLISHER = textwrap.dedent("""
    import sys, time
    import jax.numpy as jnp
    from glm5_jax.rl import param_sync as ps
    directory, when = sys.argv[1], sys.argv[2]
    publisher = ps.PolicyPublisher(directory, keep=3)
    publisher.publish(1, {"w": jnp.full((1 << 20,), 1.0)}, block=True)
    if when == "after_commit":  # orbax committed version 2; the marker never gets written
      def hang(version, marker):
        print("KILL ME", flush=True)
        time.sleep(600)
      publisher._write_marker = hang
      publisher.publish(2, {"w": jnp.full((1 << 20,), 2.0)}, block=True)
    else:  # killed while orbax writes in the background
      publisher.publish(2, {"w": jnp.full((1 << 20,), 2.0)})
      print("KILL ME", flush=True)
      time.sleep(600)
""")


@pytest.mark.slow
@pytest.mark.parametrize("when", ["after_commit", "during_save"])
def test_publisher_killed_mid_publish(tmp_path, when):
  root = tmp_path / "policy"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT))
  child = subprocess.Popen([sys.executable, "-c", _KILLED_PUBLISHER, str(root), when],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  try:
    line = child.stdout.readline()
    assert line.strip() == "KILL ME", child.stderr.read()[-3000:]
  finally:
    child.send_signal(signal.SIGKILL)
    child.wait()
  if when == "after_commit":  # the trap the marker avoids: orbax lists the unmarked step
    assert ocp.CheckpointManager(root / ps.STEPS).latest_step() == 2
  subscriber = ps.PolicySubscriber(root)
  assert subscriber.latest_version() == 1
  abstract = _abstract({"w": jnp.zeros((1 << 20,), jnp.float32)})
  version, params = subscriber.restore_latest(abstract)
  assert version == 1 and bool(jnp.all(params["w"] == 1.0))
  # The restarted publisher deletes the orphan and publishes version 2 afresh.
  publisher = ps.PolicyPublisher(root, keep=3)
  assert sorted(p for p in os.listdir(root / ps.STEPS) if p.isdigit()) == ["1"]
  publisher.publish(2, {"w": jnp.full((1 << 20,), 5.0)}, block=True)
  publisher.close()
  assert bool(jnp.all(subscriber.restore(2, abstract)["w"] == 5.0))


_RESHARD = textwrap.dedent("""
    import json, sys, tempfile
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from glm5_jax.rl import param_sync as ps
    rng = np.random.default_rng(0)
    host = {"wq": rng.standard_normal((16, 24)).astype(np.float32),
            "emb": np.asarray(jnp.asarray(rng.standard_normal((32, 8))).astype(jnp.bfloat16)),
            "ids": rng.integers(0, 99, (8, 6)).astype(np.int32)}
    trainer_mesh = Mesh(np.array(jax.devices()).reshape(8), ("fsdp",))
    params = {k: jax.device_put(v, NamedSharding(trainer_mesh, P("fsdp"))) for k, v in host.items()}
    directory = tempfile.mkdtemp()
    publisher = ps.PolicyPublisher(directory, keep=2)
    publisher.publish(1, params, block=True)
    publisher.close()
    worker_mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tensor"))
    layouts = {"2x4": {"wq": P("fsdp", "tensor"), "emb": P("tensor", "fsdp"),
                       "ids": P(None, "fsdp")},
               "replicated": {k: P() for k in host}}
    out = {}
    for name, specs in layouts.items():
      abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                          sharding=NamedSharding(worker_mesh, specs[k]))
                  for k, v in host.items()}
      restored = ps.PolicySubscriber(directory).restore(1, abstract)
      out[name] = {k: [np.asarray(v).tobytes() == host[k].tobytes(),
                       v.sharding == abstract[k].sharding] for k, v in restored.items()}
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_restore_onto_another_mesh():
  """Published sharded over fsdp=8, restored over (fsdp=2, tensor=4) and replicated: the same
  bits, in the worker's shardings."""
  out = run_on_host_devices(_RESHARD, devices=8, timeout=300)
  assert out == {name: {k: [True, True] for k in ("wq", "emb", "ids")}
                 for name in ("2x4", "replicated")}, out
