"""Benchmark of the lightning-indexer top-k (Pallas GPU scores kernel + top-k vs the XLA reference), V4-Flash shapes
(64 index heads x 128, index_topk 512).

    PYTHONPATH=. python benchmarks/indexer.py --out DIR [--quick]

Decode: one query per sequence against its whole key cache at 8K / 128K / 1M context (T = ctx / 4 compressed keys),
batch 1 and 64, key formats bf16 / fp8 (132 B) / fp4 (68 B). Prefill: a 1024-query chunk at 128K context (bf16 & fp4).
Per case: time per call (us) as dependent calls inside one jitted lax.scan (q_{i+1} = q_i + 0 x picks_i's first
entry, one small fusion), net of the call's dispatch (--timing net, the default since session 41: wall of 2n calls
less wall of n, over n), then on an "own" line less the "harness" variant (that dependency pass and the loop's trip
alone; XLA may fuse that pass into a pipeline's first fusion, so an "own" figure can be up to one small kernel too
kind: `benchmarks/indexer_kernels.py` lists the kernels), the floor
max(bytes / copy BW, FLOPs / bf16 rate) with bytes = keys read once + q read + picks written and FLOPs = 2*H*dI per
(query, visible key), the ratio to it, and the XLA reference in the same run. Variants: pallas (scores kernel + the
default top-k, "threshold"), pallas_lax / _blockwise / _radix / _radix4 / _grouped / _threshold_rank / _threshold_select /
_threshold_set / _auto_set (other top-k methods; _set returns the picks as an index set; auto_set is the model's), pallas_bf16ops / scores_bf16ops (fp8 / fp4 keys through bf16 operands: the fp8 default before session 4,
whose call 3 measured the f16 default as "scores_f16"), pallas_f16ops / scores_f16ops (fp8 / fp4 keys through f16
operands: fp8's default; for fp4 the bit-trick nibble decode, not the default yet), pallas_fp8ops / pallas_fp8ops_set /
scores_fp8ops (fp8 tensor-core operands, session 10), pallas_fp4asm / pallas_fp4asm_set / scores_fp4asm (fp4 keys
decoded by packed inline PTX, session 12, the fp4 default since session 13; fp4 cases only), pallas_fp4op /
pallas_fp4op_set / scores_fp4op (fp4 group scales on the f16 key operands, session 13; fp4 cases only), scores_only / scores_bt128 /
scores_fp4reshape (the scores kernel alone and its knobs: top-k cost = difference), scores_mosaic / pallas_mosaic /
pallas_mosaic_set (the Mosaic GPU kernel: fp8 keys since session 20, bf16 keys since session 27; fp8 and bf16 cases
only; --scores-configs 'kernel=mosaic,block_t=64' times its knobs), scores_triton / pallas_triton_set (the Triton
kernel where kernel="auto" would take Mosaic), model_q_fq / model_q_raw (the model's indexer call before and since
session 42: q fake-quantized by XLA first, or raw with quantize_q=True), xla_ref.
Note: caches smaller than L2 (8K context, batch 1) are re-read from L2 across iterations.

topk_only: just the selection (k = 512) on random scores [B, T], (B, T) in {1, 64} x {32768, 262144}, methods
lax.top_k / radix select 8 bits per pass / 4 bits per pass / grouped two-stage selection with groups of 16 / 32 / 64
/ threshold (Triton compaction + lax.top_k) / threshold_rank (compaction + Triton rank kernels) / threshold_select
(Triton bound + compaction + k-set selection, lax.top_k over k) / threshold_set (the same as an index set, no sort)
(`topk_from_scores`), as dependent calls in one jitted scan (the next scores get + 0.0 * picks[0] in place at one entry); floor = reading the scores once at copy BW.
--quick: topk_only at T = 262144 only, without the 8-bit radix and blockwise variants. --variants / --topk-methods
pick subsets. --tiny (CPU smoke test): small shapes, nominal ceilings, 2 iterations. --lower-only (a GPU command's
dry run on any machine, session 42): every variant of every case lowered for CUDA on abstract inputs, nothing timed.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.timing import chain_net, measure_ceilings, parse_options, timed_chain
from pallas_kernels.indexer import formats as F, indexer_scores_pallas, indexer_topk
from pallas_kernels.indexer.gpu import topk_from_scores

H, D, TOPK = 64, 128, 512

# ---- timing / ceiling helpers: benchmarks/timing.py


def floor_s(bytes_, flops, ceil):
    return max(bytes_ / ceil["copy_Bps"], flops / ceil["bf16_flops"])


def make_inputs(B, S, ctx, fmt):
    """(q, w, keys, nv) of one benchmark case: V4-Flash indexer shapes, random data, the fmt key format."""
    T = ctx // 4
    key = jax.random.key(B * 7 + T + S)
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (B, S, H, D), jnp.float32)
    if fmt in ("fp8", "fp4"):
        q = F.fake_quantize(q, fmt)
    w = jax.random.normal(k2, (B, S, H), jnp.float32) * (H ** -0.5 * D ** -0.5)
    # keys in chunks of batch rows: one [64, 262144, 128] float32 draw is 2^31 elements / 8.6 GB. (The B=64 x 1M
    # crashes of sessions 3 and 10 were the keys captured as a program constant: they are arguments now, session 11)
    rows_per = max(1, (1 << 27) // (T * D))
    parts = [F.quantize(jax.random.normal(jax.random.fold_in(k3, i), (min(rows_per, B - i), T, D), jnp.float32), fmt)
             for i in range(0, B, rows_per)]
    keys = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *parts) if len(parts) > 1 else parts[0]
    if S == 1:
        nv = jnp.full((B, 1), T, jnp.int32)
    else:  # the chunk's last S queries of a ctx-token prefix: causal
        nv = ((ctx - S + jnp.arange(S, dtype=jnp.int32) + 1) // 4)[None, :].repeat(B, 0)
    return q, w, keys, nv


def dependent_q(q, out):
    """q + 0.0 x each query row's first output entry: the next call's q depends on this call's result (so XLA can
    neither hoist nor overlap the calls) through one elementwise pass over q (one small fusion, [B, S, H, D] f32),
    with no reduction across rows. The float 0.0 * x is not folded away (x may be NaN / inf)."""
    first = out[..., :1].astype(jnp.float32)          # [B, S, 1]: a pick (int32) or a score
    return q + 0.0 * first[..., None]


def chain_step(fn):
    """The chain's step for an indexer call fn(q, w, keys, nv): the call, then `dependent_q` on its output."""
    return lambda qq, w, keys, nv: dependent_q(qq, fn(qq, w, keys, nv))


