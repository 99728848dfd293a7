"""Probe, raw Mosaic GPU: the row-gather producer with ONE barrier arrival per block (not one per copy).

    PYTHONPATH=. python benchmarks/tma_row_gather_raw.py [OUT.json]

Companion of benchmarks/tma_row_gather_probe.py (the same gather through Pallas' `copy_gmem_to_smem`, where every
copy also makes the warpgroup's 128 threads arrive on the barrier). Here the kernel is written against
`jax.experimental.mosaic.gpu` directly: per block of `rows` random 1 KB rows, one thread (or lane 0 of each of the 4
warps) issues the bulk copies with `arrive=False` -- each row as 8 pieces of 64 bf16 (128 B) written into its row of
the (8, 64)-tiled, 128 B-swizzled tile the tensor cores read -- and a single `arrive_expect_tx` covers the block.
One CTA of one warpgroup per SM, a 2-slot ring, no consumer work: the bandwidth this reaches is the most a
warp-specialised attention kernel built this way could feed its tensor cores.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import measure_ceilings, wall_net

D = 512
N_SM = 132
REPEAT = 17


def make(rows: int, blocks: int, issuers: int, mode: str = "tma", slots: int = 2, n_pool: int = 1 << 20,
         repeat: int = 1):
    """mode "tma": bulk copies of 128 B pieces (issuers = 1 thread or lane 0 of 4 warps); "cpasync": all 128 threads
    gather 16 B each with `cp.async` (the load/store units' path, as FlashMLA's Hopper kernels), writing the
    swizzled addresses themselves, and signal the slot's barrier with `cp.async.mbarrier.arrive.noinc`."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref, nvvm

    n_idx = rows * blocks

    def body(ctx, idx_gmem, pool_gmem, out_gmem, scratch):
        ring, idx_smem, idx_bar, bars = scratch
        index = ir.IndexType.get()
        c = lambda v: arith.constant(index, v)
        cta = gpu.block_id(gpu.Dimension.x)
        one = mu.single_thread_predicate(mu.ThreadSubset.WARPGROUP)
        for c0 in range(0, n_idx, 256):
            ctx.async_copy(src_ref=idx_gmem, dst_ref=mu.memref_slice(idx_smem, mu.ds(c0, 256)),
                           gmem_slice=(cta, mu.ds(c0, 256)), barrier=idx_bar, arrive=False, predicate=one)
        idx_bar.arrive_expect_tx(n_idx * 4, predicate=one)
        idx_bar.wait()
        if issuers == 1:
            pred, first, step = one, c(0), rows
        else:  # lane 0 of each warp issues the rows r = warp + 4 k
            pred = mu.single_thread_predicate(mu.ThreadSubset.WARP)
            first = arith.remui(arith.index_cast(index, mu.warp_idx(sync=False)), c(4))
            step = rows // 4

        if mode == "cpasync":
            i32 = ir.IntegerType.get_signless(32)
            i8 = ir.IntegerType.get_signless(8)
            tid = arith.index_cast(index, mu.thread_idx())
            ring_ptr = mu.memref_ptr(ring)
            pool_ptr = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mu.memref_ptr(pool_gmem))
            chunks_per_thread = rows * D * 2 // 16 // 128

            @mu.fori(c(blocks * repeat), None)
            def _(j, _carry):
                slot = arith.remui(j, c(slots))
                bar = bars[slot]
                with mu.when(arith.cmpi(arith.CmpIPredicate.uge, j, c(slots))):
                    bar.wait()
                for k in range(chunks_per_thread):
                    chunk = arith.addi(c(k * 128), tid)
                    row = arith.shrui(chunk, c(6))          # 64 16-byte chunks per 1 KB row
                    c16 = arith.andi(chunk, c(63))
                    src_row = arith.index_cast(index, memref.load(idx_smem, [arith.addi(arith.muli(arith.remui(j, c(blocks)), c(rows)), row)]))
                    src_off = arith.addi(arith.muli(src_row, c(D * 2)), arith.muli(c16, c(16)))
                    r8 = arith.andi(row, c(7))
                    dst_off = arith.addi(
                        arith.addi(arith.muli(slot, c(rows * D * 2)),
                                   arith.muli(arith.addi(arith.muli(arith.shrui(row, c(3)), c(D // 64)),
                                                         arith.shrui(c16, c(3))), c(1024))),
                        arith.addi(arith.muli(r8, c(128)), arith.muli(arith.xori(arith.andi(c16, c(7)), r8), c(16))))
                    to_i32 = lambda v: arith.index_cast(i32, v)
                    dst = mu.getelementptr(ring_ptr, [to_i32(dst_off)], i8)
                    src = mu.getelementptr(pool_ptr, [arith.index_cast(ir.IntegerType.get_signless(64), src_off)], i8)
                    nvvm.cp_async_shared_global(dst, src, 16, nvvm.LoadCacheModifierKind.CG)
                nvvm.cp_async_mbarrier_arrive(bar.get_ptr(), noinc=True)
                return _carry

            for s in range(slots):
                bars[c(s)].wait()
            with mu.single_thread():
                memref.store(arith.constant(ir.F32Type.get(), 0.0), out_gmem, [cta])
            return

        @mu.fori(c(blocks * repeat), None)
        def _(j, _carry):
            slot = arith.remui(j, c(slots))
            bar = bars[slot]
            with mu.when(arith.cmpi(arith.CmpIPredicate.uge, j, c(slots))):
                bar.wait()  # this slot's previous copies landed
            bar.arrive_expect_tx(rows * D * 2, predicate=one)

            @mu.fori(c(step), None)
            def _(k, _carry2):
                r = arith.addi(first, arith.muli(k, c(rows // step)))
                row = memref.load(idx_smem, [arith.addi(arith.muli(arith.remui(j, c(blocks)), c(rows)), r)])
                row = arith.index_cast(index, row)
                r_hi, r_lo = arith.divui(r, c(8)), arith.remui(r, c(8))
                for p in range(D // 64):
                    dst = mu.memref_slice(ring, (slot, r_hi, p, mu.ds(r_lo, 1)))
                    ctx.async_copy(src_ref=pool_gmem, dst_ref=dst, gmem_slice=(mu.ds(row, 1), mu.ds(p * 64, 64)),
                                   swizzle=128, barrier=bar, arrive=False, predicate=pred)
                return _carry2

            return _carry

        for s in range(slots):
            bars[c(s)].wait()
        with mu.single_thread():
            memref.store(arith.constant(ir.F32Type.get(), 0.0), out_gmem, [cta])

    smem = (jax.ShapeDtypeStruct((slots, rows // 8, D // 64, 8, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((n_idx,), jnp.int32),
            mgpu.TMABarrier(1), mgpu.Barrier(128, slots) if mode == "cpasync" else mgpu.TMABarrier(slots))
    from jax._src.interpreters import mlir as jax_mlir

    with jax_mlir.make_ir_context(), ir.Location.unknown():  # the kernel is built as an MLIR module right here
        return mgpu.as_gpu_kernel(
            body, grid=(N_SM, 1, 1), block=(128, 1, 1),
            in_shape=(jax.ShapeDtypeStruct((N_SM, n_idx), jnp.int32),
                      jax.ShapeDtypeStruct((n_pool, D), jnp.bfloat16)),
            out_shape=jax.ShapeDtypeStruct((N_SM,), jnp.float32), smem_scratch_shape=smem)


def main():
    rng = np.random.default_rng(0)
    ceil = measure_ceilings(quick=True)
    print("ceilings", ceil, flush=True)
    res = []
    pools = {}
    # (rows per block, blocks, issuers, mode, ring slots, pool rows): 1 << 18 rows = 256 MiB (the attention
    # benchmark's pools), 1 << 20 = 1 GiB
    for rows, blocks, issuers, mode, slots, n_pool in [
            (64, 32, 4, "tma", 2, 1 << 20), (64, 32, 0, "cpasync", 2, 1 << 20),
            (64, 32, 4, "tma", 2, 1 << 18), (64, 32, 0, "cpasync", 2, 1 << 18),
            (64, 32, 4, "tma", 3, 1 << 18), (64, 32, 0, "cpasync", 3, 1 << 18),
            (32, 64, 4, "tma", 6, 1 << 18), (32, 64, 0, "cpasync", 6, 1 << 18)]:
        if n_pool not in pools:
            pools[n_pool] = jax.random.normal(jax.random.key(0), (n_pool, D), jnp.bfloat16)
        idx = jnp.asarray(rng.integers(0, n_pool, (N_SM, rows * blocks)).astype(np.int32))
        cfg = dict(rows=rows, blocks=blocks, issuers=issuers, mode=mode, slots=slots, pool_MiB=n_pool * D * 2 >> 20)
        try:
            # per pass, net of dispatch; the per-CTA rows (2 MiB) x 132 CTAs exceed L2, so every pass reads HBM
            t, t1 = wall_net(lambda n: jax.jit(make(rows, blocks, issuers, mode, slots, n_pool, n)), idx,
                             pools[n_pool], n1=1, n2=REPEAT)
            nbytes = N_SM * rows * blocks * D * 2
            r = dict(cfg, us_per_pass=t * 1e6, wall_1pass_us=t1 * 1e6, GBps=nbytes / t / 1e9,
                     frac_of_copy_bw=nbytes / t / 1e9 / ceil["copy_GBps"], us_per_block=t * 1e6 / blocks)
        except Exception as e:
            r = dict(cfg, error=f"{type(e).__name__}: {str(e)[:600]}")
        print(r, flush=True)
        res.append(r)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(dict(ceilings=ceil, results=res), f, indent=1)


if __name__ == "__main__":
    main()
