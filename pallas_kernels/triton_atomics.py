"""`atomic_add` for Pallas Triton kernels with a memory order: "relaxed", which an accumulation
needs, or "acq_rel", the only one `plgpu.atomic_add` emits.

Why by hand: jax's Pallas Triton lowering emits every atomic with acquire-release order at GPU
scope (`jax._src.pallas.triton.lowering._atomic_rmw`'s default; `plgpu.atomic_add` takes no
order). ptxas compiles each such atomic with a `MEMBAR.ALL.GPU`, an L1 invalidation
(`CCTL.IVALL`) and `ERRBAR`s around it: the thread waits for all its memory operations at every
atomic. A gradient summed by atomics needs no order (the sum is read after the kernel ends);
CUDA's `atomicAdd` is relaxed for that reason, and a relaxed atomic whose result is unused
compiles to a fire-and-forget `REDG` (offline SASS, sm_90a, `tools/check_triton_compile.py
--dump_dir`). On an H200 the sparse MLA backward (pallas_kernels/sparse_mla_triton.py) took
51.3 ms with acq_rel atomics and 31.4 ms relaxed at L = S = 4,096, 1,218 and 674 ms at 65,536
(docs/device_runs/2026-11-30-h200.md).

How: a primitive of our own ("atomic_add_relaxed") with atomic_rmw's abstract evaluation and
interpret-mode discharge, lowered by jax's own atomic lowering rule while a thread-local order
is set; the one hook, installed once, is a wrapper of `lowering._atomic_rmw` that reads that
order (unset: exactly jax's call). So no other kernel's atomics change, and the pointer and mask
lowering stays jax's own in each version. Private API of jax, checked on 0.10.2, 0.11.2 and
0.12.0.1: `_hooks` raises, naming what it did not find, on a jax whose lowering differs.
"""

import functools
import threading

import jax
from jax._src import core as jax_core
from jax._src.state import discharge as state_discharge
from jax._src.state import primitives as state_primitives

ORDERS = ("relaxed", "acq_rel")

_order = threading.local()  # .semantic: the MemSemantic the hooked `_atomic_rmw` uses, or None


def _hooks():
  """jax's private pieces this module builds on, or a RuntimeError naming the missing one."""
  try:
    from jax._src.lib.triton import dialect as tt  # pylint: disable=g-import-not-at-top
    from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top
    from jax._src.pallas.triton import primitives  # pylint: disable=g-import-not-at-top
    parts = dict(rule=lowering.triton_lowering_rules[primitives.atomic_rmw_p],
                 rmw=lowering._atomic_rmw,  # pylint: disable=protected-access
                 abstract_eval=primitives._atomic_abstract_eval,  # pylint: disable=protected-access
                 discharge=primitives._atomic_rmw_discharge_rule,  # pylint: disable=protected-access
                 add=primitives.AtomicOpType.ADD, relaxed=tt.MemSemantic.RELAXED,
                 lowering=lowering, register=lowering.register_lowering)
  except (ImportError, AttributeError, KeyError) as e:
    raise RuntimeError(f"triton_atomics: jax {jax.__version__}'s Pallas Triton lowering lacks "
                       f"what the relaxed atomic_add builds on ({type(e).__name__}: {e}); use "
                       "order='acq_rel' (plgpu.atomic_add)") from e
  if "semantic" not in parts["rmw"].__code__.co_varnames:
    raise RuntimeError(f"triton_atomics: jax {jax.__version__}'s `_atomic_rmw` takes no "
                       "`semantic`; use order='acq_rel' (plgpu.atomic_add)")
  return parts


@functools.cache
def _relaxed_add():
  """(the primitive, jax's ADD atomic type), installed on first use."""
  h = _hooks()
  jax_rmw = h["rmw"]

  def rmw_with_order(*args, **kwargs):
    semantic = getattr(_order, "semantic", None)
    if semantic is not None:
      kwargs["semantic"] = semantic
    return jax_rmw(*args, **kwargs)

  h["lowering"]._atomic_rmw = rmw_with_order  # pylint: disable=protected-access

  prim = jax_core.Primitive("atomic_add_relaxed")
  prim.def_effectful_abstract_eval(h["abstract_eval"])
  state_discharge.register_discharge_rule(prim)(h["discharge"])

  @h["register"](prim)
  def _lower(ctx, *args_flat, **params):
    _order.semantic = h["relaxed"]
    try:
      return h["rule"](ctx, *args_flat, **params)
    finally:
      _order.semantic = None

  return prim, h["add"]


def atomic_add(ref, idx, val, *, mask=None, order: str = "relaxed"):
  """`ref[idx] += val` atomically inside a Pallas Triton kernel (`plgpu.atomic_add`'s arguments),
  with memory order `order` ("relaxed" | "acq_rel"). Returns the values before the add."""
  if order == "acq_rel":
    from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
    return plgpu.atomic_add(ref, idx, val, mask=mask)
  if order != "relaxed":
    raise ValueError(f"triton_atomics.atomic_add: order={order!r}, expected one of {ORDERS}")
  prim, add = _relaxed_add()
  x_ref, transforms = state_primitives.get_ref_and_transforms(ref, idx, "atomic_rmw")
  args_flat, args_tree = jax.tree_util.tree_flatten((x_ref, transforms, val, mask))
  return prim.bind(*args_flat, args_tree=args_tree, atomic_type=add)
