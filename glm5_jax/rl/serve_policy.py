"""A server that serves an RL run's newest policy: published versions loaded while it serves.

`PolicyFollower` reads the policy directory the asynchronous trainer publishes to
(`param_sync.PolicySubscriber`, as a rollout worker does: the newest marked version, restored
into the served params' own shapes, dtypes and shardings, checked against its fingerprint) and
hands each newer version to the server's `serve.versions.VersionedLoop.set_params`, which
applies it between two engine steps: requests in flight are not dropped, and every token is
tagged with the version that sampled it (`glm5_jax.serve.versions`). `poll()` checks once;
`start()` polls every `poll_s` seconds on a daemon thread (`experiments/serve.py
--policy_dir`). A version that fails to load (a mismatched tree, a bad checksum) is logged and
the server keeps serving the version it has.
"""

import threading

from absl import logging
import jax
import numpy as np

from glm5_jax.rl.param_sync import PolicySubscriber


def abstract_served_params(params):
  """ShapeDtypeStructs of `params` with their shardings (one device's when they have none)."""
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      np.shape(x), x.dtype, sharding=getattr(x, "sharding", None) or device), params)


class PolicyFollower:
  """Loads the newest published version of `policy_dir` into `loop` (a `VersionedLoop`)."""

  def __init__(self, loop, policy_dir, *, poll_s: float = 5.0):
    if not hasattr(loop, "set_params"):
      raise ValueError("PolicyFollower needs a glm5_jax.serve.versions.VersionedLoop")
    self.loop, self.poll_s = loop, poll_s
    self.subscriber = PolicySubscriber(policy_dir)
    self.abstract = abstract_served_params(loop.engine.params)
    self.loaded: int | None = None
    self._stop = threading.Event()
    self._thread = None

  def poll(self) -> int | None:
    """Loads the newest version when it is newer than the one loaded; returns it, or None when
    there is nothing new."""
    latest = self.subscriber.latest_version()
    if latest is None or (self.loaded is not None and latest <= self.loaded):
      return None
    version, params = self.subscriber.restore_latest(self.abstract)
    self.loop.set_params(params, version)
    self.loaded = version
    logging.info("serving policy version %d from %s", version, self.subscriber.directory)
    return version

  def start(self) -> None:
    def run():
      while not self._stop.wait(self.poll_s):
        try:
          self.poll()
        except Exception as e:  # pylint: disable=broad-except
          logging.error("policy version not loaded (still serving version %s): %s",
                        self.loaded, e)
    self._thread = threading.Thread(target=run, name="policy-follower", daemon=True)
    self._thread.start()

  def close(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
