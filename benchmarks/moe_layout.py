"""The routed experts' grouped matmuls by weight layout: does XLA transpose the expert weights at every call?

    PYTHONPATH=. python benchmarks/moe_layout.py [--experts 8] [--batches 16,64] [--hlo DIR] [--out FILE.json]
    PYTHONPATH=. python benchmarks/moe_layout.py --lower-only      # CPU: every variant lowers, nothing timed

Why (session 44, H100, `decode_breakdown.py --kernels`, 4-layer V4-Flash slice with 8 experts, batch 16 x 32K): the
decode step's largest kernel was `wrapped_transpose_1`, 8 launches a step (2 a layer), 726.5 us of the step's
2948.7, ~91 us each: about one [8, 2048, 4096] bf16 expert matrix read and written (268 MB) per launch. The
model then stored routed experts as checkpoints do, w1 / w3 [E, out=I, in=D] and w2 [E, D, I], and contracted x
with their last dim; XLA's GPU ragged dot wants the contracting dim first and transposed the whole weight stack at
every call. This times the same routed-expert forward (the model's math: sort the token x expert pairs by expert,
gather, w1 and w3, clamped SwiGLU, w2, weight, scatter-add) with each layout:

  out_in  w [E, out, in]: ragged_dot_general contracting x's dim 1 with w's dim 2 (the model up to session 44)
  in_out  w [E, in, out]: ragged_dot's own layout (x's dim 1 with w's dim 1); the model since session 45, whose
          loader turns each expert around once
  in_out_pallas  the same weights on the grouped-matmul kernel (`pallas_kernels.grouped_matmul`, session 45), which
          reads only the experts that have rows: XLA's GPU ragged dot is a dense matmul over all E experts (lhs
          masked to [rows, E, in]), E x the FLOPs and every expert's weights, which `--experts 256` (V4-Flash's
          count) shows
  fp4_pallas  the checkpoint's FP4 expert bytes (`grouped_matmul.Fp4Weights`, random e2m1 + e8m0 scales) read as
          they are by the FP4-weight kernel (`grouped_matmul.fp4`, sessions 46-48): 4.25 bits a weight;
          its ratio is against the FP4 bytes' floor (`fp4_floor_us`); option sets as variants by --fp4-configs
  fp4     the same bytes dequantized by XLA, then its ragged dot (the FP4 contract's reference)

Session 45 (H100, `results/h100_s45r1_moe*`): out_in 386.7 us at B = 16 (2.62x the floor; two 91 us transposes
among its kernels), in_out 192.9 (1.31x, none); B = 64: 559.6 vs 266.9. Session 46 (H100, `--experts 256`,
`results/h100_s46r1_moe*`): in_out 4577.5 us at B = 16 vs 1446.9 on the kernel (0.96x), B = 64 6607.4 vs 3315.0.
Session 47-48 (H100, 256 experts): FP4 1099.0 us at B = 16 and 2520.4 at 64 (1.31-1.32x faster than in_out_pallas,
2.7x its FP4 floor). Prefill-sized batches (`--batches 512,2048 --variants in_out_pallas,fp4_pallas`, session 48,
`results/h100_s48r3_moe_prefill*`, `h100_s48r4_*`; XLA's ragged dot cannot run there, its masked [B k, E, D]
operand is 51 GB at B = 4096 with 256 experts), B = 512 / 2048 tokens: in_out_pallas 4833.6 / 6918.3 us; FP4 with
32-row tiles (its default since) 5008.5 / 10347.5, with 64-row tiles 6467.6-6488.7 / 9819.8-10205.2 (two H100s).

Per variant and batch (B x top-k token rows; decode rows are B x 1 tokens): us per call net of dispatch (dependent
calls in one jitted scan, `timing.chain_net`), the floor (every active expert's three matrices read once at the
measured copy bandwidth; at B >= 2 with 8 experts every expert is active; or, for prefill-sized B, the 6 B k D I
FLOPs at the measured bf16 rate, whichever is longer), the ratio, TFLOP/s, the kernels one call launches
(CUPTI, largest first), and each variant's max relative error against a per-expert dense jnp reference. --hlo DIR
writes each variant's optimized HLO, so the transposes (or their absence) can be read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.timing import chain_net, cupti_kernels, measure_ceilings, parse_options  # noqa: E402
from dsv4_jax.layers.moe import _RAGGED_DN, routed_experts, swiglu  # noqa: E402

VARIANTS = ("out_in", "in_out", "in_out_pallas", "fp4", "fp4_pallas")
# the model's dims (`_RAGGED_DN`) take [E, in, out]; these take the checkpoints' [E, out, in] as they are
_OUT_IN_DN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def make_weights(seed, E, D, I, layout):
    """w1, w3, w2 bf16 in `layout`, drawn on the device (V4-Flash's 256 experts are 12.9 GB): out_in -> [E, I, D],
    [E, I, D], [E, D, I]; in_out(_pallas) -> [E, D, I], [E, D, I], [E, I, D] (the same matrices transposed, so
    every layout computes the same products)."""
    k1, k3, k2 = jax.random.split(jax.random.key(seed), 3)
    normal = jax.jit(lambda k, shape, s: (jax.random.normal(k, shape, jnp.float32) * s).astype(jnp.bfloat16),
                     static_argnums=(1, 2))
    ws = (normal(k1, (E, I, D), D ** -0.5), normal(k3, (E, I, D), D ** -0.5), normal(k2, (E, D, I), I ** -0.5))
    if layout != "out_in":
        ws = tuple(jax.jit(lambda w: jnp.swapaxes(w, 1, 2))(w) for w in ws)
    return ws


def make_fp4_weights(seed, E, D, I):
    """w1, w3 [E, D, I] and w2 [E, I, D] as `Fp4Weights` (random e2m1 bytes, e8m0 scales 2^-9 .. 2^-3, drawn on the
    device): the checkpoint's FP4 expert format, read as it is by `fp4_pallas`, dequantized by `fp4`."""
    from pallas_kernels.grouped_matmul import Fp4Weights

    keys = jax.random.split(jax.random.key(seed), 6)
    draw = jax.jit(lambda k, shape, lo, hi: jax.random.randint(k, shape, lo, hi, jnp.int32).astype(jnp.uint8),
                   static_argnums=(1, 2, 3))
    return tuple(Fp4Weights(draw(keys[2 * i], (E, N, K // 2), 0, 256), draw(keys[2 * i + 1], (E, N, K // 32), 118, 125))
                 for i, (K, N) in enumerate(((D, I), (D, I), (I, D))))


def layout_experts(x, weights, experts, w1, w3, w2, layout, limit):
    """The model's routed-expert forward (`dsv4_jax.layers.moe.routed_experts`) with the weights in `layout`
    (a `VARIANTS` name, or 'in_out_pallas[<kernel options>]')."""
    if layout == "out_in":
        return routed_experts(x, weights, experts, w1, w3, w2, limit, _OUT_IN_DN, gmm_impl="reference")
    if layout.startswith("fp4"):   # Fp4Weights: the kernel reads the bytes, the reference dequantizes them
        opts = parse_options(layout[len("fp4_pallas["):-1]) if layout.endswith("]") else {}
        return routed_experts(x, weights, experts, w1, w3, w2, limit, _RAGGED_DN,
                              gmm_impl="pallas" if layout.startswith("fp4_pallas") else "reference",
                              gmm_options=opts or None)
    if layout.startswith("in_out_pallas"):
        opts = parse_options(layout[len("in_out_pallas["):-1]) if layout.endswith("]") else {}
        return routed_experts(x, weights, experts, w1, w3, w2, limit, _RAGGED_DN, gmm_impl="pallas",
                              gmm_options=opts)
    return routed_experts(x, weights, experts, w1, w3, w2, limit, _RAGGED_DN, gmm_impl="reference")


def dense_reference(x, weights, experts, w1, w3, w2, layout, limit):
    """The same in f32 numpy, expert by expert (each used expert's matrices fetched alone, in out_in orientation)."""
    cache = {}

    def mats(e):
        if e not in cache:
            if layout.startswith("fp4"):
                from pallas_kernels.grouped_matmul.fp4 import Fp4Weights, dequantize

                ms = tuple(np.asarray(dequantize(Fp4Weights(w.packed[e:e + 1], w.scales[e:e + 1]))[0]).T
                           for w in (w1, w3, w2))
                cache[e] = ms
                return ms
            ms = tuple(np.asarray(w[e], np.float32) for w in (w1, w3, w2))
            cache[e] = ms if layout == "out_in" else tuple(m.T for m in ms)
        return cache[e]

    x = np.asarray(x, np.float32)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            m1, m3, m2 = mats(e)
            g, u = m1 @ x[t], m3 @ x[t]
            h = np.asarray(swiglu(jnp.asarray(g), jnp.asarray(u), limit))
            h = np.asarray(jnp.asarray(h).astype(jnp.bfloat16).astype(jnp.float32))
            out[t] += float(weights[t, j]) * (m2 @ h)
    return out


def case_inputs(rng, T, k, E, D):
    x = jnp.asarray(rng.standard_normal((T, D), np.float32), jnp.bfloat16)
    experts = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    weights = rng.random((T, k)).astype(np.float32)
    return x, jnp.asarray(weights / weights.sum(-1, keepdims=True)), jnp.asarray(experts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--batches", default="16,64", help="decode batch sizes (token rows)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--gmm-configs", default="", help="';'-separated kernel option sets of the grouped matmul, each "
                   "timed as a variant 'in_out_pallas[<set>]', e.g. 'block_n=64;block_k=128,num_warps=8'")
    p.add_argument("--fp4-configs", default="", help="';'-separated option sets of the FP4-weight kernel, each "
                   "timed as a variant fp4_pallas[...]")
    p.add_argument("--limit", type=float, default=10.0, help="SwiGLU clamp")
    p.add_argument("--steps", type=int, default=16, help="dependent calls per timed scan")
    p.add_argument("--hlo", default=None, help="directory for each variant's optimized HLO")
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--lower-only", action="store_true", help="lower every variant (CPU dry run), time nothing")
    p.add_argument("--check-tokens", type=int, default=4, help="rows checked against the dense reference")
    a = p.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; known: {VARIANTS}")
    variants += [f"in_out_pallas[{c}]" for c in a.gmm_configs.split(";") if c]
    variants += [f"fp4_pallas[{c}]" for c in a.fp4_configs.split(";") if c]
    E, k, D, I = a.experts, a.top_k, a.hidden, a.intermediate
    if not 0 < k <= E:
        p.error(f"--top-k must be in [1, --experts]; got {k}, {E}")
    rng = np.random.default_rng(0)
    ceil = None if a.lower_only else measure_ceilings()
    if ceil:
        print(f"ceilings: copy {ceil['copy_GBps'] / 1e3:.2f} TB/s, bf16 {ceil['bf16_TFLOPs']:.0f} TFLOP/s")
    results = dict(device=str(jax.devices()[0]), E=E, k=k, D=D, I=I, ceilings=ceil, rows=[])
    failed = 0
    weights_of = {}
    for B in (int(b) for b in a.batches.split(",")):
        x, wts, ex = case_inputs(rng, B, k, E, D)
        active = len(np.unique(np.asarray(ex)))
        w_bytes = active * 3 * D * I * 2
        fp4_bytes = active * 3 * D * I * (0.5 + 1 / 32)   # e2m1 nibbles + an e8m0 byte per 32
        flops = 3 * 2 * B * k * D * I   # the three GEMMs over the B x k token rows, each row with its own expert
        row = dict(B=B, active_experts=active, weight_MB=w_bytes / 1e6, fp4_weight_MB=fp4_bytes / 1e6,
                   GFLOP=flops / 1e9)
        if ceil:   # decode: the weight read; prefill-sized batches: the FLOPs at the measured bf16 rate
            row["floor_us"] = max(w_bytes / ceil["copy_Bps"], flops / ceil["bf16_flops"]) * 1e6
            row["fp4_floor_us"] = max(fp4_bytes / ceil["copy_Bps"], flops / ceil["bf16_flops"]) * 1e6
        for v in variants:
            orient = "out_in" if v == "out_in" else "fp4" if v.startswith("fp4") else "in_out"
            if a.lower_only and orient == "fp4":
                from pallas_kernels.grouped_matmul import Fp4Weights

                w1, w3, w2 = (Fp4Weights(jax.ShapeDtypeStruct((E, N, K // 2), jnp.uint8),
                                         jax.ShapeDtypeStruct((E, N, K // 32), jnp.uint8))
                              for K, N in ((D, I), (D, I), (I, D)))
            elif a.lower_only:   # shapes only: nothing allocated
                shapes = ((E, I, D), (E, I, D), (E, D, I)) if orient == "out_in" else ((E, D, I), (E, D, I), (E, I, D))
                w1, w3, w2 = (jax.ShapeDtypeStruct(sh, jnp.bfloat16) for sh in shapes)
            else:   # one orientation's stacks alive at a time (V4-Flash's 256 experts: 6.4 GB each)
                if orient not in weights_of:
                    weights_of.clear()
                    weights_of[orient] = (make_fp4_weights(1, E, D, I) if orient == "fp4" else
                                          make_weights(1, E, D, I, orient))
                w1, w3, w2 = weights_of[orient]
            fn = jax.jit(lambda x, wts, ex, w1, w3, w2, v=v: layout_experts(x, wts, ex, w1, w3, w2, v, a.limit))
            try:
                if a.lower_only:
                    fn.lower(x, wts, ex, w1, w3, w2)
                    row[f"{v}_lowered"] = True
                    continue
                compiled = fn.lower(x, wts, ex, w1, w3, w2).compile()
                out = compiled(x, wts, ex, w1, w3, w2)
                n = a.check_tokens
                ref = dense_reference(x[:n], np.asarray(wts[:n]), np.asarray(ex[:n]), w1, w3, w2, v, a.limit)
                got = np.asarray(out[:n])
                row[f"{v}_rel_err"] = float(np.abs(got - ref).max() / np.abs(ref).max())
                if a.hlo:
                    os.makedirs(a.hlo, exist_ok=True)
                    fname = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in f"moe_{v}_B{B}.txt")
                    with open(os.path.join(a.hlo, fname), "w") as f:
                        f.write(compiled.as_text())

                def step(xc, wts, ex, w1, w3, w2, v=v):   # the next call's x depends on this call's output
                    y = layout_experts(xc, wts, ex, w1, w3, w2, v, a.limit)
                    return (xc.astype(jnp.float32) + 1e-3 * y).astype(jnp.bfloat16)

                t = chain_net(step, x, a.steps, args=(wts, ex, w1, w3, w2))
                row[f"{v}_us"] = t * 1e6
                row[f"{v}_ratio"] = t * 1e6 / row["fp4_floor_us" if orient == "fp4" else "floor_us"]
                row[f"{v}_TFLOPs"] = flops / t / 1e12
                if jax.default_backend() == "gpu":
                    ks = cupti_kernels(fn, x, wts, ex, w1, w3, w2)
                    ks.sort(key=lambda nk: -nk[1])
                    row[f"{v}_kernels"] = [(name, round(us, 2)) for name, us in ks[:8]]
                    row[f"{v}_kernel_us"] = sum(us for _, us in ks)
            except Exception as e:   # report, keep going
                failed += 1
                row[f"{v}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        results["rows"].append(row)
        print(json.dumps(row, indent=1), flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
