"""glm5_jax.files.write_atomic: whole file or none, exclusive writes, no leftovers."""

import os

import pytest

from glm5_jax import files


def test_write_atomic_replaces_and_leaves_no_temporary(tmp_path):
  path = tmp_path / "sub" / "a.json"
  files.write_atomic(path, "one")
  files.write_atomic(path, b"two")
  assert path.read_bytes() == b"two"
  assert os.listdir(path.parent) == ["a.json"]


def test_exclusive_refuses_an_existing_file_and_cleans_up(tmp_path):
  path = tmp_path / "x.npz"
  files.write_atomic(path, b"first", exclusive=True)
  with pytest.raises(FileExistsError, match="x.npz"):
    files.write_atomic(path, b"second", exclusive=True)
  assert path.read_bytes() == b"first" and os.listdir(tmp_path) == ["x.npz"]


def test_temporary_names_are_recognised():
  name = files.temporary_name("0000000001-w0.npz")
  assert name.startswith(".") and files.is_temporary(name, of="0000000001-w0.npz")
  assert not files.is_temporary(name, of="0000000002-w0.npz")
  assert not files.is_temporary("0000000001-w0.npz")
