"""Test-run setup: XLA:CPU compile flags, and the two test tiers.

**Compile flags.** On a machine without an NVIDIA GPU (CI, laptops) the suite runs tiny configs, so its time is
mostly XLA:CPU compiling programs (the Pallas interpreter's kernels are large programs), not running them. There:
- `--xla_backend_optimization_level=0`: two measured subsets ran 23% and 33% faster (session 11), every tolerance
  unchanged;
- `--xla_llvm_disable_expensive_passes=true` (session 35, jaxlib 0.10): the interpreted Pallas model test went from
  103 to 82 s, every tolerance unchanged. It is added only for a jaxlib whose XLA is known to have it (XLA aborts
  on an unknown flag). (`--xla_cpu_use_fusion_emitters=false` took it to 62 s, but that older emitter path emits
  invalid LLVM IR for the fp4 (int4) bitcasts: every fp4 test failed.)
On a GPU machine nothing is changed, so the GPU tests compile as users' programs do. A flag already set in XLA_FLAGS
by the caller is kept. Opt out with DSV4_TESTS_XLA_OPT=1. conftest.py is imported before any test module (and in
every xdist worker), i.e. before XLA reads XLA_FLAGS at backend start-up.

**Tiers.** Tests (or parametrized cases) marked `full`, and the cases a `core_params` mark leaves out, are the
extended sweeps: every experimental kernel knob, every shape of a kernel already covered by a representative case,
the benchmark scripts' smoke runs (README lists them). The default run (README's test command, CI) deselects them
and covers every code path with the representative cases: a clean-clone `.ci/run` took 758 s on 2 cores, install
included (session 35; 2293 s before the tiers). Session 39 took the default run's pytest time from 719 to ~445 s
(2 cores) mostly by jitting the helpers tests call eagerly (quantizers, Hadamard, the reference ops, the random
parameter init): op by op, every jnp call compiled on its own. DSV4_FULL_TESTS=1 runs everything; on a GPU
machine the full tier is on by default (DSV4_FULL_TESTS=0 turns it off).

**Failures at once.** With DSV4_INSTANT_FAILURES=1 (set by `benchmarks/run_gpu_session.sh`) a failing test's report
is printed to stderr as soon as it fails, not only in pytest's closing summary: a device call's step limit can cut
the run before that summary (session 45 lost the only message of a model test that failed once among six xdist
workers and passed alone)."""

import os

_NVIDIA = ("/dev/nvidiactl", "/dev/nvidia0")
ON_GPU_MACHINE = any(os.path.exists(p) for p in _NVIDIA)
FULL_TIER = os.environ.get("DSV4_FULL_TESTS", "1" if ON_GPU_MACHINE else "0") == "1"

_CPU_COMPILE_FLAGS = [("xla_backend_optimization_level", "0", None),
                      ("xla_llvm_disable_expensive_passes", "true", ("0.10.", "0.11."))]


def _jaxlib_version() -> str:
    try:
        from importlib.metadata import version

        return version("jaxlib")
    except Exception:  # noqa: BLE001 - no jaxlib metadata: add only the long-standing flag
        return ""


if os.environ.get("DSV4_TESTS_XLA_OPT") != "1" and not ON_GPU_MACHINE:
    flags = os.environ.get("XLA_FLAGS", "")
    jaxlib = _jaxlib_version()
    for name, value, versions in _CPU_COMPILE_FLAGS:
        if name not in flags and (versions is None or jaxlib.startswith(versions)):
            flags += f" --{name}={value}"
    os.environ["XLA_FLAGS"] = flags.strip()


def _in_full_tier_only(item) -> bool:
    """`full` marks a test or case for the full tier; `core_params(name=values)` keeps in the default tier only the
    cases whose parameter `name` (a parametrized fixture's, too) is one of `values`."""
    if item.get_closest_marker("full") is not None:
        return True
    mark = item.get_closest_marker("core_params")
    params = getattr(getattr(item, "callspec", None), "params", {})
    return mark is not None and any(name in params and params[name] not in values
                                    for name, values in mark.kwargs.items())


def pytest_collection_modifyitems(config, items):
    """Deselects the full tier unless it is on (see the module docstring); pytest reports them as deselected."""
    if FULL_TIER:
        return
    full_only = [_in_full_tier_only(it) for it in items]
    if any(full_only):
        config.hook.pytest_deselected(items=[it for it, f in zip(items, full_only) if f])
        items[:] = [it for it, f in zip(items, full_only) if not f]


def pytest_runtest_logreport(report):
    """DSV4_INSTANT_FAILURES=1: a failure's report on stderr at once, so a run killed before pytest's summary keeps
    it."""
    if (report.failed and os.environ.get("DSV4_INSTANT_FAILURES") == "1"
            and "PYTEST_XDIST_WORKER" not in os.environ):   # once: the controller prints the workers' reports
        import sys

        print(f"\n=== FAILED ({report.when}): {report.nodeid}\n{report.longreprtext}\n=== end of {report.nodeid}",
              file=sys.stderr, flush=True)
