"""Shared timing helpers for the benchmarks: median wall time, dependent-call chains, measured ceilings."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np


WARM_S = 0.05   # seconds of repeated calls before timing: the H200 idles at a 345 MHz SM clock (env.log)


def _warm(*fa, warm_s=WARM_S):
    """Call each (f, args) once (compile), then round-robin until warm_s has passed, so the timed calls find the
    clocks up and the caches in their steady state."""
    for f, a in fa:
        jax.block_until_ready(f(*a))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        for f, a in fa:
            jax.block_until_ready(f(*a))


def _timed(f, a):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*a))
    return time.perf_counter() - t0


def wall(f, *a, reps=3):
    """Median wall time (s) of f(*a), dispatch to block_until_ready; compile and warm-up (`_warm`) excluded."""
    _warm((f, a))
    return float(np.median([_timed(f, a) for _ in range(reps)]))


def wall_net(build, *args, n1: int, n2: int, reps: int = 5):
    """Seconds per unit of work net of dispatch: `build(n)` returns a function that does n units (passes, chained
    calls) in one jitted call; (wall(build(n2)) - wall(build(n1))) / (n2 - n1) cancels the 100-250 us of Python
    dispatch that one call pays. Returns (seconds per unit, wall of the n1 call)."""
    f1, f2 = build(n1), build(n2)
    _warm((f1, args), (f2, args))
    t1, t2 = [], []
    for _ in range(reps):   # interleaved, so a clock or thermal drift during the measurement hits both alike
        t1.append(_timed(f1, args))
        t2.append(_timed(f2, args))
    t1, t2 = float(np.median(t1)), float(np.median(t2))
    return (t2 - t1) / (n2 - n1), t1


def _scan_chain(step, n, unroll):
    """jit of n dependent `carry = step(carry, *args)` calls in one lax.scan, `unroll` of them per loop iteration:
    (carry, args) -> carry."""
    return jax.jit(lambda c, a: jax.lax.scan(lambda c, _: (step(c, *a), None), c, None, length=n,
                                             unroll=unroll)[0])


def _round_up(n_iter, unroll):
    unroll = max(1, int(unroll))
    return -(-n_iter // unroll) * unroll, unroll


def timed_chain(step, carry, n_iter, reps=3, unroll=1, args=()):
    """Seconds per iteration of `carry = step(carry)` run n_iter times as dependent calls in one jitted scan (so
    XLA can neither hoist nor batch them and Python dispatch is paid once). `unroll` > 1 puts that many dependent
    steps in each loop iteration, so the loop's own per-iteration cost (on the GPU a while loop's trip) is shared
    by `unroll` calls; n_iter is rounded up to a multiple of it. `args` (a tuple of arrays): the step is called as
    step(carry, *args) and they are passed to the jitted program as arguments. Large inputs must come this way: an
    array the step closes over is a constant of the compiled program (the B=64 x 1M-context indexer keys, 2.2 GB,
    crashed XLA's compiler that way, session 11)."""
    n_iter, unroll = _round_up(n_iter, unroll)
    return wall(_scan_chain(step, n_iter, unroll), carry, tuple(args), reps=reps) / n_iter


def chain_net(step, carry, n_iter, reps=5, unroll=1, args=()):
    """Seconds per iteration of `carry = step(carry, *args)` as dependent calls in one jitted scan, net of the call's
    fixed cost: (wall of a 2 n_iter scan - wall of an n_iter scan) / n_iter (`wall_net`), so neither the Python
    dispatch (100-250 us on the H200) nor the wait for the result is spread over the iterations, as `timed_chain`'s
    single wall time spreads them. What remains per iteration: the step's kernels, the gaps between them and the
    loop's own trip (shared by `unroll` steps). Arguments as `timed_chain`'s; n_iter is rounded up to a multiple of
    unroll."""
    n_iter, unroll = _round_up(n_iter, unroll)
    return wall_net(lambda n: _scan_chain(step, n, unroll), carry, tuple(args), n1=n_iter, n2=2 * n_iter,
                    reps=reps)[0]


def measure_ceilings(quick=False):
    """Copy bandwidth (read + write, 20 dependent passes over 1 GiB in one call) and bf16 matmul rate (10 chained
    products of 8192^3). Returns copy_Bps / bf16_flops and the same as copy_GBps / bf16_TFLOPs. `quick` is accepted
    and ignored: its smaller sizes (256 MiB copy, 4096^3 products) measured 3.36-3.54 TB/s and 577-620 TFLOP/s on
    the H200 (session 5's --quick indexer / compressor runs) against 3.83-3.88 TB/s and ~718 TFLOP/s at full size,
    so those floors were 8-15% too long and their ratios too kind (fixed in session 6)."""
    cpu = jax.default_backend() == "cpu"   # CPU smoke runs: small sizes (no accelerator ceiling to measure)
    n = 1 << (22 if cpu else 28)
    x = jnp.arange(n, dtype=jnp.float32)
    f = jax.jit(lambda a: jax.lax.fori_loop(0, 20, lambda i, a: a * 1.0001 + 1.0, a))
    bw = 20 * 2 * n * 4 / wall(f, x)
    del x
    m = 512 if cpu else 8192
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16) * (1.0 / 90.0)
    g = jax.jit(lambda a, b: jax.lax.fori_loop(0, 10, lambda i, a: (a @ b).astype(jnp.bfloat16), a))
    fl = 10 * 2 * m ** 3 / wall(g, a, b)
    return dict(copy_Bps=bw, bf16_flops=fl, copy_GBps=bw / 1e9, bf16_TFLOPs=fl / 1e12)


def record_case(results, name, path, measure, err_chars=800):
    """results[name] = measure(), or the error it raised (printed): one case's failure keeps the others. The whole
    dict is rewritten to `path` (JSON) after every case, so a step cut by its time limit keeps what it measured."""
    try:
        res = measure()
    except Exception as e:
        res = dict(error=f"{type(e).__name__}: {str(e)[:err_chars]}")
        print(f"== {name}: {res['error']}", flush=True)
    results[name] = res
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def cupti_kernels(f, *args):
    """The kernels one call of f(*args) launches, [(name, us)] in launch order, timed by CUPTI (Mosaic GPU's
    `profiler.measure`; needs a GPU). f is called once first, so compilation is not in the list."""
    from jax.experimental.mosaic.gpu import profiler as mgpu_profiler

    jax.block_until_ready(f(*args))
    _, timings = mgpu_profiler.measure(f, aggregate=False)(*args)
    return [(name, ms * 1e3) for name, ms in timings]


def parse_options(spec: str) -> dict:
    """'block_t=128,num_warps=8,precision=bf16' -> {'block_t': 128, 'num_warps': 8, 'precision': 'bf16'} (a
    benchmark's kernel-option set on its command line)."""
    out = {}
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        if not value:
            raise ValueError(f"config item {item!r} is not name=value")
        out[name.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return out
