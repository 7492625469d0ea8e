"""`in_order(tree)`: every leaf of `tree` computed before any is used, in the forward only.

An optimization barrier fixes where the TPU compiler schedules a value: whatever consumes one of
its outputs waits for all of its inputs. The MoE uses it so the collectives a layer needs anyway
(weight gathers, count exchanges) are issued before its rows move, not queued behind the ragged
all-to-alls in flight (`glm5_jax.moe_parallel`, "Weights before rows"). A value is ordered only
where it is used from the barrier's output: one used from before it may still be computed late.

The backward passes the cotangents straight through: a barrier there would hold every cotangent
of the tree until the last of them exists, an order nothing asked for.
"""

import jax


@jax.custom_vjp
def in_order(tree):
  """`tree` as it is, every leaf computed before any is used (module docstring)."""
  return jax.lax.optimization_barrier(tree)


def _in_order_fwd(tree):
  return in_order(tree), None


def _in_order_bwd(_, ct):
  return (ct,)


in_order.defvjp(_in_order_fwd, _in_order_bwd)
