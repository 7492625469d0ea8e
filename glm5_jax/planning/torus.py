"""Collectives priced on the slice's physical torus: each replica group's chips placed at their
coordinates, every link one direction at a time.

  torus = Torus((8, 8, 16), (True, True, True), link_bytes_s=100e9)
  seconds = collective_seconds("all-gather", link_bytes, buffer_bytes, groups, coords, torus)

The roofline (`roofline.py`) gives every mesh axis the chip's whole ICI bandwidth. Here a mesh
axis is what its groups' chips are on the torus (`planner.mesh_layout` has each mesh position's
coordinates): a v5p chip has two links per torus dimension (one each way), a dimension that a
group spans completely and that wraps is a ring, one it spans in part is a line, and a group
whose chips sit every s-th position shares its links with s - 1 interleaved groups.

Ring collectives (all-gather, reduce-scatter, all-reduce): the bandwidth-optimal ring algorithm
sends `link_bytes` per device (`hlo_stats.StepCollective.link_bytes`: (n-1)/n of the buffer,
twice for an all-reduce). A closed ring runs both ways at once (2 links), a line one (its links
used in both directions by one embedded ring); a group spanning several dimensions runs one
ring per dimension concurrently, the data split in proportion to their bandwidth, so its rate
is the sum: an upper bound on the rate, a lower bound on the time.

  seconds = link_bytes / (link_bytes_s x sum over the dims it spans of rings_d / stride_d)

All-to-all, ragged all-to-all and collective-permute are multi-hop: every (source, destination)
pair's bytes (a uniform all-to-all: the buffer / n to each peer; a ragged one its input, its
worst case) follow the shortest way around each dimension in turn (dimension-ordered routing,
ties split both ways), every group at once; the time is the busiest directed link's bytes over
one link's bandwidth. Latency (per hop, per step) is not modelled: a lower bound.
"""

import dataclasses
import functools

import numpy as np

RING_OPS = ("all-gather", "reduce-scatter", "all-reduce")
ROUTED_OPS = ("all-to-all", "ragged-all-to-all", "collective-permute", "collective-broadcast")


@dataclasses.dataclass(frozen=True)
class Torus:
  """A slice's chips: `dims` per torus dimension, which ones `wrap`, and one link's bandwidth
  in one direction (`link_bytes_s`; a chip has two links per dimension, one each way)."""

  dims: tuple[int, ...]
  wrap: tuple[bool, ...]
  link_bytes_s: float


def ring_rate(groups, coords: np.ndarray, torus: Torus) -> float:
  """Bytes/s one device sends in a ring collective over `groups` (lists of mesh positions;
  `coords[position]` its chip's coordinates): the sum over the dimensions the groups span of
  2 links for a closed ring, 1 for a line, over the stride between the group's chips."""
  rate = 0.0
  for d, (size, wraps) in enumerate(zip(torus.dims, torus.wrap)):
    values = sorted({int(coords[p][d]) for p in groups[0]})
    if len(values) < 2:
      continue
    steps = np.diff(values)
    stride = int(steps.max())
    closed = wraps and len(values) * stride == size and bool((steps == stride).all())
    rate += (2.0 if closed else 1.0) / stride
  if rate == 0.0:
    raise ValueError(f"groups {groups[0][:8]}... span no torus dimension: coordinates "
                     f"{[list(coords[p]) for p in groups[0][:4]]}")
  return rate * torus.link_bytes_s


def _hops(src: np.ndarray, dst: np.ndarray, size: int, wraps: bool):
  """Per pair, the signed hop count along one dimension by the shorter way (`[P]` int), and the
  pairs whose two ways tie on a ring (`[P]` bool, their bytes split half each way)."""
  delta = dst - src
  if not wraps:
    return delta, np.zeros_like(delta, bool)
  forward = np.mod(delta, size)
  backward = forward - size
  signed = np.where(forward <= -backward, forward, backward)
  tie = (forward == -backward) & (forward != 0)
  return signed, tie


