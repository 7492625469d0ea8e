#!/usr/bin/env bash
# Downloads the Python 3.12 x86-64 wheels that the GPU device image lacks into .whl/ (ignored by
# git), so tools/device_suite.py runs there without a package registry.
#
#   bash tools/fetch_device_wheels.sh            # here, where pip reaches PyPI
#
# then, on the device machine (the run's `carry` names .whl), from the repository root:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \
#       python3 tools/device_suite.py --out_dir=$OUT
#
# ($PWD: the checkout is not pip-installed there; the other tools import glm5_jax from it.)
#
# What is missing there: the image (jax 0.11.2 with CUDA, flax, optax, orbax, tensorstore,
# absl-py, etils, cloudpickle, numpy, protobuf, pyyaml, psutil, packaging: the device notes'
# package list) has none of grain, ml_collections, array_record, tensorboardX, nor grain's
# portpicker, nor the server's stack (fastapi, uvicorn, pydantic). Each wheel is pinned to the
# version this project is tested with, inside setup.cfg's range; --no-deps, so every missing
# dependency is named here, one version each (two versions of one package stop the install).
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=.whl
WHEELS=(
  "grain==0.2.18"           # setup.cfg: grain>=0.2.18,<0.3
  "array_record==0.8.6"     # setup.cfg: array_record>=0.7,<0.9 (grain needs it too)
  "ml_collections==1.1.0"   # setup.cfg: ml_collections>=1.0,<2
  "tensorboardX==2.6.5"     # setup.cfg: tensorboardX>=2.6,<3
  "portpicker==1.6.0"       # grain's; needs psutil (in the image)
  # The server (setup.cfg's serve extra: tools/bench_serve.py, experiments/serve.py); httpx,
  # anyio, h11, click, typing-extensions and annotated-doc are in the image.
  "fastapi==0.165.0"        # setup.cfg: fastapi>=0.110,<1
  "starlette==1.10.0"       # fastapi's
  "uvicorn==0.54.0"         # setup.cfg: uvicorn>=0.29,<1
  "pydantic==2.13.4"        # fastapi's
  "pydantic_core==2.46.4"   # pydantic's, pinned by it
  "annotated-types==0.7.0"  # pydantic's
  "typing-inspection==0.4.2"  # pydantic's and fastapi's
  "opentelemetry-api==1.45.2"  # fastapi 0.165 imports it at import time
  # tokamax's grouped matmul for tools/device_suite_moe.py's A/B (optional there; jax >= 0.11.1,
  # the device has 0.11.2). tokamax imports xprof (its benchmarking module) and qwix at import
  # time, and xprof imports fire and gviz_api; absl, flax, six, tqdm and jaxtyping are in the
  # image. xprof is most of the bytes (~31 MiB).
  "tokamax==0.0.17"
  "einshape==1.0"
  "immutabledict==4.3.1"
  "qwix==0.1.8"
  "xprof==2.24.2"
  "fire==0.7.1"
  "termcolor==3.3.0"
  "gviz_api==1.10.0"
)

mkdir -p "$DEST"
for wheel in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 -d "$DEST" "$wheel"
done

ls -l "$DEST"
total_kib=$(du -sk "$DEST" | cut -f1)
echo "$DEST: ${total_kib} KiB in $(ls "$DEST"/*.whl | wc -l) wheels"
if (( total_kib > 48 * 1024 )); then
  echo "error: $DEST is over 48 MiB (the device run carries at most 64 MiB in all)" >&2
  exit 1
fi