def harness_out(q, w, keys, nv):
    """The harness variant's stand-in for the indexer's output: [B, S, 1] int32 read from q, so its step runs the
    same dependency fusion as every other variant's (`dependent_q`) and nothing else."""
    return jax.lax.bitcast_convert_type(q[:, :, 0, :1], jnp.int32)


def lower_cases(cases, variants) -> int:
    """--lower-only: each case's chain step (the variant + `dependent_q`) lowered for CUDA on abstract inputs
    (`jax.eval_shape` of `make_inputs`: no data is made); prints a line per variant; 1 if any failed, else 0."""
    failed = 0
    for B, S, ctx, fmt in cases:
        args = jax.eval_shape(lambda B=B, S=S, ctx=ctx, fmt=fmt: make_inputs(B, S, ctx, fmt))
        for name, fn in variants.items():
            try:
                jax.jit(chain_step(fn)).trace(*args).lower(lowering_platforms=("cuda",))
                print(f"lowers   {B}x{S}x{ctx}x{fmt} {name}", flush=True)
            except Exception as e:  # noqa: BLE001 - report every failure, then exit 1
                failed = 1
                print(f"FAILS    {B}x{S}x{ctx}x{fmt} {name}: {e!r}"[:600], flush=True)
    return failed


def case(B, S, ctx, fmt, ceil, n_iter, variants, timing="net", unroll=1):
    """One row of the table: every variant's us per call. timing "net": `timing.chain_net` (the per-call fixed cost
    cancelled; the "harness" variant is then the chain's own cost per iteration, and each variant's "<name>_own_us"
    its time less the harness's); "scan": `timing.timed_chain` (one wall time / n_iter: sessions <= 40)."""
    T = ctx // 4
    q, w, keys, nv = make_inputs(B, S, ctx, fmt)
    visible = float(jnp.sum(jnp.minimum(nv, T)))
    bytes_ = B * T * F.BYTES_PER_KEY[fmt](D) + q.size * 4 + w.size * 4 + B * S * min(TOPK, T) * 4
    flops = 2 * H * D * visible
    fl = floor_s(bytes_, flops, ceil)
    # mem_floor: the bytes alone (the "memory floor", which its 1.5x target is against); floor also bounds
    # the FLOPs at the bf16 rate, which fp4 keys on the e5m2 wgmma (their default since session 46) are not held to:
    # for them the table adds own / mem_floor ("/mem" line)
    row = dict(B=B, S=S, ctx=ctx, fmt=fmt, floor_us=fl * 1e6, mem_floor_us=bytes_ / ceil["copy_Bps"] * 1e6,
               bytes=bytes_, flops=flops, timing=timing, unroll=unroll)
    chain = chain_net if timing == "net" else timed_chain
    for name, fn in variants.items():
        try:   # keys etc. as arguments, not constants of the program (2.2 GB at B=64 x 1M)
            t = chain(chain_step(fn), q, n_iter, unroll=unroll, args=(w, keys, nv))
            row[name + "_us"] = t * 1e6
        except Exception as e:  # noqa: BLE001 - report and continue (e.g. reference OOM)
            row[name + "_us"] = float("nan")
            row[name + "_err"] = repr(e)[:200]
    if "harness_us" in row:
        for name in variants:
            if name != "harness":
                row[name + "_own_us"] = row[name + "_us"] - row["harness_us"]
    return row


