"""Convert a GLM-5 HF checkpoint directory into an orbax checkpoint + config for this codebase.

  python tools/convert_hf.py --hf_dir=/path/to/GLM-5 --out_dir=/path/to/glm5_converted \
      [--param_dtype=bfloat16] [--mtp_depths=3]

Writes `<out_dir>/params` (orbax) and `<out_dir>/config.json` (the model config); read them
back with `glm5_jax.convert.converted.load_converted(out_dir)`. The import reads tensor by tensor
(see `glm5_jax.load_hf`), so host memory stays near one copy of the model.
"""

import time

from absl import app, flags, logging
import jax

import glm5_jax
from glm5_jax.convert.converted import save_converted

_HF_DIR = flags.DEFINE_string("hf_dir", None, "HF checkpoint directory (config.json + "
                              "*.safetensors).", required=True)
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Output directory (must not hold a "
                               "conversion already).", required=True)
_PARAM_DTYPE = flags.DEFINE_enum("param_dtype", None, ["float32", "bfloat16", "float16"],
                                 "Param dtype; default: as stored.")
_MTP_DEPTHS = flags.DEFINE_integer("mtp_depths", 3, "MTP depths sharing the MTP layer.")


def main(argv):
  del argv
  start = time.time()
  logging.info("reading %s", _HF_DIR.value)
  config, params = glm5_jax.load_hf(_HF_DIR.value, param_dtype=_PARAM_DTYPE.value,
                                    mtp_depths=_MTP_DEPTHS.value)
  count = sum(x.size for x in jax.tree_util.tree_leaves(params))
  logging.info("imported %.3fB params in %.1fs; writing %s", count / 1e9, time.time() - start,
               _OUT_DIR.value)
  save_converted(_OUT_DIR.value, config, params)
  print(f"wrote {count:,} params ({config.param_dtype}) to {_OUT_DIR.value} in "
        f"{time.time() - start:.1f}s")


if __name__ == "__main__":
  app.run(main)
