"""Shared-memory wavefronts of the Mosaic attention kernel's FP8 conversion, per chunk order (CPU, no GPU needed).

    PYTHONPATH=. python benchmarks/fp8_conversion_banks.py

The FP8 path converts staged e4m3 rows into the bf16 tile wgmma reads: each thread loads a 16-byte chunk of a
staged row (rows NOPE_STRIDE = 512 B apart) and stores 2 x 16 B of bf16 into the swizzled tile. Shared memory
serves 16-byte accesses 8 threads (a phase) at a time, in one wavefront when the 8 addresses fall into 8
different 16-byte slots of a 128-byte bank row; k threads in one slot take k wavefronts. This model mirrors the
kernel's addressing (`gpu_mosaic._build`: `chunk_coords`, `store16`, `copy_rope`) and prints the mean wavefronts
per phase for each conversion path, row-major ("rows") against "diagonal". Session 25 found the row-major stores
conflicting 3.7-way in the tile ring (64 B swizzle) and 2-way in the consumers' 128 B-swizzled tile; the diagonal
order serves every store phase in one wavefront, which took the converter's step from ~3700 to ~3190 cycles on
the H200.
"""

from __future__ import annotations

import numpy as np

NOPE_STRIDE, ROPE_BYTES, D = 512, 128, 512


def chunk_coords(v, ncb, bk, order):
    """(row, chunk) of chunks v of a [bk, ncb] grid, as the kernel's chunk_coords."""
    if order == "rows":
        return v // ncb, v % ncb
    i, g = v % 8, v // 8
    r = (g % (bk // 8)) * 8 + i
    cb = g // (bk // 8) + i
    return r, (cb % ncb if ncb < 8 else np.where(cb >= ncb, cb - ncb, cb))


def tile_offset(r, cc, swz):
    """Byte offset of bf16 columns 8 cc .. 8 cc + 7 of row r in the (8, swz / 2)-tiled, swz-swizzled tile."""
    per, pieces = swz // 16, D // (swz // 2)
    p, j = cc // per, cc % per
    pattern = r % 8 if swz == 128 else (r % 8) // 2
    return ((r // 8) * pieces + p) * 8 * swz + (r % 8) * swz + (j ^ pattern) * 16


def wavefronts(offsets):
    """Mean wavefronts per 8-thread phase of 16-byte accesses at these byte offsets (in thread order)."""
    waves = []
    for ph in range(0, len(offsets), 8):
        slots = {}
        for a in set(int(x) for x in offsets[ph:ph + 8]):
            slots[(a // 16) % 8] = slots.get((a // 16) % 8, 0) + 1
        waves.append(max(slots.values()))
    return float(np.mean(waves))


# (name, block_k, swizzle, chunks per row, first chunk): the conversion paths of the kernel
PATHS = [("tile ring (producer / converter), bk 32", 32, 64, 28, 0),
         ("consumer 0's half (split_d), bk 64", 64, 128, 16, 0),
         ("consumer 1's half (split_d), bk 64", 64, 128, 12, 16),
         ("both consumers (no split_d), bk 64", 64, 128, 28, 0)]


def table():
    rows = []
    for name, bk, swz, ncb, cb0 in PATHS:
        for order in ("rows", "diagonal"):
            v = np.arange(bk * ncb)
            r, cb = chunk_coords(v, ncb, bk, order)
            assert len(set(zip(r.tolist(), cb.tolist()))) == bk * ncb and r.max() < bk   # a bijection
            cb = cb + cb0
            store = max(wavefronts(tile_offset(r, 2 * cb + h, swz)) for h in (0, 1))
            load = wavefronts(r * NOPE_STRIDE + cb * 16)
            rows.append((name, order, load, store))
        # the rope part (8 chunks of 8 bf16 per row, copied): the kernel takes the diagonal order under the 64 B
        # swizzle only (under 128 B row-major is already conflict-free and the diagonal would not be)
        v = np.arange(bk * 8)
        for order in ("rows", "diagonal") if swz == 64 else ("rows",):
            r, ch = chunk_coords(v, 8, bk, order)
            rows.append((name + ", rope", order, wavefronts(r * ROPE_BYTES + ch * 16),
                         wavefronts(tile_offset(r, 56 + ch, swz))))
    return rows


def main():
    print(f"{'conversion path':48s} {'order':9s} {'load':>6s} {'store':>6s}   (wavefronts per 8-thread phase)")
    for name, order, load, store in table():
        print(f"{name:48s} {order:9s} {load:6.2f} {store:6.2f}")


if __name__ == "__main__":
    main()
