"""HF safetensors -> sharded orbax checkpoint, streamed: host memory bounded by one leaf, not the model.

  convert_streaming(hf_dir, out_dir, mesh=make_mesh(mesh_config(data=1, fsdp=-1)))

Each param leaf (in the layout `scan_layers` selects) becomes a `jax.Array` sharded on `mesh`
through `jax.make_array_from_callback`, whose callback builds only the slice one device holds
(`hf_leaves.read_slice`: a stacked leaf's shard reads only its layers, a routed-expert kernel's
only its experts, through safetensors' lazy `get_slice`). So on a pod each process reads only
what its own devices hold. Leaves are packed in tree order into groups of at most `group_bytes`
(default: the largest leaf, at least 64 MB), and each group is written and dropped before the
next is built.

Bound (per process, beyond the jax/orbax baseline): one group's shards on this process's devices
(with the default budget, at most the largest leaf's addressable part, or 64 MB), orbax's host
copy of them while writing, and what one callback holds while building one shard (that shard,
plus one layer's slice and one HF tensor): about 3x the largest leaf's local part. For GLM-5 with
scan_layers the largest leaf is a stacked expert kernel, `layers_3_77/mlp/experts/*`:
75 x 256 x 6144 x 2048 bf16 = 483 GB, i.e. 483 GB / (number of processes) per process when the
mesh shards it over all of them (e.g. 7.5 GB on 64 hosts); the largest slice a callback reads at
once is one layer's experts for that device. With scan_layers=False the largest leaf is one
layer's experts (6.4 GB, then sharded too); such a checkpoint restores in the unrolled layout
(`layer_runs.stack_layers` converts).

On-disk form (`<out_dir>/params`, read by `converted.load_converted`):
  group_00000/ ...   each a standard orbax checkpoint (`ocp.StandardCheckpointer`: tensorstore
                     zarr arrays in OCDBT, chunked per shard) of one subtree of the params
  groups.json        {"groups": [{"dir": "group_00000", "leaves": ["embed_tokens", ...]}, ...]}
Why one orbax checkpoint per group: orbax 0.12's only API for adding leaves to one checkpoint
over several calls is the experimental v1 `ocp.partial.save` (absent from earlier releases,
its layout and finalize still changing), and writing orbax's tensorstore layout and `_METADATA`
by hand would tie us to its private format. `StandardCheckpointer.save/restore` of a subtree is
the stable, documented API in every orbax release, and restoring with target shardings reshards.
The whole set is written to `params.partial/` and renamed to `params/` when every group is done
(then `config.json`, atomically), so a conversion exists completely or not at all.
"""

import dataclasses
import json
import os
import shutil
import time
from typing import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from glm5_jax.convert.converted import (GROUPS_FILE, PARAMS_DIR, layout_shardings,
                                        write_config)
from glm5_jax.convert.hf import open_hf
from glm5_jax.convert.hf_leaves import LeafSource

PARTIAL_SUFFIX = ".partial"
# Default floor of a group's size: each orbax save costs ~1 s whatever its size, so small leaves
# (norms, biases, a small model's kernels) share a save; negligible next to GLM-5's leaves.
MIN_GROUP_BYTES = 64_000_000


@dataclasses.dataclass(frozen=True)
class ConversionStats:
  leaves: int
  bytes: int  # of the whole model
  groups: int
  largest_leaf_bytes: int
  largest_group_bytes: int  # the most this process held at once: one group's local shards
  seconds: float


def group_leaves(leaves: list[LeafSource], budget: int) -> list[list[LeafSource]]:
  """Consecutive leaves packed into groups of at most `budget` bytes (a larger leaf alone)."""
  groups, size = [], 0
  for leaf in leaves:
    if not groups or size + leaf.nbytes > budget:
      groups.append([])
      size = 0
    groups[-1].append(leaf)
    size += leaf.nbytes
  return groups


