"""`mesh.device_layout`: mesh positions placed on a TPU slice's torus coordinates (no TPU needed:
the devices are stand-ins with `coords`, as TPU devices and ahead-of-time topologies have)."""

import dataclasses

import jax
import numpy as np
import pytest

from glm5_jax.config import ConfigError
from glm5_jax.device_layout import device_grid, parse_device_layout
from glm5_jax.sharding import MESH_AXES, make_mesh, mesh_config

V5P_8x8x16 = (8, 8, 16)


@dataclasses.dataclass(frozen=True)
class Chip:
  coords: tuple[int, int, int]


def slice_chips(dims):
  return [Chip(c) for c in np.ndindex(*dims)]


def sizes(**axes):
  return {a: axes.get(a, 1) for a in MESH_AXES}


def test_strided_expert_groups_are_x_rings_and_fsdp_groups_z_rings():
  """The layout docs/scaling.md prices for the 744B step: each `expert` group of 32 chips is the
  8-chip x ring x 4 chips of y at stride 2, each `fsdp` group the 2 remaining y offsets x the
  16-chip z ring; every chip once."""
  grid = device_grid(slice_chips(V5P_8x8x16), sizes(fsdp=32, expert=32),
                     "expert=x8,y4:2;fsdp=y2,z16")
  coords = np.array([[c.coords for c in row] for row in grid.reshape(32, 32)])  # [fsdp, expert, 3]
  assert len({tuple(c) for c in coords.reshape(-1, 3)}) == 8 * 8 * 16
  for f in range(32):
    group = coords[f]  # one expert group
    assert sorted(set(group[:, 0])) == list(range(8))
    assert sorted(set(group[:, 1])) == [f // 16 + 2 * i for i in range(4)]
    assert set(group[:, 2]) == {f % 16}
  # Major to minor: x is the expert axis's slow digit, y its fast one.
  assert [tuple(c) for c in coords[0, :5]] == [(0, 0, 0), (0, 2, 0), (0, 4, 0), (0, 6, 0),
                                              (1, 0, 0)]
  assert [tuple(c) for c in coords[:2, 0]] == [(0, 0, 0), (0, 0, 1)]
  assert [tuple(c) for c in coords[16:18, 0]] == [(0, 1, 0), (0, 1, 1)]


@pytest.mark.parametrize("spec, message", [
    ("expert=x8,y4:2;fsdp=y2,z8", "fsdp.*size 32.*place 16"),
    ("expert=x8,y4;fsdp=y2,z16", "along y.*once each"),
    ("expert=x8,y4:2;fsdp=y2:4,z16", "along y.*once each"),
    ("experts=x8", "axis of"),
    ("expert=w8", "expected <x|y|z><count>"),
    ("expert=x8;expert=y4", "named twice"),
])
def test_bad_layouts_name_the_field(spec, message):
  with pytest.raises(ConfigError, match=f"mesh.device_layout.*{message}"):
    device_grid(slice_chips(V5P_8x8x16), sizes(fsdp=32, expert=32), spec)


def test_devices_without_coordinates_are_refused_and_the_spec_is_checked_first():
  config = mesh_config(data=1)
  config.device_layout = "data=x1"
  with pytest.raises(ConfigError, match="mesh.device_layout.*torus coordinates"):
    make_mesh(config, jax.devices()[:1])
  config.device_layout = "data=q1"
  with pytest.raises(ConfigError, match="mesh.device_layout.*part 'q1'"):
    make_mesh(config, jax.devices()[:1])
  assert parse_device_layout(" fsdp = y2 , z16 ;", MESH_AXES) == {"fsdp": [(1, 2, 1), (2, 16, 1)]}
