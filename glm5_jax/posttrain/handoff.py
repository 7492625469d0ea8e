"""Long-tail hand-off inside one generation batch: when a group's rollouts run long, stop them
where they are so that another worker can finish them (GLM-5's long-tail migration;
glm5_jax/rl/long_tail.py moves them between rollout workers).

`HandOffRule` says when: a group is due once one of its unfinished samples has generated
`after_tokens` response tokens (all turns together; 0: no length trigger), or once the batch has
run `after_seconds` (0: no time trigger). `run_turn` plays one turn of a batch's requests through
the engine step by step (`Engine.step`), checks the rule after every step and CANCELS every
request of a due group (`Engine.cancel`), keeping the tokens and raw log-probs each one has
generated so far. Those tokens are kept as they are (they are the policy's samples; the
continuation appends to them, each token keeping the version that sampled it), so a handed-off
sample is the same kind of partial rollout as one whose policy changed mid-generation.

Without a due group `run_turn` returns exactly what `Engine.run` would (it is the same loop:
submit everything, step until idle), so a rule that never fires changes no sample.
"""

import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class HandOffRule:
  """When a group is handed off (module docstring). Both triggers 0: never."""
  after_tokens: int = 0
  after_seconds: float = 0.0

  def __post_init__(self):
    if self.after_tokens < 0 or not self.after_seconds >= 0:
      raise ValueError(f"HandOffRule: after_tokens={self.after_tokens}, after_seconds="
                       f"{self.after_seconds} (expected >= 0; 0 disables a trigger)")

  def due(self, tokens: int, elapsed: float) -> bool:
    """Whether a group is due: `tokens`, the most response tokens of one of its unfinished
    samples; `elapsed`, the seconds since its batch started."""
    return bool((self.after_tokens and tokens >= self.after_tokens)
                or (self.after_seconds and elapsed >= self.after_seconds))


@dataclasses.dataclass
class TurnResult:
  """`run_turn`'s outcome, keyed by request position k in its `requests`.

  completions: the `Completion`s of the requests that finished.
  partial: k -> (tokens, raw log-probs) generated so far by a request that was cancelled
    (its group handed off); absent for requests still waiting for a slot (nothing generated).
  handed: the groups handed off during this turn.
  """
  completions: dict
  partial: dict
  handed: set


def run_turn(engine, requests, groups, lengths, rule: HandOffRule, started: float,
             clock=time.monotonic) -> TurnResult:
  """Generates `requests` (an idle engine), handing off due groups (module docstring).

  Args:
    engine: a `glm5_jax.infer.engine.Engine` with nothing in flight.
    requests: the turn's `Request`s.
    groups: `groups[k]`, the group of request k.
    lengths: `lengths[k]`, the response tokens request k's sample had before this turn.
    rule: the `HandOffRule`.
    started: `clock()` when the batch started (the time trigger's origin).
  """
  if engine.busy:
    raise RuntimeError("run_turn: the engine has requests in flight")
  handles = [engine.submit(r) for r in requests]
  position = {h: k for k, h in enumerate(handles)}
  generated = {k: ([], []) for k in range(len(requests))}
  out = TurnResult({}, {}, set())
  while engine.busy:
    for event in engine.step():
      k = position[event.handle]
      if event.completion is not None:
        out.completions[k] = event.completion
      else:
        generated[k][0].extend(event.tokens)
        generated[k][1].extend(event.raw_logprobs)
    running = [k for k in range(len(requests))
               if k not in out.completions and groups[k] not in out.handed]
    longest = {}
    for k in running:
      longest[groups[k]] = max(longest.get(groups[k], 0), lengths[k] + len(generated[k][0]))
    elapsed = clock() - started
    for group in sorted(g for g, n in longest.items() if rule.due(n, elapsed)):
      out.handed.add(group)
      for k in running:
        if groups[k] == group:
          engine.cancel(handles[k])
          if generated[k][0]:
            out.partial[k] = generated[k]
  return out