def _add_route(load: dict, position: np.ndarray, d: int, signed: np.ndarray,
               weight: np.ndarray, torus: Torus):
  """Adds each pair's `weight` to every directed link it crosses along dimension `d`, starting
  from `position` (`[P, dims]`), `signed` hops (`[P]`). A link is (dimension, direction, the
  chip it leaves): `load[(d, sign)]` is indexed by the flat chip index."""
  at = position.copy()
  chips = int(np.prod(torus.dims))
  for step in range(int(np.abs(signed).max(initial=0))):
    moving = np.abs(signed) > step
    for sign in (-1, 1):
      chosen = moving & (np.sign(signed) == sign)
      if chosen.any():
        flat = np.ravel_multi_index(tuple(at[chosen].T), torus.dims)
        np.add.at(load.setdefault((d, sign), np.zeros(chips)), flat, weight[chosen])
    at[moving, d] += np.sign(signed[moving])
    if torus.wrap[d]:
      at[:, d] %= torus.dims[d]


def routed_seconds_per_byte(pairs: np.ndarray, coords: np.ndarray, torus: Torus) -> float:
  """Seconds per byte sent by each (source, destination) pair of `pairs` (`[P, 2]` mesh
  positions, all at once) under dimension-ordered shortest-way routing: the busiest directed
  link's load over one link's bandwidth."""
  load = {}
  position = coords[pairs[:, 0]].astype(int)
  target = coords[pairs[:, 1]].astype(int)
  weight = np.ones(len(pairs))
  for d, (size, wraps) in enumerate(zip(torus.dims, torus.wrap)):
    signed, tie = _hops(position[:, d], target[:, d], size, wraps)
    if tie.any():  # half the bytes each way round the ring
      other = np.where(tie, signed - np.sign(signed) * size, signed)
      position = np.concatenate([position, position[tie]])
      target = np.concatenate([target, target[tie]])
      weight = np.concatenate([np.where(tie, 0.5 * weight, weight), 0.5 * weight[tie]])
      signed = np.concatenate([signed, other[tie]])
    _add_route(load, position, d, signed, weight, torus)
    position[:, d] = target[:, d]
  busiest = max((float(v.max()) for v in load.values()), default=0.0)
  return busiest / torus.link_bytes_s


def _all_pairs(groups) -> np.ndarray:
  return np.asarray([(s, t) for g in groups for s in g for t in g if s != t], int)


@functools.lru_cache(maxsize=256)
def _cached_rate(op: str, groups: tuple, coords_key: tuple, torus: Torus) -> float:
  coords = np.asarray(coords_key)
  if op in RING_OPS:
    return 1.0 / ring_rate(groups, coords, torus)
  pairs = np.asarray(groups, int) if op == "collective-permute" else _all_pairs(groups)
  return routed_seconds_per_byte(pairs, coords, torus)


def collective_seconds(op: str, link_bytes: float, buffer_bytes: float, groups, coords,
                       torus: Torus) -> float:
  """One execution's time of a collective on the torus.

  Args:
    op: the HLO opcode without `-start` (`RING_OPS` or `ROUTED_OPS`).
    link_bytes: what one device sends under the ring algorithm (ring ops).
    buffer_bytes: the per-device array moved (routed ops: split evenly over the group's peers
      for an all-to-all; the pair's whole array for a permute).
    groups: replica groups (lists of mesh positions), or a permute's (source, target) pairs.
    coords: `[devices, dims]` chip coordinates by mesh position (`planner.mesh_layout`).
  """
  groups = tuple(tuple(int(p) for p in g) for g in groups)
  key = tuple(map(tuple, np.asarray(coords, int).tolist()))
  rate = _cached_rate(op, groups, key, torus)
  if op in RING_OPS:
    return link_bytes * rate
  if op == "collective-permute":
    return buffer_bytes * rate
  n = max(len(g) for g in groups)
  return buffer_bytes / n * rate
