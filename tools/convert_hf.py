"""Convert a GLM-5 HF checkpoint directory into a sharded orbax checkpoint + config, streamed.

  python tools/convert_hf.py --hf_dir=/path/to/GLM-5 --out_dir=/path/to/glm5_converted \
      [--mesh=fsdp=64] [--param_dtype=bfloat16] [--mtp_depths=3] [--noscan_layers]

Writes `<out_dir>/params` (one orbax checkpoint per group of leaves, see
`glm5_jax/convert/streaming.py`) and `<out_dir>/config.json`; read them back, on any mesh, with
`glm5_jax.convert.converted.load_converted(out_dir, mesh=...)`. Leaves are built shard by shard
on `--mesh` and written one group at a time, so host memory holds about one leaf's local shards,
not the model. On a pod, run it on every host with --distributed (`jax.distributed.initialize()`
with its cluster auto-detection): each process then reads only its own devices' slices.
"""

import time

from absl import app, flags, logging
import jax

from glm5_jax.convert.streaming import convert_streaming
from glm5_jax.sharding import make_mesh, mesh_config

_HF_DIR = flags.DEFINE_string("hf_dir", None, "HF checkpoint directory (config.json + "
                              "*.safetensors).", required=True)
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Output directory (must not hold a "
                               "conversion already).", required=True)
_MESH = flags.DEFINE_string("mesh", "fsdp=-1", "Mesh the leaves are sharded over while "
                            "writing, as axis=size pairs, e.g. 'fsdp=8' or 'expert=4,fsdp=2' "
                            "(axes data, fsdp, expert, tensor; unnamed axes 1, -1: the rest).")
_PARAM_DTYPE = flags.DEFINE_enum("param_dtype", None, ["float32", "bfloat16", "float16"],
                                 "Param dtype; default: as stored.")
_MTP_DEPTHS = flags.DEFINE_integer("mtp_depths", 3, "MTP depths sharing the MTP layer (0: "
                                   "none).", lower_bound=0)
_SCAN_LAYERS = flags.DEFINE_bool("scan_layers", True, "Write the scanned param layout "
                                 "(stacked runs of layers); else one entry per layer.")
_ALLOW_NONFINITE = flags.DEFINE_bool("allow_nonfinite", False, "Convert NaN / inf weights and "
                                      "FP8 scales instead of refusing them.")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() "
                                  "first (one process per host of a pod).")
_GROUP_MB = flags.DEFINE_float("group_mb", None, "Most MB of leaves written per orbax save; "
                               "default: the largest leaf's size.")
flags.register_validator("group_mb", lambda mb: mb is None or mb > 0,
                         message="--group_mb must be > 0 (MB of leaves per orbax save)")


def parse_mesh(spec: str):
  """'expert=4,fsdp=2' -> a mesh config with those axes, the others 1."""
  sizes = dict(data=1, fsdp=1, expert=1, tensor=1)
  for part in filter(None, spec.split(",")):
    axis, sep, size = part.partition("=")
    if not sep or axis.strip() not in sizes:
      raise app.UsageError(f"--mesh: {part!r} is not axis=size with axis one of {list(sizes)}")
    sizes[axis.strip()] = int(size)
  return mesh_config(**sizes)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # progress lines, not orbax's per-save INFO logs
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  start = time.time()
  mesh = make_mesh(parse_mesh(_MESH.value))
  group_bytes = int(_GROUP_MB.value * 1e6) if _GROUP_MB.value else None

  def log(line):
    if jax.process_index() == 0:
      print(line, flush=True)

  stats = convert_streaming(_HF_DIR.value, _OUT_DIR.value, mesh=mesh,
                            param_dtype=_PARAM_DTYPE.value, mtp_depths=_MTP_DEPTHS.value,
                            scan_layers=_SCAN_LAYERS.value, group_bytes=group_bytes,
                            allow_nonfinite=_ALLOW_NONFINITE.value,
                            progress=log)
  log(f"wrote {stats.leaves} tensors, {stats.bytes / 1e9:.3f} GB to {_OUT_DIR.value} in "
      f"{time.time() - start:.1f}s (mesh {dict(mesh.shape)}; this process held at most "
      f"{stats.largest_group_bytes / 1e6:.1f} MB of leaves at once)")


if __name__ == "__main__":
  app.run(main)
