"""Test-run setup. On a machine without an NVIDIA GPU (CI, laptops), XLA compiles at backend optimization level 0.

The CPU suite runs tiny configs, so its time is mostly XLA:CPU compiling programs, not running them. At level 0,
two measured subsets ran 23% and 33% faster (session 11: tests/test_indexer_kernels.py with the pallas model test,
and tests/test_cache.py with tests/test_model_parity.py), with every tolerance unchanged. On a GPU machine nothing
is changed, so the GPU tests compile as users' programs do. XLA_FLAGS already set by the caller are kept; the level
is only added if they do not set one. Opt out with DSV4_TESTS_XLA_OPT=1. conftest.py is imported before any test
module (and in every xdist worker), i.e. before XLA reads XLA_FLAGS at backend start-up."""

import os

_NVIDIA = ("/dev/nvidiactl", "/dev/nvidia0")

if os.environ.get("DSV4_TESTS_XLA_OPT") != "1" and not any(os.path.exists(p) for p in _NVIDIA):
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()
