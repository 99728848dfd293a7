"""Test-run setup: one persistent XLA compilation cache shared by this run's xdist workers.

Many tests compile the same programs (the tiny model's prefill / decode, the interpreted kernels) in different
files, and compiling dominates the CPU suite's time. The cache directory is a fresh temporary one per run, created by
the controlling process before the workers start (they inherit it through the environment) and removed at the end,
so nothing carries over between runs and every run starts cold."""

import os
import shutil
import tempfile

_ENV = "DSV4_TEST_JAX_CACHE"


def pytest_configure(config):
    if not hasattr(config, "workerinput") and _ENV not in os.environ:   # the controller (or a run without xdist)
        os.environ[_ENV] = tempfile.mkdtemp(prefix="dsv4_jax_cache_")
        config._dsv4_jax_cache_owner = True
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ[_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if getattr(config, "_dsv4_jax_cache_owner", False):
        shutil.rmtree(os.environ.pop(_ENV), ignore_errors=True)
