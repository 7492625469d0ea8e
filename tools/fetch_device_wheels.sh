#!/usr/bin/env bash
# Downloads the Python 3.12 x86-64 wheels that the GPU device image lacks into .whl/ (ignored by
# git), so tools/device_suite.py runs there without a package registry.
#
#   bash tools/fetch_device_wheels.sh            # here, where pip reaches PyPI
#
# then, on the device machine (the run's `carry` names .whl), from the repository root:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && \
#       python3 tools/device_suite.py --out_dir=$OUT
#
# What is missing there: the image (jax 0.11.2 with CUDA, flax, optax, orbax, tensorstore,
# absl-py, etils, cloudpickle, numpy, protobuf, pyyaml, psutil, packaging: the device notes'
# package list) has none of grain, ml_collections, array_record, tensorboardX, nor grain's
# portpicker. Each wheel is pinned to the version this project is tested with, inside
# setup.cfg's range; --no-deps, so every missing dependency is named here, one version each
# (two versions of one package stop the whole install there).
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=.whl
WHEELS=(
  "grain==0.2.18"           # setup.cfg: grain>=0.2.18,<0.3
  "array_record==0.8.6"     # setup.cfg: array_record>=0.7,<0.9 (grain needs it too)
  "ml_collections==1.1.0"   # setup.cfg: ml_collections>=1.0,<2
  "tensorboardX==2.6.5"     # setup.cfg: tensorboardX>=2.6,<3
  "portpicker==1.6.0"       # grain's; needs psutil (in the image)
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
if (( total_kib > 40 * 1024 )); then
  echo "error: $DEST is over 40 MiB (the device run carries at most 64 MiB in all)" >&2
  exit 1
fi