def set_pipeline(cfg: str):
    """The chain's pipeline (`indexer_topk(..., impl="pallas", k=TOPK, topk="threshold_set")`; the model's default
    before session 34, now `topk="auto_set"`, which picks it or "hist_set" by the rows' length) with the options of
    cfg ('name=value,...'; topk=... replaces the method; the prefixed items of `config_scope`)."""
    from pallas_kernels.indexer import indexer_topk

    opts, scoped = config_scope(parse_options(cfg), cfg)
    return scoped(lambda q, w, keys, n_visible: indexer_topk(q, w, keys, n_visible, k=TOPK, impl="pallas",
                                                             **{"topk": "threshold_set", **opts}))


def config_scope(opts: dict, cfg: str):
    """opts (a parsed config) -> (the options left, wrap): wrap(fn) runs fn (a call that traces) with the prefixed
    items in force and restores them after. An item 'topk.NAME=value' sets the module constant NAME of
    pallas_kernels.indexer.topk (converted to its type), e.g. 'topk.COUNT_WIDTH=512'; 'gpu.NAME=value' one of
    pallas_kernels.indexer.gpu, e.g. 'gpu.AUTO_SEGMENT=0' (auto_set's methods before segment_set); 'hist.NAME=value' an entry of
    `topk_hist.HIST_KERNEL_CONFIG` (topk=hist_set / tour_set), e.g. 'hist.num_warps=32'; 'tour.NAME=value' an entry of
    `topk_hist.TOUR_CONFIG` (topk=tour_set), e.g. 'tour.seg_len=2048'; 'sel.NAME=value' an entry of
    `gpu_mosaic.SELECT_CONFIG` (topk=segment_set), e.g. 'sel.num_stages=4'; 'mosaic.NAME=value' an entry of
    `gpu_mosaic.MOSAIC_CONFIG` (the Mosaic scores kernel), e.g. 'mosaic.q_prep=triton', 'mosaic.fp4_converter=2'."""
    from pallas_kernels.indexer import topk as topk_mod
    from pallas_kernels.indexer import gpu as gpu_mod
    from pallas_kernels.indexer import gpu_mosaic, topk_hist

    opts = dict(opts)
    # (module, constant name) -> value, for the 'topk.' and 'gpu.' items
    consts = {(mod, name.partition(".")[2]): opts.pop(name) for name in list(opts)
              for prefix, mod in (("topk.", topk_mod), ("gpu.", gpu_mod)) if name.startswith(prefix)}
    # prefix -> (its config table, the table's name): the items given for each
    prefixes = {"hist.": (topk_hist.HIST_KERNEL_CONFIG, "HIST_KERNEL_CONFIG"),
                "tour.": (topk_hist.TOUR_CONFIG, "TOUR_CONFIG"), "sel.": (gpu_mosaic.SELECT_CONFIG, "SELECT_CONFIG"),
                "mosaic.": (gpu_mosaic.MOSAIC_CONFIG, "MOSAIC_CONFIG")}
    tables = []
    for prefix, (table, what) in prefixes.items():
        given = {name[len(prefix):]: opts.pop(name) for name in list(opts) if name.startswith(prefix)}
        unknown = sorted(set(given) - set(table))
        if unknown:
            raise ValueError(f"config {cfg!r}: {what} has no options {unknown}")
        tables.append((table, given))
    for mod, c in consts:
        if not hasattr(mod, c):
            raise ValueError(f"config {cfg!r}: {mod.__name__} has no constant {c!r}")

    def as_type(old, v):   # 'gpu.AUTO_SEGMENT=0' is False (bool("0") would be True)
        return bool(int(v)) if isinstance(old, bool) else type(old)(v)

    def wrap(fn):
        def run(*args):
            saved = {mc: getattr(*mc) for mc in consts}
            saved_tables = [dict(table) for table, _ in tables]
            for table, given in tables:
                table.update(given)
            try:
                for (mod, c), v in consts.items():
                    setattr(mod, c, as_type(saved[mod, c], v))
                return fn(*args)
            finally:
                for (table, _), saved_t in zip(tables, saved_tables):
                    table.clear()
                    table.update(saved_t)
                for (mod, c), v in saved.items():
                    setattr(mod, c, v)

        return run

    return opts, wrap


