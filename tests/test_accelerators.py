"""The one accelerator table (glm5_jax/accelerators.py): device kinds map to the right chip."""

import pytest

from glm5_jax.accelerators import ACCELERATORS, accelerator_of


@pytest.mark.parametrize("device_kind, name", [
    ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v5p", "v5p"), ("TPU v5", "v5p"),
    ("TPU v4", "v4"), ("TPU v6 lite", "v6e"), ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-40GB", "a100")])
def test_device_kind_names_its_chip(device_kind, name):
  assert accelerator_of(device_kind) is ACCELERATORS[name]


def test_cpu_is_no_accelerator():
  assert accelerator_of("cpu") is None
