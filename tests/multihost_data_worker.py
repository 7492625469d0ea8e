"""One process of tests/test_multihost.py's data check: joins the `jax.distributed` run named by
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, reads this process's shard of the
small training config's data, assembles global batches the way the trainer does
(`jax.make_array_from_process_local_data` on the batch sharding), and saves its local batches,
the gathered global ones and where each device's rows sit to `OUT/data_<process index>.npz`.

  python tests/multihost_data_worker.py OUT [NUM_BATCHES]
"""

import os
import sys

import jax
from jax.experimental import multihost_utils
import numpy as np

from glm5_jax import data as data_lib
from glm5_jax.sharding import batch_sharding, make_mesh
from test_train import small_config  # tests/ is this script's sys.path[0]


def main(out: str, num_batches: int):
  jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                             process_id=int(os.environ["JAX_PROCESS_ID"]))
  config = small_config()
  config.mesh.shape.update(data=2, fsdp=-1)
  sharding = batch_sharding(make_mesh(config.mesh), config.mesh.logical_axis_rules)
  iterator = data_lib.make_train_iterator(config.data, process_index=jax.process_index(),
                                          process_count=jax.process_count())
  arrays = {}
  for step in range(num_batches):
    batch = next(iterator)
    for key, local in batch.items():
      global_array = jax.make_array_from_process_local_data(sharding, np.asarray(local))
      arrays[f"local/{step}/{key}"] = local
      arrays[f"global/{step}/{key}"] = multihost_utils.process_allgather(global_array,
                                                                         tiled=True)
      arrays[f"global_shape/{step}/{key}"] = np.asarray(global_array.shape)
  iterator.close()
  # Row ranges held by this process's devices (the batch axis is sharded over all of them).
  rows = sharding.addressable_devices_indices_map((config.data.batch_size, config.data.seq_len))
  arrays["device_rows"] = np.asarray(sorted((s[0].start or 0, s[0].stop) for s in rows.values()))
  np.savez(os.path.join(out, f"data_{jax.process_index()}.npz"), **arrays)
  multihost_utils.sync_global_devices("data worker done")


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2)