TOPK_ONLY_METHODS = {"lax": dict(topk="lax"), "radix": dict(topk="radix"), "radix4": dict(topk="radix4"),
                     "grouped16": dict(topk="grouped16"), "grouped32": dict(topk="grouped32"),
                     "grouped64": dict(topk="grouped64"), "threshold": dict(topk="threshold"),
                     "threshold_rank": dict(topk="threshold_rank"),
                     "threshold_select": dict(topk="threshold_select"), "threshold_set": dict(topk="threshold_set"),
                     "threshold_fused_set": dict(topk="threshold_fused_set")}
QUICK_DROP = ("radix", "pallas_radix", "pallas_blockwise")  # slower than lax on the H200 / 8-bit radix compiles for
                                                            # minutes at batch 64 (results/h200_s3r1, s3r3)


def topk_only_case(B, T, ceil, n_iter, methods=TOPK_ONLY_METHODS, k=TOPK):
    """Time per call (us) of topk_from_scores alone on random scores [B, T] for each method."""
    k = min(k, T)
    scores = jax.random.normal(jax.random.key(B * 131 + T), (B, T), jnp.float32)
    bytes_ = B * T * 4 + B * k * 4
    row = dict(B=B, T=T, k=k, floor_us=bytes_ / ceil["copy_Bps"] * 1e6, bytes=bytes_)
    # "harness": the chain's own iteration (carry update, no selection): every method's time includes it
    for name, opts in dict(harness=None, **methods).items():
        def step(c, opts=opts):
            s, acc = c
            picks = jnp.zeros((B, 1), jnp.int32) if opts is None else topk_from_scores(s, k, **opts)
            dep = jnp.sum(picks[:, :1]).astype(jnp.float32)
            return s.at[:, :1].add(0.0 * dep), acc + dep      # in-place, so no extra pass over the scores
        try:
            t = timed_chain(step, (scores, jnp.zeros((), jnp.float32)), n_iter)
            row[name + "_us"] = t * 1e6
        except Exception as e:  # noqa: BLE001 - report and continue
            row[name + "_us"] = float("nan")
            row[name + "_err"] = repr(e)[:200]
    return row