def convert_streaming(hf_dir: str, out_dir: str, *, mesh: jax.sharding.Mesh, rules=None,
                      param_dtype: str | None = None, dtype: str | None = None,
                      mtp_depths: int = 3, scan_layers: bool = True,
                      group_bytes: int | None = None, allow_nonfinite: bool = False,
                      progress: Callable[[str], None] = print) -> ConversionStats:
  """Converts `hf_dir` into `<out_dir>/params` + `<out_dir>/config.json`, group by group.

  Args:
    mesh: devices the leaves are built on while writing (every process calls this with its
      part of the same global mesh); reading back can use any other mesh.
    rules: logical axis rules for the conversion's shardings (default: the default rules).
    param_dtype, dtype, mtp_depths, scan_layers, allow_nonfinite: as `glm5_jax.load_hf`.
    group_bytes: most bytes (global) of one group (a larger leaf is a group alone); default:
      the largest leaf's size, at least `MIN_GROUP_BYTES`.
    progress: called with one line after each group (leaves and bytes done, rate).
  Raises:
    FileExistsError: `<out_dir>/params` exists already.
    CheckpointError: the HF directory is not a loadable GLM-5 checkpoint (before writing).
  """
  start = time.time()
  out_dir = os.path.abspath(out_dir)
  final = os.path.join(out_dir, PARAMS_DIR)
  if os.path.exists(final):
    raise FileExistsError(f"{final} already exists; choose a new directory")
  checkpoint = open_hf(hf_dir, param_dtype=param_dtype, dtype=dtype, mtp_depths=mtp_depths,
                       scan_layers=scan_layers, allow_nonfinite=allow_nonfinite)
  shardings = dict(_flat(layout_shardings(checkpoint.config, mesh, rules)))
  leaves = checkpoint.leaves
  largest = max(leaf.nbytes for leaf in leaves)
  groups = group_leaves(leaves, group_bytes or max(largest, MIN_GROUP_BYTES))
  total = sum(leaf.nbytes for leaf in leaves)

  partial = final + PARTIAL_SUFFIX
  if jax.process_index() == 0:
    if os.path.exists(partial):  # left by an interrupted conversion into this directory
      shutil.rmtree(partial)
    os.makedirs(partial)
  multihost_utils.sync_global_devices("convert_streaming:start")

  done_leaves = done_bytes = held = 0
  index = []
  with checkpoint.reader() as reader, ocp.StandardCheckpointer() as checkpointer:
    for k, group in enumerate(groups):
      tree = {}
      for leaf in group:
        _assign(tree, leaf.path, _build(checkpoint, reader, leaf, shardings[leaf.path]))
      held = max(held, sum(_local_bytes(a) for a in jax.tree_util.tree_leaves(tree)))
      name = f"group_{k:05d}"
      checkpointer.save(os.path.join(partial, name), tree)
      checkpointer.wait_until_finished()
      del tree
      index.append({"dir": name, "leaves": [leaf.name for leaf in group]})
      done_leaves += len(group)
      done_bytes += sum(leaf.nbytes for leaf in group)
      elapsed = time.time() - start
      progress(f"[{k + 1}/{len(groups)} groups] {done_leaves}/{len(leaves)} tensors, "
               f"{_size(done_bytes)}/{_size(total)}, "
               f"{_size(done_bytes / max(elapsed, 1e-9))}/s, {elapsed:.1f}s")

  if jax.process_index() == 0:
    with open(os.path.join(partial, GROUPS_FILE), "w") as f:
      json.dump({"groups": index}, f, indent=1)
    os.rename(partial, final)
    write_config(out_dir, checkpoint.config)
  multihost_utils.sync_global_devices("convert_streaming:done")
  return ConversionStats(len(leaves), total, len(groups), largest, held, time.time() - start)


def _build(checkpoint, reader, leaf: LeafSource, sharding) -> jax.Array:
  """`leaf` as a jax.Array with `sharding`, each distinct local shard read once."""
  cache = {}

  def shard(index):
    key = tuple((s.start, s.stop, s.step) for s in index)
    if key not in cache:  # devices holding replicas of one shard share one read
      cache[key] = checkpoint.read(leaf, reader, index)
    return cache[key]

  return jax.make_array_from_callback(leaf.shape, sharding, shard)


def _local_bytes(array: jax.Array) -> int:
  """Bytes of this process's distinct shards of `array`."""
  indices = {tuple((s.start, s.stop) for s in shard.index) for shard in array.addressable_shards}
  shard_bytes = np.prod(array.sharding.shard_shape(array.shape), dtype=np.int64)
  return int(len(indices) * shard_bytes * array.dtype.itemsize)


def _size(n: float) -> str:
  for unit in ("B", "KB", "MB", "GB"):
    if n < 1000:
      return f"{n:.1f} {unit}"
    n /= 1000
  return f"{n:.1f} TB"


def _flat(tree) -> list:
  return [(tuple(str(getattr(k, "key", k)) for k in path), leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _assign(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value
