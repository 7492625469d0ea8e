"""Param versions in a server: new params between engine steps, every token tagged.

`VersionedLoop` is an `EngineLoop` whose params can be replaced while it serves
(`set_params(params, version)`, from any thread; an RL trainer's published policy versions:
`glm5_jax.rl.serve_policy`). The swap is a command on the loop's queue, so the engine thread
applies it between two steps: no request is dropped or restarted.

A request that straddles a switch keeps going under the new params (as AReaL's interruptible
generation does): the tokens sampled before the switch came from the old version, the later
ones from the new version, over a cache whose earlier rows the old version wrote. Each token
is tagged with the version whose step sampled it, and its log-probs are the ones that step
computed, so they are the exact behaviour log-probs of that token whatever the version (the
trainer's importance weights correct for the version gap per token:
`glm5_jax.rl.staleness.version_gap` takes the oldest). The alternative (finishing on the old
version) would need two param sets in memory and would stall the switch behind the longest
request.

`watch(request, callback)`, before submitting the request, asks for `callback(completion,
versions, cancelled)` on the engine thread when it ends: its `Completion` and one version per
token. A cancelled request (a client gone, a stop string matched) gets a `Completion` of the
tokens delivered before the cancel (no routing) and `cancelled=True`; a request the engine
refused (at `submit`, or after it: `engine_loop.Refused`) gets `None, [], True`. The TITO
gateway records calls with it (`glm5_jax.serve.gateway`).
"""

import jax
import numpy as np

from glm5_jax.infer.engine import Completion
from glm5_jax.serve.engine_loop import EngineLoop, Refused


class VersionedLoop(EngineLoop):
  """`EngineLoop` plus `version` (the params' version now), `set_params` and `watch`."""

  def __init__(self, engine, *, version: int = 0, **kwargs):
    self.version = _version(version)
    self._watched: dict[int, tuple] = {}  # id(request) -> (request, callback)
    # handle -> (callback, request, and so far: versions, tokens, log-probs, raw log-probs)
    self._by_handle: dict[int, tuple] = {}
    super().__init__(engine, **kwargs)

  def set_params(self, params, version: int) -> None:
    """Serves `params` as `version` from the engine's next step on. `params` must have the
    served params' tree, shapes and dtypes (ValueError naming the first leaf that differs);
    they are placed like the served ones (same shardings)."""
    version = _version(version)
    old = jax.tree_util.tree_flatten_with_path(self.engine.params)
    new = jax.tree_util.tree_flatten_with_path(params)
    if old[1] != new[1]:
      raise ValueError(f"set_params: the new params' tree differs from the served one "
                       f"({len(new[0])} leaves against {len(old[0])})")
    for (path, a), (_, b) in zip(old[0], new[0]):
      if np.shape(a) != np.shape(b) or np.dtype(a.dtype) != np.dtype(b.dtype):
        raise ValueError(f"set_params: leaf {jax.tree_util.keystr(path)} is {np.shape(b)} "
                         f"{b.dtype}; the served one is {np.shape(a)} {a.dtype}")
    if all(isinstance(a, jax.Array) for _, a in old[0]):  # (an EngineProcess: shapes only)
      params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, self.engine.params))
    self._commands.put(("params", (params, version), None))

  def watch(self, request, callback) -> None:
    """`callback(completion | None, versions, cancelled)` when `request` (submitted after this
    call) ends (module docstring); runs on the engine thread, so it must be quick and must not
    call the loop."""
    self._watched[id(request)] = (request, callback)

  def release(self, session) -> None:
    """Frees a held engine session's slot (`Engine.release`) on the engine thread."""
    self._commands.put(("release", session, None))

  def unwatch(self, request) -> None:
    """Forgets a `watch` whose request was never submitted."""
    self._watched.pop(id(request), None)

  def _command(self, kind, request, stream) -> None:
    if kind == "params":
      # Tokens a pipelined engine process sampled ahead came from the old params: theirs first.
      for event in getattr(self.engine, "computed_events", list)():
        self._deliver(event)
      (self.engine.params, self.version) = request
      return
    if kind == "release":
      self.engine.release(request)
      return
    held = [r for r, s in self._held if s is stream] if kind == "cancel" else []
    live = stream is not None and stream.handle in self._streams
    super()._command(kind, request, stream)
    if held:  # cancelled before the engine saw it
      _, callback = self._watched.pop(id(held[0]), (None, None))
      if callback is not None:
        callback(None, [], True)
    elif kind == "cancel" and live and stream.handle not in self._streams:
      watched = self._by_handle.pop(stream.handle, None)
      if watched is not None:
        callback, request, versions, tokens, logprobs, raws = watched
        callback(Completion(request, tokens, logprobs, raws, handle=stream.handle), versions,
                 True)

  def _admitted(self, request, stream) -> None:
    _, callback = self._watched.pop(id(request), (None, None))
    if callback is not None and stream.handle is None:  # refused by Engine.submit
      callback(None, [], True)
    elif callback is not None:
      self._by_handle[stream.handle] = (callback, request, [], [], [], [])

  def _deliver(self, event) -> None:
    if isinstance(event, Refused):  # refused after submit returned: as if submit had raised
      watched = self._by_handle.pop(event.handle, None)
      if watched is not None:
        watched[0](None, [], True)
      super()._deliver(event)
      return
    watched = self._by_handle.get(event.handle)
    if watched is not None:
      _, _, versions, tokens, logprobs, raws = watched
      versions.extend([self.version] * len(event.tokens))
      tokens.extend(event.tokens)
      logprobs.extend(event.logprobs)
      raws.extend(event.raw_logprobs)
      if event.completion is not None:
        del self._by_handle[event.handle]
        watched[0](event.completion, versions, False)  # before the client hears it ended
    super()._deliver(event)


def _version(version) -> int:
  if not isinstance(version, (int, np.integer)) or isinstance(version, bool) or version < 0:
    raise ValueError(f"param version must be an int >= 0, got {version!r}")
  return int(version)
