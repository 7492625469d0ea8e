"""Ahead-of-time planning: compile a step for a slice (no TPU needed) and read what it costs.

  planner, planner_decode   the train step, serving prefill and decode step as programs
                            compiled from abstract inputs (memory, collectives, FLOPs)
  hlo_loops, hlo_stats      the optimized module's loops and per-step collectives and FLOPs
  roofline                  the bound: matmuls at peak, collectives at full ICI bandwidth
  op_costs, torus, schedule, step_cost
                            the compiler estimate: every instruction priced (the TPU
                            compiler's cycles), collectives on the physical torus, the step
                            time and MFU with no overlap, the schedule's, and ideal
  aot_targets               TPU slices through libtpu, compiled for on this host
  cpu_standins              same-shape stand-ins for MoE ops XLA:CPU cannot compile
  flop_ledger               a step's matmul FLOPs per category and phase, from the module a
                            platform is lowered to (tools/flop_ledger.py: GPU from a CPU host)

The chip table stays in `glm5_jax.accelerators`: the training loop's MFU reads it too.
docs/scaling.md has the figures and the commands that made them.
"""
