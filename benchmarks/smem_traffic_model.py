"""Shared-memory traffic of one decode step of the Mosaic attention kernel, against the measured phase profiles.

    python benchmarks/smem_traffic_model.py [--smem-bytes-per-clock 128]

Why (session 70). Every stage of FP8 decode under consumers="asym" takes about the same ~2000-2500 cycles a 32-row
step (H100 profile h100_s69r1_f16_mprof.log: producer issue 1990, converter 2142, scorer 938 + 654 + 593), and
removing the conversion's arithmetic altogether (_diag="no_convert") makes the kernel only ~10% faster. One
resource all of them share is the SM's shared memory, which moves ~128 B a clock (LSU and the tensor cores' operand
reads alike). A wgmma with both operands in shared memory (SS) reads A (q: 64 x 16 x 2 B = 2 KB) and B (N x 16 x 2 B)
for each k16 step; at the tensor cores' peak (4096 FLOP a clock an SM, 64 x N x 16 x 2 FLOP) that is
(2048 + 32 N) / (N / 2) B a clock: 192 B/clock at N = 32 (the converter's 32-row tiles), 128 at N = 64 (bf16's
64-row steps). So a 32-row step's score chain is bound by shared memory, not by the tensor cores, and re-reads all
of q (64 KB) for every 32 rows.

This counts, per step, the bytes each actor moves through shared memory and prints the step's lower bound at the
given bandwidth next to the profiled phase times. A model, not a measurement: it shows where the bytes are, and
that the FP8 step's bytes bound it at ~1600 cycles an SM, well above the tensor cores' ~1024.

Session 72: the q columns the scorer holds in registers (asym_q_regs) and the uneven P.V split are counted, and
session 71's defaults are a row. Their step moves ~180 KB, a 1444-cycle bound at 128 B a clock, against ~2400
cycles each warpgroup takes a 32-row step in that profile (3034 with the span's fixed costs): shared memory is then at
most ~60% busy on average, so bandwidth is not what bounds the step. (Session 72 read the rest as the stages'
hand-offs through two tile slots; session 73 timed a third slot on an H100, group s72, and the step did not get
faster: each warpgroup's own step time bounds it.)
"""

from __future__ import annotations

import argparse

D = 512            # head dim (448 nope + 64 rope)
H = 64             # heads a CTA (one query token)
NOPE, ROPE, SCALES = 448, 64, 8
TENSOR_FLOP_PER_CLOCK = 4096   # dense bf16 / f16 wgmma, one SM (H100 / H200)


def wgmma_ss_bytes(m, n, k, a_bytes_per_el=2, b_bytes_per_el=2):
    """Shared-memory bytes one wgmma m x n x k reads with both operands in shared memory."""
    return m * k * a_bytes_per_el + n * k * b_bytes_per_el


def asym_step(rows, fp8, scorer_cols=D // 2, q_reg_cols=0):
    """Bytes through shared memory in one step of `rows` gathered rows under consumers="asym" (the scorer scores
    over all of d, the helper and the scorer split P.V's output columns), by actor. q_reg_cols: q's first columns
    held in the scorer's registers (asym_q_regs: the A operand of those wgmma comes from registers). -> dict name ->
    bytes."""
    t = {}
    # the scorer's S = q K^T: d / 16 wgmma of m64 n=rows k16, q (but its columns in registers) and K from shared memory
    t["scores: q (A operand, re-read every step)"] = ((D - q_reg_cols) // 16) * H * 16 * 2
    t["scores: K (B operand)"] = (D // 16) * rows * 16 * 2
    helper_cols = D - scorer_cols
    # P.V: V = K's rows (B operand, rows x cols); the scorer's P is in registers (RS), the helper's in shared memory,
    # re-read for each 128-column accumulator (m64n128 pieces under the converter's 512 threads)
    t["P.V: V, scorer's columns"] = rows * scorer_cols * 2
    t["P.V: V, helper's columns"] = rows * helper_cols * 2
    t["P.V: P (helper's A operand) + its store"] = H * rows * 2 * (max(1, helper_cols // 128) + 1)
    if fp8:
        staged = rows * (NOPE + 2 * ROPE + SCALES)
        t["staging: bulk copies' writes"] = staged
        t["converter: staged reads"] = staged
        t["converter: bf16 tile writes"] = rows * D * 2
    else:
        t["ring: bulk copies' writes"] = rows * D * 2
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smem-bytes-per-clock", type=float, default=128.0)
    args = ap.parse_args()
    bw = args.smem_bytes_per_clock
    print(f"shared memory {bw:.0f} B/clock an SM; tensor cores {TENSOR_FLOP_PER_CLOCK} FLOP/clock an SM\n")
    for n in (32, 64):
        need = wgmma_ss_bytes(64, n, 16) / (64 * n * 16 * 2 / TENSOR_FLOP_PER_CLOCK)
        print(f"wgmma m64n{n}k16, both operands in shared memory: {need:.0f} B/clock at the tensor cores' peak "
              f"({'over' if need > bw else 'within'} {bw:.0f})")
    # measured (cycles a step, H100): FP8 = h100_s69r1_f16_mprof.log, case csa128_fp8_asym_f16_owned (32-row steps);
    # bf16 = h100_s65r2_mprof.log, case csa128_asym (64-row steps)
    # session 71's FP8 defaults (f16 + owned, bulk copies, asym_scorer_cols=128, asym_q_regs=256): h100_s71r1_mprof.log
    measured = {   # the score chain a step, and the consumers' span / steps
        ("FP8, converter's 32-row tiles (session 69: f16 + owned)", 32, True, D // 2, 0): dict(scores=938,
                                                                                            step=65142 / 20),
        ("FP8, session 71's defaults (scorer cols 128, q cols 256 in registers)", 32, True, 128, 256):
            dict(scores=840, step=60688 / 20),
        ("bf16, 64-row ring", 64, False, D // 2, 0): dict(scores=1225, step=69809 / 10),
    }
    for (name, rows, fp8, scorer_cols, q_reg_cols), meas in measured.items():
        t = asym_step(rows, fp8, scorer_cols, q_reg_cols)
        total = sum(t.values())
        tensor = (H * rows * D * 2 * 2) / TENSOR_FLOP_PER_CLOCK   # S and P.V, all of d
        sc = (t["scores: q (A operand, re-read every step)"] + t["scores: K (B operand)"]) / bw
        print(f"\n== {name}: {rows} rows a step")
        for k, v in t.items():
            print(f"  {k:44s} {v / 1024:7.1f} KB  {v / bw:6.0f} clocks")
        print(f"  {'total':44s} {total / 1024:7.1f} KB  {total / bw:6.0f} clocks (the step's shared-memory bound)")
        print(f"  tensor work (S + P.V) at peak: {tensor:.0f} clocks; the score chain alone: {sc:.0f} clocks of "
              f"shared memory vs {(H * rows * D * 2) / TENSOR_FLOP_PER_CLOCK:.0f} of tensor work "
              f"(measured {meas['scores']})")
        per_row = total / rows
        print(f"  per gathered row: {per_row:.0f} B of shared memory; measured step {meas['step']:.0f} clocks "
              f"(consumers' span / steps, fixed costs included) = {total / meas['step']:.0f} B/clock on average")


if __name__ == "__main__":
    main()
