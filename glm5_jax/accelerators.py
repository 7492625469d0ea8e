"""The one table of accelerators: peak dense bf16 FLOP/s, HBM bandwidth and size, and the
interconnect bandwidths per chip (public spec sheets; sources in docs/scaling.md), and which
table entry a `jax.Device.device_kind` is.

Read by the MFU of the training loop and `tools/bench_train.py`
(`glm5_jax.train.metrics.peak_flops_per_device`), the bandwidth rate of `tools/bench_dsa.py`,
the fit check of the memory planner (`glm5_jax.planning.planner.ACCELERATOR_HBM_GIB`) and its roofline
estimate (`glm5_jax.planning.roofline`).
"""

import dataclasses

_GB = 1e9


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """One chip (one GPU).

  Attributes:
    kinds: substrings of `jax.Device.device_kind` that name it (case-insensitive).
    peak_flops: dense bf16 FLOP/s.
    hbm_bytes_per_s: HBM bandwidth.
    hbm_gib: HBM size, GiB; None where the kind string does not tell the variant.
    ici_bytes_s: TPU ICI or GPU NVLink bandwidth per chip, one direction (half the vendor's
      bidirectional figure); None where the roofline has no figure for the chip.
    scale_out_bytes_s: GPU InfiniBand per GPU, one direction (None on a TPU slice).
    devices_per_node: GPUs per NVLink domain (None on a TPU slice).
    source: the spec page of the interconnect and HBM figures.
    clock_hz: the TensorCore clock the TPU compiler's `estimated_cycles` count in
      (`glm5_jax.planning.op_costs`); None where not derived. v5p: 459e12 FLOP/s / (2 cores x
      4 MXUs x 128 x 128 multiply-adds x 2) = 1.75 GHz.
    ici_links: ICI links per chip, one per torus direction (a 3D torus 6, a 2D torus 4); each
      link carries `ici_bytes_s / ici_links` one way (`glm5_jax.planning.torus`).
    host_bytes_s: the link between the chip and its host's memory, one direction: what the
      planner prices a transfer to or from host memory at (`glm5_jax.planning.op_costs`, "host
      link"); None where the planner has no figure (such transfers are then listed unpriced).
  """

  kinds: tuple[str, ...]
  peak_flops: float
  hbm_bytes_per_s: float
  hbm_gib: float | None
  ici_bytes_s: float | None = None
  scale_out_bytes_s: float | None = None
  devices_per_node: int | None = None
  source: str = ""
  clock_hz: float | None = None
  ici_links: int | None = None
  host_bytes_s: float | None = None


# Assumed, not from the spec page (which gives no host link figure): v5p's transfers to and from
# host memory at 16 GB/s one way per chip, PCIe Gen3 x16's raw rate (a Gen4 x16 link has 32).
# `tools/plan_cost.py --host_gb_s` prices a saved module at another; docs/scaling.md gives the
# offloading rows at half of it too.
V5P_HOST_BYTES_S = 16 * _GB

# Order matters: a device kind is the first entry with a matching substring ("TPU v5 lite" is
# a v5e, so v5e comes before v5p's bare "TPU v5").
ACCELERATORS = {
    "v4": Accelerator(("TPU v4",), 275e12, 1.2e12, 32),
    "v5e": Accelerator(("TPU v5 lite", "TPU v5e"), 197e12, 0.82e12, 16, 400 * _GB / 2,
                       source="https://cloud.google.com/tpu/docs/v5e", ici_links=4),
    "v5p": Accelerator(("TPU v5p", "TPU v5"), 459e12, 2.76e12, 95, 1200 * _GB / 2,
                       source="https://cloud.google.com/tpu/docs/v5p", clock_hz=1.75e9,
                       ici_links=6, host_bytes_s=V5P_HOST_BYTES_S),
    "v6e": Accelerator(("TPU v6",), 918e12, 1.64e12, 32, 800 * _GB / 2,
                       source="https://cloud.google.com/tpu/docs/v6e", ici_links=4),
    "h100": Accelerator(("H100",), 989e12, 3.35e12, 80, 900 * _GB / 2, 400 * _GB / 8, 8,
                        source="https://www.nvidia.com/en-us/data-center/h100/"),
    "h200": Accelerator(("H200",), 989e12, 4.8e12, 141, 900 * _GB / 2, 400 * _GB / 8, 8,
                        source="https://www.nvidia.com/en-us/data-center/h200/"),
    "a100": Accelerator(("A100",), 312e12, 2.0e12, None),  # 40 or 80 GiB
}


def accelerator_of(device_kind: str) -> Accelerator | None:
  """The table entry of a `device_kind` (e.g. "TPU v5 lite", "NVIDIA H100 80GB HBM3"), or None
  (a CPU, or a chip not in the table)."""
  kind = device_kind.lower()
  for accelerator in ACCELERATORS.values():
    if any(name.lower() in kind for name in accelerator.kinds):
      return accelerator
  return None
