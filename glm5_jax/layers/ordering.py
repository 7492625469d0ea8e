"""`in_order(tree)`: every leaf of `tree` computed before any is used, in the forward only.

An optimization barrier fixes where the TPU compiler schedules a value: whatever consumes one of
its outputs waits for all of its inputs. The MoE uses it so the collectives a layer needs anyway
(weight gathers, count exchanges) are issued before its rows move, not queued behind the ragged
all-to-alls in flight (`glm5_jax.moe_parallel`, "Weights before rows"). A value is ordered only
where it is used from the barrier's output: one used from before it may still be computed late.

The backward passes the cotangents straight through: a barrier there would hold every cotangent
of the tree until the last of them exists, an order nothing asked for.

Inside `shard_map` (with its type check, check_vma) a barrier's outputs all vary over every
manual mesh axis any of its inputs varies over, so each leaf is first cast to that union
(`jax.lax.pcast`, no data moves; its transpose sums the cotangent over the axes it added, as
using an invariant value beside varying ones does anyway): the barrier's cotangents then have
the leaves' own types.
"""

import jax

from pallas_kernels.blocking import varying_axes


def in_order(tree):
  """`tree` as it is, every leaf computed before any is used (module docstring)."""
  leaves, treedef = jax.tree.flatten(tree)
  union = set().union(*(varying_axes(a) for a in leaves))

  def to_union(a):
    missing = tuple(sorted(union - set(varying_axes(a))))
    return jax.lax.pcast(a, missing, to="varying") if missing else a

  return jax.tree.unflatten(treedef, _barrier([to_union(a) for a in leaves]))


@jax.custom_vjp
def _barrier(leaves):
  return jax.lax.optimization_barrier(leaves)


def _barrier_fwd(leaves):
  return _barrier(leaves), None


def _barrier_bwd(_, ct):
  return (ct,)


_barrier.defvjp(_barrier_fwd, _barrier_bwd)
