"""Pallas kernels for GLM-5 (lightning indexer, sparse MLA attention), each beside a jnp reference.

This package imports only jax. The kernels arrive with the DSA-kernels work; until then the
model's DSA path is the plain-jnp reference in `glm5_jax.attention.dsa`.
"""
