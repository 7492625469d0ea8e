"""Whether this program was launched as one of several JAX processes, and joining them.

For entry points (experiments/*.py) only.
"""

import os

import jax

LAUNCHER_MARKERS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "TPU_WORKER_HOSTNAMES",
                    "MEGASCALE_COORDINATOR_ADDRESS")


def launched_multiprocess() -> bool:
  """True under a multi-process launcher (TPU pod, SLURM, explicit coordinator)."""
  return (any(m in os.environ for m in LAUNCHER_MARKERS)
          or int(os.environ.get("SLURM_NTASKS", "1")) > 1)


def initialize_distributed() -> None:
  """`jax.distributed.initialize()`, given the process count and id from JAX_NUM_PROCESSES and
  JAX_PROCESS_ID where a launcher sets them: jax reads JAX_COORDINATOR_ADDRESS itself but takes
  those two only from a detected cluster (TPU, SLURM, Open MPI, Kubernetes), so without them a
  CPU run fails with "Number of processes must be defined"."""
  given = [name for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if name in os.environ]
  if len(given) == 1:
    raise ValueError(f"{given[0]} is set but not "
                     f"{({'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID'} - set(given)).pop()}; a "
                     "multi-process launch outside a cluster sets both (and "
                     "JAX_COORDINATOR_ADDRESS)")
  if given:
    jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                               process_id=int(os.environ["JAX_PROCESS_ID"]))
  else:
    jax.distributed.initialize()
