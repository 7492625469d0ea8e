"""Which TPU chip holds each mesh position: a device grid built from the chips' torus coordinates.

jax's own placement (`jax.make_mesh`, or `mesh_utils.create_device_mesh` for an ahead-of-time
slice) fills the mesh axes from the torus dimensions in a fixed order. On v5p:8x8x16 with
`fsdp 32 x expert 32` that gives each `expert` group the 16-chip z ring x 2 chips of x, and the
MoE's ragged all-to-all, which runs inside those groups, crosses the ring's few links
(docs/scaling.md, "The expert axis on the torus"). `mesh.device_layout` names the placement
instead, per mesh axis, as parts of the physical dimensions:

  "expert=x8,y4:2;fsdp=y2,z16"

  expert  8 chips along x (the whole wrapped x ring) x 4 chips along y at stride 2 (y = 0, 2, 4, 6
          plus the offset the other axes give)
  fsdp    2 chips along y (offsets 0, 1) x the 16-chip z ring

An axis's parts run from its major to its minor digit (the last part varies fastest with the
axis index); a part `<dim><count>[:<stride>]` adds `digit x stride` to that dimension's
coordinate. Across all axes the parts of each physical dimension must tile it exactly (every
coordinate once), and each axis's part counts must multiply to its size in `mesh.shape`; axes of
size 1 are left out. Written by hand because jax's `mesh_utils` takes only contiguous or
whole-dimension splits, not an interleaved (strided) one.
"""

import itertools
import math
import re

import numpy as np

from glm5_jax.config import require

PHYSICAL_DIMS = "xyz"
_PART = re.compile(r"^([xyz])(\d+)(?::(\d+))?$")


def parse_device_layout(spec: str, axis_names) -> dict[str, list[tuple[int, int, int]]]:
  """`"expert=x8,y4:2;fsdp=y2,z16"` -> `{axis: [(dim index, count, stride), ...]}`, major first.

  Raises ConfigError (naming `mesh.device_layout`) on a malformed spec or an unknown axis.
  """
  field = "mesh.device_layout"
  layout = {}
  for entry in filter(None, (e.strip() for e in spec.split(";"))):
    axis, sep, parts = entry.partition("=")
    axis = axis.strip()
    require(sep and axis in axis_names, field,
            f"each entry is <mesh axis>=<parts> with an axis of {tuple(axis_names)}, got "
            f"{entry!r}")
    require(axis not in layout, field, f"axis {axis!r} is named twice")
    layout[axis] = []
    for part in parts.split(","):
      match = _PART.match(part.strip())
      require(match is not None, field,
              f"part {part.strip()!r} of {axis!r}: expected <x|y|z><count>[:<stride>], e.g. y4:2")
      dim, count, stride = match.group(1), int(match.group(2)), int(match.group(3) or 1)
      require(count >= 1 and stride >= 1, field, f"part {part.strip()!r}: count and stride >= 1")
      layout[axis].append((PHYSICAL_DIMS.index(dim), count, stride))
  require(layout, field, f"no axis placed in {spec!r}")
  return layout


def device_grid(devices, axis_sizes: dict[str, int], spec: str) -> np.ndarray:
  """The devices arranged as the mesh `axis_sizes` (ordered as the mesh's axes) per `spec`.

  Args:
    devices: TPU devices with torus `coords` (x, y, z), one chip each, forming a whole slice.
    axis_sizes: mesh axis name -> size, in the mesh's axis order.
    spec: `mesh.device_layout` (module docstring).
  Returns:
    object array shaped `tuple(axis_sizes.values())`: the device at each mesh position.
  """
  field = "mesh.device_layout"
  layout = parse_device_layout(spec, tuple(axis_sizes))
  require(all(hasattr(d, "coords") for d in devices), field,
          "needs devices with torus coordinates (TPU); these have none: leave it empty")
  by_coords = {}
  for d in devices:
    key = tuple(int(c) for c in d.coords)
    require(key not in by_coords, field, f"two devices at chip {key} (several cores per chip?): "
            "a layout places whole chips")
    by_coords[key] = d
  dims = tuple(max(k[i] for k in by_coords) + 1 for i in range(len(PHYSICAL_DIMS)))
  require(len(by_coords) == math.prod(dims), field,
          f"the {len(by_coords)} devices are not a whole {'x'.join(map(str, dims))} slice")
  for axis, size in axis_sizes.items():
    placed = math.prod(count for _, count, _ in layout.get(axis, ()))
    require(placed == size, field,
            f"axis {axis!r} has size {size} in mesh.shape but its parts place {placed} chips")
  for dim, extent in enumerate(dims):
    parts = [(count, stride) for axis in layout for d, count, stride in layout[axis] if d == dim]
    covered = sorted(sum(digit * stride for digit, (_, stride) in zip(digits, parts))
                     for digits in itertools.product(*(range(count) for count, _ in parts)))
    require(covered == list(range(extent)), field,
            f"the parts along {PHYSICAL_DIMS[dim]} ({', '.join(f'{c}:{s}' for c, s in parts)}) "
            f"must cover its {extent} chips once each")

  grid = np.empty(tuple(axis_sizes.values()), dtype=object)
  for position in np.ndindex(grid.shape):
    coords = [0] * len(PHYSICAL_DIMS)
    for axis, index in zip(axis_sizes, position):
      parts = layout.get(axis, ())
      digits = np.unravel_index(index, tuple(count for _, count, _ in parts)) if parts else ()
      for (dim, _, stride), digit in zip(parts, digits):
        coords[dim] += int(digit) * stride
    grid[position] = by_coords[tuple(coords)]
  return grid
