"""`count_compiles` (glm5_jax/infer/compile_count.py) tells programs loaded from the persistent
compilation cache (`cache_hits`) from those compiled: two processes, one cache directory."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import json, jax, jax.numpy as jnp
from glm5_jax.infer.compile_count import count_compiles
with count_compiles() as c:
  jax.jit(lambda x: jnp.tanh(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
print(json.dumps([c.count, c.cache_hits]))
"""


@pytest.mark.slow
def test_the_second_process_loads_what_the_first_compiled(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  runs = [json.loads(subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True,
                                    capture_output=True, text=True).stdout.splitlines()[-1])
          for _ in range(2)]
  (first, first_hits), (second, second_hits) = runs
  assert first >= 1 and first_hits == 0
  assert second == first and second_hits == second