def run_topk_only(shapes, ceil, n_iter_fn, rows, on_row=lambda: None, methods=TOPK_ONLY_METHODS):
    """Times the topk_only cases, printing a table; rows are appended to `rows` (on_row() after each)."""
    print(f"topk_only (k = {TOPK}): us per call (speed-up vs lax)", flush=True)
    print(f"{'B':>3} {'T':>7} {'floor':>9} {'harness':>8} " + " ".join(f"{m:>17}" for m in methods), flush=True)
    for B, T in shapes:
        r = topk_only_case(B, T, ceil, n_iter_fn(B, T), methods)
        rows.append(r)
        on_row()
        lax_us = r.get("lax_us", float("nan"))
        cells = " ".join(f"{r[m + '_us']:9.1f} ({lax_us / r[m + '_us']:5.2f}x)" for m in methods)
        print(f"{B:>3} {T:>7} {r['floor_us']:8.1f}u {r['harness_us']:7.1f}u {cells}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/idx_bench")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # CPU smoke test of the script
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variants (default: all)")
    ap.add_argument("--topk-methods", default=None, help="comma-separated subset of the topk_only methods")
    ap.add_argument("--skip-topk-only", action="store_true")
    ap.add_argument("--cases", default=None, help="comma-separated BxSxCTXxFMT cases, e.g. 64x1x131072xfp8 (without "
                    "--topk-methods, skips the topk_only part: session 12 lost a device call to it)")
    ap.add_argument("--scores-configs", default=None,
                    help="';'-separated scores-kernel option sets, each timed as a variant 'scores[<set>]', e.g. "
                         "'block_t=128,num_warps=8;waves=2;precision=bf16' (options of indexer_scores_gpu, and the "
                         "prefixed config items of config_scope, e.g. mosaic.fp4_converter=2)")
    ap.add_argument("--set-configs", default=None,
                    help="';'-separated option sets of the whole default pipeline (indexer_topk with "
                         "topk='threshold_set'), each timed as a variant 'set[<set>]', e.g. "
                         "'kernel=mosaic,convert=alu,fuse_group_max=1'")
    ap.add_argument("--fused-config", default=None,
                    help="options of topk_fused.FUSED_KERNEL_CONFIG for every variant that runs the fused top-k "
                         "(pallas_fused_set), e.g. 'resident=1,num_warps=32'")
    ap.add_argument("--timing", choices=("net", "scan"), default="net",
                    help="net (default): (wall of 2n chained calls - wall of n) / n per case, the call's dispatch "
                         "cancelled, plus an 'own' line: each variant less the harness (the chain's own dependency "
                         "pass and loop trip); scan: one wall time / n (sessions <= 40: the dispatch of the one "
                         "call, 100-250 us, spread over n = 10 iterations at B = 64 x 128K)")
    ap.add_argument("--unroll", type=int, default=1,
                    help="dependent calls per scan iteration: > 1 shares the loop's own trip between them")
    ap.add_argument("--lower-only", action="store_true",
                    help="a dry run on any machine: lower every case's variants for CUDA (the dispatchers told the "
                         "backend is a GPU), time nothing; exits 1 if any fails")
    a = ap.parse_args()
    if a.fused_config:
        from pallas_kernels.indexer import topk_fused

        opts = parse_options(a.fused_config)
        unknown = set(opts) - set(topk_fused.FUSED_KERNEL_CONFIG)
        if unknown:
            raise SystemExit(f"--fused-config: unknown keys {sorted(unknown)}; known: "
                             f"{sorted(topk_fused.FUSED_KERNEL_CONFIG)}")
        topk_fused.FUSED_KERNEL_CONFIG.update(opts)  # read at trace time
    os.makedirs(a.out, exist_ok=True)
    if a.lower_only:
        jax.default_backend = lambda: "gpu"   # the dispatchers resolve "pallas" / "auto" as on the GPU
    if a.tiny or a.lower_only:
        ceil = dict(copy_Bps=1e11, bf16_flops=1e12, copy_GBps=100.0, bf16_TFLOPs=1.0, nominal=True)
    else:
        ceil = measure_ceilings(a.quick)
    print(f"ceilings: copy {ceil['copy_Bps'] / 1e12:.2f} TB/s, bf16 {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    result = dict(ceilings=ceil, rows=[], topk_only=[])

    def dump():  # after every case, so a run cut short keeps what it measured
        with open(os.path.join(a.out, "indexer_bench.json"), "w") as fh:
            json.dump(result, fh, indent=1)

    if a.tiny:
        topk_shapes = [(1, 4096), (4, 4096)]
    elif a.quick:
        topk_shapes = [(1, 262144), (64, 32768), (64, 262144)]   # (64, 32768): decode at 128K context
    else:
        topk_shapes = [(1, 32768), (1, 262144), (64, 32768), (64, 262144)]
    # enough iterations that the one dispatch per timed call (100-250 us on the H200) is < 1 us per iteration
    n_iter_topk = lambda B, T: 2 if a.tiny else 400 if B * T <= (1 << 20) else 100
    methods = {m: o for m, o in TOPK_ONLY_METHODS.items() if not (a.quick and m in QUICK_DROP)}
    if a.topk_methods:
        methods = {m: TOPK_ONLY_METHODS[m] for m in a.topk_methods.split(",")}
    if not a.skip_topk_only and (a.topk_methods or not a.cases):   # --cases alone: just those indexer cases
        run_topk_only(topk_shapes, ceil, n_iter_topk, result["topk_only"], dump, methods)

    variants = {
        "pallas": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas"),
        "pallas_blockwise": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", topk="blockwise"),
        "pallas_radix": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", topk="radix"),
        "pallas_radix4": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", topk="radix4"),
        "pallas_grouped": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", topk="grouped"),
        "pallas_threshold_rank": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas",
                                                                 topk="threshold_rank"),
        "pallas_threshold_select": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas",
                                                                   topk="threshold_select"),
        "pallas_threshold_set": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas",
                                                                topk="threshold_set"),
        # session 34: the model's GPU default for set picks (hist_set on rows of 2048-16384 candidates and on
        # calls of >= 96 rows of up to 32768 since session 35, tour_set on longer rows in calls of <= 2^21
        # candidates since session 36, else threshold_set: gpu.resolve_set_method)
        "pallas_auto_set": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", topk="auto_set"),
        # session 42: the model's indexer call as it was (q fake-quantized by XLA, then the op: the Mosaic kernel
        # quantizes it again) and as it is (a raw q, `quantize_q=True`: the op skips the fake quantization where the
        # kernel quantizes q itself)
        "model_q_fq": lambda q, w, k, n: indexer_topk(F.fake_quantize(q, getattr(k, "fmt", None)), w, k, n, k=TOPK,
                                                      impl="pallas", picks="set"),
        "model_q_raw": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", picks="set",
                                                       quantize_q=True),
        # session 40: the tournament's first stage inside the Mosaic scores kernel (mosaic_select), then the final
        # selection among each row's survivors
        "pallas_segment_set": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", topk="segment_set"),
        # session 7: the strided-group maxima written by the scores kernel instead of an XLA pass over the scores
        # (measured: no gain; off by default; the session-7 log names these columns *_nofuse for the default)
        "pallas_fused": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", fuse_group_max=True),
        "pallas_threshold_set_fused": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas",
                                                                      topk="threshold_set", fuse_group_max=True),
        "pallas_bf16ops": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas",
                                                          precision="bf16" if isinstance(k, F.QuantizedKeys) else None),
        "pallas_lax": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", topk="lax"),
        "scores_only": lambda q, w, k, n: indexer_scores_pallas(q, w, k, n, impl="pallas"),
        "scores_bf16ops": lambda q, w, k, n: indexer_scores_pallas(
            q, w, k, n, impl="pallas", precision="bf16" if isinstance(k, F.QuantizedKeys) else None),
        "pallas_f16ops": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas",
                                                         precision="f16" if isinstance(k, F.QuantizedKeys) else None),
        "scores_f16ops": lambda q, w, k, n: indexer_scores_pallas(
            q, w, k, n, impl="pallas", precision="f16" if isinstance(k, F.QuantizedKeys) else None),
        # session 10: fp8 tensor-core operands (fp8 keys as e4m3, fp4 keys moved to e5m2; q quantized like the keys)
        "pallas_fp8ops": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas",
                                                         precision="fp8" if isinstance(k, F.QuantizedKeys) else None),
        "pallas_fp8ops_set": lambda q, w, k, n: indexer_topk(
            q, w, k, n, k=TOPK, impl="pallas", topk="threshold_set",
            precision="fp8" if isinstance(k, F.QuantizedKeys) else None),
        "scores_fp8ops": lambda q, w, k, n: indexer_scores_pallas(
            q, w, k, n, impl="pallas", precision="fp8" if isinstance(k, F.QuantizedKeys) else None),
        # session 12: fp4 keys decoded by packed inline PTX (fp4_decode="asm"; fp4 cases only)
        "pallas_fp4asm": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", fp4_decode="asm"),
        "pallas_fp4asm_set": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", fp4_decode="asm",
                                                             topk="threshold_set"),
        "scores_fp4asm": lambda q, w, k, n: indexer_scores_pallas(q, w, k, n, impl="pallas", fp4_decode="asm"),
        # session 13: fp4 group scales on the f16 key operands instead of the logits (fp4 cases only)
        "scores_fp4op": lambda q, w, k, n: indexer_scores_pallas(q, w, k, n, impl="pallas", fp4_scale_at="operand"),
        "pallas_fp4op": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", fp4_scale_at="operand"),
        "pallas_fp4op_set": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", fp4_scale_at="operand",
                                                            topk="threshold_set"),
        "scores_bt128": lambda q, w, k, n: indexer_scores_pallas(q, w, k, n, impl="pallas", block_t=128),
        "scores_fp4reshape": lambda q, w, k, n: indexer_scores_pallas(q, w, k, n, impl="pallas",
                                                                      fp4_scale="reshape"),
        # session 20: fp8 keys from TMA straight into e4m3 wgmma (pallas_kernels/indexer/gpu_mosaic.py; fp8 only)
        "scores_mosaic": lambda q, w, k, n: indexer_scores_pallas(q, w, k, n, impl="pallas", kernel="mosaic"),
        "pallas_mosaic": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", kernel="mosaic"),
        "pallas_mosaic_set": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", kernel="mosaic",
                                                             topk="threshold_set"),
        "scores_triton": lambda q, w, k, n: indexer_scores_pallas(q, w, k, n, impl="pallas", kernel="triton"),
        "pallas_triton_set": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", kernel="triton",
                                                             topk="threshold_set"),
        "scores_mosaic_fp8": lambda q, w, k, n: indexer_scores_pallas(q, w, k, n, impl="pallas", kernel="mosaic",
                                                                      precision="fp8"),
        "pallas_mosaic_fp8_set": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas", kernel="mosaic",
                                                                 topk="threshold_set", precision="fp8"),
        # session 24: the threshold top-k's stages in one Triton kernel, one program per row (topk_fused.py)
        "pallas_fused_set": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="pallas",
                                                            topk="threshold_fused_set"),
        "xla_ref": lambda q, w, k, n: indexer_topk(q, w, k, n, k=TOPK, impl="reference"),
    }
    if a.quick:
        variants = {v: f for v, f in variants.items() if v not in QUICK_DROP}
    if a.variants:
        unknown = [v for v in a.variants.split(",") if v not in variants and v != "harness"]
        if unknown:
            ap.error(f"unknown variants {unknown} (the harness runs always); known: {', '.join(variants)}")
        variants = {v: variants[v] for v in a.variants.split(",") if v != "harness"}
    for cfg in (a.scores_configs.split(";") if a.scores_configs else []):
        opts, scoped = config_scope(parse_options(cfg), cfg)   # e.g. 'mosaic.fp4_converter=2'
        variants[f"scores[{cfg}]"] = scoped(
            lambda q, w, k, n, o=opts: indexer_scores_pallas(q, w, k, n, impl="pallas", **o))
    for cfg in (a.set_configs.split(";") if a.set_configs else []):
        variants[f"set[{cfg}]"] = set_pipeline(cfg)
    # the chain's own iteration (the dependency pass over q, the loop's trip; no indexer): included in every column
    variants = dict(harness=harness_out, **variants)
    cases = []
    fmts = ("bf16", "fp8", "fp4")
    if a.tiny:
        cases = [(1, 1, 4096, "bf16")]
    elif a.quick:
        # the target cases first (decode >= 128K at batch 64), the largest (1M context, 2+ GB of keys) last
        cases = [(64, 1, 131072, f) for f in fmts] + [(1, 1, 131072, "fp4"), (1, 1024, 131072, "fp4")]
        cases += [(64, 1, 1 << 20, "fp4")]
    else:
        for ctx in (8192, 131072, 1 << 20):
            for B in (1, 64):
                for f in fmts:
                    cases.append((B, 1, ctx, f))
        cases += [(1, 1024, 131072, "bf16"), (1, 1024, 131072, "fp4")]
    if a.cases:
        cases = [(int(b), int(s_), int(c), f) for b, s_, c, f in (x.split("x") for x in a.cases.split(","))]
    if a.lower_only:
        raise SystemExit(lower_cases(cases, variants))
    rows = result["rows"]
    hdr = f"{'B':>3} {'S':>5} {'ctx':>8} {'fmt':>5} {'floor':>9} {'memfloor':>9} " + " ".join(f"{v:>17}" for v in variants)
    print(hdr, flush=True)
    for B, S, ctx, f in cases:
        n_iter = 2 if a.tiny else 100 if B * ctx * S <= (1 << 24) else 10  # (net timing: 10 and 20)
        r = case(B, S, ctx, f, ceil, n_iter, variants, timing=a.timing, unroll=a.unroll)
        rows.append(r)
        cells = " ".join(f"{r[v + '_us']:9.1f} ({r[v + '_us'] / r['floor_us']:5.1f}x)" for v in variants)
        print(f"{B:>3} {S:>5} {ctx:>8} {f:>5} {r['floor_us']:8.1f}u {r['mem_floor_us']:8.1f}u {cells}", flush=True)
        if "harness_us" in r and len(variants) > 1:   # the same less the chain's own cost per iteration
            own = " ".join(f"{'':>17}" if v == "harness" else
                           f"{r[v + '_own_us']:9.1f} ({r[v + '_own_us'] / r['floor_us']:5.2f}x)" for v in variants)
            print(f"{'':>3} {'':>5} {'':>8} {'own':>5} {'':>9} {'':>9} {own}", flush=True)
            if r["mem_floor_us"] < r["floor_us"]:   # fp4: the target is against the memory floor alone
                mem = " ".join(f"{'':>17}" if v == "harness" else
                               f"{'':>9} ({r[v + '_own_us'] / r['mem_floor_us']:5.2f}x)" for v in variants)
                print(f"{'':>3} {'':>5} {'':>8} {'/mem':>5} {'':>9} {'':>9} {mem}", flush=True)
        dump()


if __name__ == "__main__":
    main()
