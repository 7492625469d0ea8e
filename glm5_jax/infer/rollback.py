"""Undoing rejected speculative tokens in one layer's decode cache.

A verification call feeds L = k + 1 tokens per slot (the last emitted token and k drafts) and
keeps only the first `kept` of them (1 + the accepted drafts). Afterwards each layer's cache
must be as if only those had been fed:

  - position-indexed caches (MLA latent and DSA indexer keys, GQA K / V) and the S ring: nothing
    to do. A rejected token's rows sit at positions beyond the last kept one; no later query
    reads them (a query at p reads positions <= p, and the next call rewrites them first), and
    the ring is sized so they never displaced a row still in the window (`glm5_jax.attention
    .swa`);
  - recurrent states (the kinds with `AttentionKind.decode_steps`: N and L): the call returned
    every state entry after each of its tokens (`aux["cache_steps"]`); take the one after token
    `kept - 1`, or the cache from before the call when `kept` is 0.

Notation (docs/design.md): B slots, L tokens of the call.
"""

import jax
import jax.numpy as jnp

from glm5_jax.attention.kinds import ATTENTION_KINDS, KINDS_BY_NAME, AttentionKind
from glm5_jax.layer_runs import layer_runs, unrolled_name


def _kind(kind) -> AttentionKind:
  if isinstance(kind, AttentionKind):
    return kind
  found = ATTENTION_KINDS.get(kind) or KINDS_BY_NAME.get(kind)
  if found is None:
    raise ValueError(f"rollback: unknown attention kind {kind!r}; letters "
                     f"{sorted(ATTENTION_KINDS)} or names {sorted(KINDS_BY_NAME)}")
  return found


def rollback(kind, cache_before: dict, cache_after: dict, cache_steps: dict | None, kept_B):
  """One layer's cache as if only the first `kept_B` tokens of the last decode call were fed.

  Args:
    kind: the layer's attention kind: an `AttentionKind`, its letter ("N") or name ("gdn").
    cache_before: the cache the call was given.
    cache_after: the call's `aux["cache"]`.
    cache_steps: the call's `aux["cache_steps"]` (`[B, L, ...]` per entry), or None when the
      call fed one token (then `kept_B` is 0 or 1) or the kind has no recurrent state.
    kept_B: int `[B]` in 0..L: how many of the call's tokens stand, counted by index along L
      (a slot that verified nothing keeps all L).
  Returns:
    The cache: same keys, shapes and dtypes as `cache_after`.
  """
  kind = _kind(kind)
  if set(cache_after) != set(cache_before):
    raise ValueError(f"rollback ({kind.name}): cache keys differ before {sorted(cache_before)} "
                     f"and after {sorted(cache_after)}")
  if not kind.decode_steps:
    return cache_after  # rejected rows are never read
  if cache_steps is not None and set(cache_steps) != set(cache_after):
    raise ValueError(f"rollback ({kind.name}): cache_steps has keys {sorted(cache_steps)}, "
                     f"expected {sorted(cache_after)}")
  kept_B = jnp.asarray(kept_B, jnp.int32)
  out = {}
  for key, before in cache_before.items():
    if cache_steps is None:  # a one-token call: its state, or the one before it
      picked = cache_after[key]
    else:
      steps_BL = cache_steps[key]
      index_B = jnp.clip(kept_B - 1, 0, steps_BL.shape[1] - 1)
      picked = jnp.take_along_axis(
          steps_BL, index_B.reshape((-1, 1) + (1,) * (steps_BL.ndim - 2)), axis=1)[:, 0]
    none_kept = (kept_B == 0).reshape((-1,) + (1,) * (before.ndim - 1))
    out[key] = jnp.where(none_kept, before, picked).astype(cache_after[key].dtype)
  return out


def rollback_cache(cfg, cache_before: dict, cache_after: dict, cache_steps: dict, kept_B) -> dict:
  """The whole model's cache tree as if only the first `kept_B` tokens of the last
  `glm5_jax.infer.step.decode_step` call were fed: `rollback` per layer, vmapped over a
  scanned run's stacked layers.

  Args:
    cfg: the `ModelConfig` the cache was built for.
    cache_before: the tree the call was given. cache_after: its returned tree.
    cache_steps: its `StepOutput.cache_steps` ({} for a one-token call).
    kept_B: int `[B]`, tokens of the call that stand per slot.
  Returns:
    The tree; entries without a recurrent state are `cache_after`'s, untouched.
  """
  out = dict(cache_after)
  for run in layer_runs(cfg):
    kind = ATTENTION_KINDS[cfg.attention_pattern[run.first]]
    if not kind.decode_steps:
      continue
    names = [run.name] if cfg.scan_layers else [unrolled_name(i)
                                                 for i in range(run.first, run.last + 1)]
    for name in names:
      steps = cache_steps.get(name)
      one = lambda before, after, steps: rollback(kind, before, after, steps, kept_B)
      if cfg.scan_layers:
        one = jax.vmap(one, in_axes=(0, 0, None if steps is None else 0))
      out[name] = one(cache_before[name], cache_after[name], steps)
  return out
