"""Probe: how fast can a Pallas Mosaic GPU warpgroup gather KV rows into shared memory with per-row bulk copies?

    PYTHONPATH=. python benchmarks/tma_row_gather_probe.py

The warp-specialised attention design (benchmarks/NOTES_sparse_attention.md, session 8) needs a producer warpgroup
that gathers 64 rows x 1 KB per block into the 128 B-swizzled tile the tensor cores read. Hopper has no TMA gather,
and a row of that tile is 8 separate 128 B pieces, so each block is 512 bulk copies; in Pallas every
`copy_gmem_to_smem` also makes all 128 threads of the warpgroup arrive on the barrier. This kernel measures only that
producer: one CTA per SM, `blocks` blocks of `rows` random rows each, copied as pieces of `piece` bf16 elements into
a 2-slot ring (no consumer work), and reports the achieved gather bandwidth next to the copy-bandwidth ceiling.
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from benchmarks.timing import measure_ceilings, wall_net

D = 512
N_SM = 132
REPEAT = 17


def gather_kernel(idx_ref, pool_ref, out_ref, ring, idx_smem, idx_bar, bar, *, rows, blocks, piece, repeat):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    c = lax.axis_index("cta")
    for c0 in range(0, rows * blocks, 256):
        plgpu.copy_gmem_to_smem(idx_ref.at[c, pl.ds(c0, 256)], idx_smem.at[pl.ds(c0, 256)], idx_bar)
    plgpu.barrier_wait(idx_bar)

    def block(j, carry):
        slot = lax.rem(j, 2)

        @pl.when(j >= 2)
        def _():
            plgpu.barrier_wait(bar.at[slot])  # the slot's previous copies landed

        @pl.loop(0, rows)
        def _(r):
            row = idx_smem[lax.rem(j, blocks) * rows + r]
            for p in range(D // piece):
                plgpu.copy_gmem_to_smem(pool_ref.at[pl.ds(row, 1), pl.ds(p * piece, piece)],
                                        ring.at[slot, pl.ds(r * (D // piece) + p, 1)], bar.at[slot])
        return carry

    lax.fori_loop(0, blocks * repeat, block, 0)
    for s in range(2):
        plgpu.barrier_wait(bar.at[s])
    out_ref[c] = ring[0, 0, 0].astype(jnp.float32) + ring[1, 0, 0].astype(jnp.float32)  # keep the copies live


def make(rows, blocks, piece, n_pool, repeat=1):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    k = functools.partial(gather_kernel, rows=rows, blocks=blocks, piece=piece, repeat=repeat)
    n_pieces = rows * (D // piece)
    return plgpu.kernel(
        k, out_type=jax.ShapeDtypeStruct((N_SM,), jnp.float32),
        scratch_types=[plgpu.SMEM((2, n_pieces, piece), jnp.bfloat16), plgpu.SMEM((rows * blocks,), jnp.int32),
                       plgpu.Barrier(num_arrivals=-(-rows * blocks // 256)),
                       plgpu.Barrier(num_arrivals=n_pieces, num_barriers=2)],
        grid=(N_SM,), grid_names=("cta",))


def main():
    rng = np.random.default_rng(0)
    n_pool = 1 << 20  # 1 GiB of bf16 rows: gathers miss L2
    pool = jax.random.normal(jax.random.key(0), (n_pool, D), jnp.bfloat16)
    ceil = measure_ceilings(quick=True)
    print("ceilings", ceil, flush=True)
    res = []
    for rows, blocks, piece in [(64, 32, 64), (64, 32, 256)]:
        idx = jnp.asarray(rng.integers(0, n_pool, (N_SM, rows * blocks)).astype(np.int32))
        try:
            t, t1 = wall_net(lambda n: jax.jit(make(rows, blocks, piece, n_pool, n)), idx, pool, n1=1, n2=REPEAT)
            nbytes = N_SM * rows * blocks * D * 2
            r = dict(rows=rows, blocks=blocks, piece_elems=piece, copies_per_block=rows * D // piece,
                     us_per_pass=t * 1e6, wall_1pass_us=t1 * 1e6,
                     GBps=nbytes / t / 1e9, frac_of_copy_bw=nbytes / t / 1e9 / ceil["copy_GBps"],
                     us_per_block=t * 1e6 / blocks)
        except Exception as e:
            r = dict(rows=rows, blocks=blocks, piece_elems=piece, error=f"{type(e).__name__}: {str(e)[:500]}")
        print(r, flush=True)
        res.append(r)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(dict(ceilings=ceil, results=res), f, indent=1)


if __name__ == "__main__":
    main()
