"""Pallas kernels of dsv4-jax. One package per op: `reference.py` (plain jnp, the contract), the GPU and TPU
implementations, and a dispatcher in the package's `__init__` with the reference's signature."""
