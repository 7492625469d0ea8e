"""Routing replay: the recorded routing decisions of a forward pass, and replaying them.

RL trains on log-probs the inference engine computed. Two discrete choices inside the model
can flip between the engine and the trainer even where every other number agrees to rounding:
each MoE layer's top-X experts (a near-tie of biased router scores, or a correction bias that
moved after the rollout) and each DSA layer's top-T keys (the indexer's scores; the indexer
does not train on the policy loss, but its ties are just as fragile). One flipped choice
changes that token's output, and the trainer's ratio pi_theta / pi_rollout then measures the
flip, not the policy (the ratio `exp(logp_theta - logp_rollout)` of docs/reference.md
section 4). Replaying the rollout's choices in the trainer removes that source of mismatch;
tools/replay_mismatch.py measures it.

Format, independent of the param layout (scanned runs or unrolled layers):

  routing = {"moe": int32 [B, L, N_moe, X],   experts chosen at each token, per MoE layer
             "dsa": int32 [B, L, N_dsa, T]}   keys chosen at each query, per selecting DSA layer

`routed_layers` says which layers, in order: "moe" every MoE layer; "dsa" every layer that makes
its own top-k (kind "dsa", letter D). Shared-top-k (R) layers reuse the previous selection, so
replaying it replays theirs; sliding-window (S) selections are fixed by position. Key indices
are positions in the row (= cache rows of the engine), so a replayed row holds one sequence
starting at position 0 (as RL batches do). T may differ from the forward's own top-k width
(the engine selects over its max_len rows): slots past the valid ones are -1 and are dropped
or added as needed.

A token whose record is -1 (every slot) is not replayed: that layer computes its own choice
there (padding, or the last generated token, which the engine never fed to the model).
Replayed MoE gate weights are recomputed from the current router scores at the recorded
experts, normalized as usual, so the router keeps its gradient.

Notation (docs/design.md): B batch, L sequence, X experts per token, T top-k keys,
N routed layers of one kind.
"""

import jax.numpy as jnp
import numpy as np

from glm5_jax.attention.kinds import KINDS_BY_NAME

KINDS = ("moe", "dsa")
NOT_RECORDED = -1


def selects_own_topk(attention_kind: str) -> bool:
  """Whether a layer of this attention kind makes its own DSA selection (records "dsa")."""
  kind = KINDS_BY_NAME[attention_kind]
  return kind.provides_topk and not kind.needs_prev_topk


def routed_layers(cfg) -> dict[str, tuple[int, ...]]:
  """The decoder layers (indices) each routing kind covers, in order (module docstring)."""
  layers = range(cfg.num_hidden_layers)
  return {"moe": tuple(i for i in layers if cfg.is_moe_layer(i)),
          "dsa": tuple(i for i in layers if selects_own_topk(cfg.attention_kind(i)))}


def check_routing(routing, cfg, shape_BL) -> None:
  """Raises ValueError naming the entry when `routing` does not fit the model and tokens."""
  unknown = sorted(set(routing) - set(KINDS))
  if unknown:
    raise ValueError(f"routing: unknown keys {unknown}; expected some of {KINDS}")
  layers = routed_layers(cfg)
  for kind, x in routing.items():
    want = tuple(shape_BL) + (len(layers[kind]),)
    if x.ndim != 4 or tuple(x.shape[:3]) != want:
      raise ValueError(f"routing[{kind!r}]: shape {tuple(x.shape)}, expected [B, L, N, k] with "
                       f"[B, L, N] = {want} (N: the model's {kind} layers {layers[kind]})")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"routing[{kind!r}]: dtype {x.dtype}, expected int32")
  if "moe" in routing and routing["moe"].shape[-1] != cfg.num_experts_per_tok:
    raise ValueError(f"routing['moe']: {routing['moe'].shape[-1]} experts per token, the model "
                     f"routes to num_experts_per_tok={cfg.num_experts_per_tok}")


def for_layers(routing, cfg, first: int, last: int) -> dict:
  """The part of `routing` for layers `first..last` (one run), each kind stacked on a leading
  `[layers]` axis: `{kind: [last - first + 1, B, L, k]}`, only the kinds those layers have.
  A run is homogeneous (`glm5_jax.layer_runs`), so it holds all or none of a kind's layers."""
  out = {}
  if routing is None:
    return out
  for kind, layers in routed_layers(cfg).items():
    if kind in routing and first in layers:
      j = layers.index(first)
      out[kind] = jnp.moveaxis(routing[kind][:, :, j:j + last - first + 1], 2, 0)
  return out


def from_layers(per_run: list[dict]) -> dict:
  """Inverse of `for_layers` over all runs in layer order: `[layers, B, L, k]` per run and kind
  -> `{kind: [B, L, N, k]}` (kinds no run recorded are absent)."""
  out = {}
  for kind in KINDS:
    parts = [jnp.moveaxis(r[kind], 0, 2) for r in per_run if kind in r]
    if parts:
      out[kind] = jnp.concatenate(parts, axis=2)
  return out


def replay(own_MK, recorded_MK):
  """`recorded_MK` where a token has a record (its first slot >= 0), else `own_MK`; the
  record's last axis is cut or padded with -1 to `own_MK`'s width first (module docstring).
  Any leading axes."""
  width = own_MK.shape[-1]
  recorded_MK = recorded_MK.astype(own_MK.dtype)
  if recorded_MK.shape[-1] > width:
    recorded_MK = recorded_MK[..., :width]
  elif recorded_MK.shape[-1] < width:
    pad = [(0, 0)] * (recorded_MK.ndim - 1) + [(0, width - recorded_MK.shape[-1])]
    recorded_MK = jnp.pad(recorded_MK, pad, constant_values=NOT_RECORDED)
  return jnp.where(recorded_MK[..., :1] >= 0, recorded_MK, own_MK)


def pad_rows(arrays: list, length: int, width: int | None = None) -> np.ndarray:
  """Host side: per-sample `[n, N, k]` records -> `[len(arrays), length, N, width]` int32,
  each left-aligned, padded with -1 (not recorded); `width` default the widest k."""
  n_layers = {a.shape[1] for a in arrays}
  if len(n_layers) != 1:
    raise ValueError(f"routing records disagree on the number of layers: {sorted(n_layers)}")
  width = max(a.shape[2] for a in arrays) if width is None else width
  out = np.full((len(arrays), length, n_layers.pop(), width), NOT_RECORDED, np.int32)
  for i, a in enumerate(arrays):
    if len(a) > length:
      raise ValueError(f"routing record {i}: {len(a)} tokens, more than the row's {length}")
    k = min(width, a.shape[2])
    out[i, :len(a), :, :k] = a[:, :, :k]
  return out
