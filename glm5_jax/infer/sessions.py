"""Engine sessions: a finished request's slot cache kept for the next turn of its conversation.

A multi-turn rollout (tool call, observation, next turn) submits its whole context every turn.
Without sessions the engine prefills all of it again; with a session the slot that served the
last turn keeps its cache rows, and the next request of the same session continues there,
prefilling only the tokens past them.

What a held session holds: the slot and the ids whose cache rows are valid, the finished
request's prompt plus its generated tokens but the last (the last sampled token is never fed).
The next request of the session reuses them when its prompt starts with those ids and is longer
(`reusable`): positions-addressed caches read rows 0..p only, and a recurrent state (kinds R,
M) is exactly the state after those ids, so continuing from there is the same computation as a
full prefill up to rounding. Anything else (another prefix, an evicted or released session) is a
miss: the whole prompt is prefilled from position 0, which restarts every state.

Slots: a held session's slot is neither active nor free. A request that needs a slot when none
is free evicts the least recently used held session (LRU by when its request finished); the
session's next request is then a miss. Sessions end with `release`.

Counters (`PrefixStats`): prompt tokens submitted and tokens actually prefilled, over every
request, so the hit rate `1 - prefilled / prompt` also counts the group prefix sharing that
prefills one prompt for G samples (`glm5_jax.infer.engine`).
"""

import collections
import dataclasses


@dataclasses.dataclass
class PrefixStats:
  """Counters of one engine since it was built (or since `reset`)."""
  prompt_tokens: int = 0  # submitted: len(prompt) of every admitted request
  prefilled_tokens: int = 0  # run through a prefill chunk (group copies and session rows free)
  session_hits: int = 0  # requests that continued a held session's cache
  session_misses: int = 0  # requests naming a session that was not held or not reusable
  evictions: int = 0  # held sessions dropped for a slot

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["hit_rate"] = (1.0 - self.prefilled_tokens / self.prompt_tokens
                     if self.prompt_tokens else 0.0)
    return d


@dataclasses.dataclass(frozen=True)
class Held:
  slot: int
  tokens: tuple  # ids at cache rows 0..len - 1


def reusable(held: Held, prompt: tuple) -> int:
  """Cache rows a request with `prompt` can keep from `held`: all of them when the prompt
  extends the held ids by at least one token (its last logits must be computed), else 0."""
  n = len(held.tokens)
  return n if len(prompt) > n and prompt[:n] == held.tokens else 0


class SessionTable:
  """Held sessions in LRU order (least recent first)."""

  def __init__(self):
    self._held: collections.OrderedDict = collections.OrderedDict()

  def __contains__(self, session) -> bool:
    return session in self._held

  def __len__(self) -> int:
    return len(self._held)

  def slots(self) -> set:
    return {h.slot for h in self._held.values()}

  def hold(self, session, slot: int, tokens: tuple) -> None:
    self._held.pop(session, None)
    self._held[session] = Held(slot, tuple(tokens))

  def take(self, session) -> Held | None:
    """The session's entry, removed (its slot becomes active), or None when not held."""
    return self._held.pop(session, None)

  def release(self, session) -> bool:
    return self._held.pop(session, None) is not None

  def evict(self) -> int | None:
    """Drops the least recently used session; returns its slot (None when nothing is held)."""
    if not self._held:
      return None
    _, held = self._held.popitem(last=False)
    return held.slot
