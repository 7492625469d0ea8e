"""A roofline bound of a compiled step's time: compute at the chip's peak, each mesh axis's
collectives at its interconnect's bandwidth, nothing else costing. A bound on a compiled
program, not an estimate nor a measurement: no kernel reaches peak, non-matmul work costs,
collectives have latency and ride only some of a chip's links. The TPU compiler's own estimate
of the same step, op by op, is `step_cost` (reported beside this, labelled "compiler estimate").

  compute_s   = matmul FLOPs per step per chip (`hlo_stats.step_dot_flops`, loops multiplied)
                / the chip's peak bf16 FLOP/s
  comm_s[a]   = bytes one device sends per step over the collectives spanning mesh axes `a`
                (`hlo_stats.StepCollective.link_bytes` x runs) / that axis's bandwidth
  overlap_s   = max(compute_s, sum(comm_s))   perfect overlap of compute and communication
  serial_s    = compute_s + sum(comm_s)       none
  MFU         = model FLOPs per chip per step / (step time x peak), model FLOPs =
                `glm5_jax.train.metrics.flops_per_token` (6 x active params + attention) x
                tokens per chip: the usual definition (PaLM's), so recomputation (remat) is
                cost, not credit; the compiled FLOPs (which include it) set the compute time.

Bandwidths (`glm5_jax.accelerators`, sources in docs/scaling.md): a TPU mesh axis within one slice rides the
ICI; the figure used is the chip's ICI bandwidth in one direction (half the vendor's
bidirectional per-chip figure), i.e. every collective gets all of the chip's links, an
optimistic bound for a ring along a single torus dimension. A GPU axis whose groups stay
within one 8-GPU node rides NVLink (half the 900 GB/s bidirectional figure), an axis that
crosses nodes the node's InfiniBand (one 400 Gb/s NIC per GPU); the mesh's flattened device
order is taken as node-major (jax.make_mesh's order on GPU). Collectives are serialised among
themselves (their times add), different axes included.
"""

import dataclasses

from glm5_jax.accelerators import ACCELERATORS, Accelerator

# The chips with interconnect figures: the ones a roofline can be estimated for.
CHIPS = {name: chip for name, chip in ACCELERATORS.items() if chip.ici_bytes_s is not None}


def axis_bandwidth(chip: Accelerator, axes: str, mesh_shape: dict[str, int]) -> float:
  """Bytes/s one device sends over the collectives spanning `axes` ("+"-joined)."""
  if chip.scale_out_bytes_s is None:
    return chip.ici_bytes_s
  inner = 1  # devices spanned by the axes, counted from the innermost axis outwards
  names = list(mesh_shape)
  spanned = [names.index(a) for a in axes.split("+") if a]
  for i in range(min(spanned, default=len(names)), len(names)):
    inner *= mesh_shape[names[i]]
  return chip.ici_bytes_s if inner <= chip.devices_per_node else chip.scale_out_bytes_s


@dataclasses.dataclass(frozen=True)
class Estimate:
  compute_s: float
  comm_s: dict  # mesh axes -> seconds
  overlap_s: float
  serial_s: float
  tokens_per_chip: float
  tokens_per_s_per_chip: dict  # "overlap" / "serial"
  mfu: dict  # "overlap" / "serial"; None without model FLOPs
  hardware_flops: float
  model_flops: float | None


def estimate(chip: Accelerator, hardware_flops: float, link_bytes_by_axes: dict[str, float],
             mesh_shape: dict[str, int], tokens_per_chip: float,
             model_flops_per_token: float | None) -> Estimate:
  """The roofline of one step on one chip (module docstring). `hardware_flops`: compiled matmul
  FLOPs per chip per step; `link_bytes_by_axes`: bytes sent per device per step by mesh axes;
  `model_flops_per_token`: training (or inference) FLOPs per token, None to skip MFU."""
  compute = hardware_flops / chip.peak_flops
  comm = {axes: sent / axis_bandwidth(chip, axes, mesh_shape)
          for axes, sent in link_bytes_by_axes.items()}
  overlap = max(compute, sum(comm.values()))
  serial = compute + sum(comm.values())
  model = None if model_flops_per_token is None else model_flops_per_token * tokens_per_chip
  rate = lambda t: tokens_per_chip / t if t else float("inf")
  mfu = lambda t: None if model is None or not t else model / (t * chip.peak_flops)
  return Estimate(compute, comm, overlap, serial, tokens_per_chip,
                  {"overlap": rate(overlap), "serial": rate(serial)},
                  {"overlap": mfu(overlap), "serial": mfu(serial)}, hardware_flops, model)
