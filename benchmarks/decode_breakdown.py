"""Where a decode step's time goes: each component timed alone, same shapes as the full step.

    PYTHONPATH=. python benchmarks/decode_breakdown.py --preset v4-flash --layers 4 --experts 8 --dtype bfloat16 \
        --batch 16 --context 32768 [--attention-impl pallas] [--out FILE]

Components (one decode token per sequence, a synthetic cache of `--context` tokens, as benchmarks/decode.py):
full step (forward_chunk), and per layer: the mHC pre-mix (hc weights + collapse + norm), attention (with its
compressor / indexer and cache update), the MoE, the mHC post-mix (each mHC part runs twice per layer: the sum counts
it twice); plus the LM head (hc head + norm + vocab matmul).
Each is run `--steps` times as DEPENDENT calls inside one jitted lax.scan (its output perturbs the next input, so
XLA can neither hoist nor batch them); µs/call = median wall time / steps after a warm-up. The per-component sum
versus the full step shows how much is lost between components (launch gaps, copies).

--parts (session 42): for compressed layers also the parts of the attention row, each alone: the compressor, the
indexer's compressor and its selection (CSA), and the sparse-attention op on the layer's own pools and index lists
(recorded by one traced call); the rest of the row is the projections, RoPE, quantization and the cache update.
--kernels (GPU): for the full step and each attention row, the kernels one call launches (CUPTI over `--unroll`
dependent calls): launches per call, the sum of their durations per call, and the largest few by name. (The CSA row
took ~2x a sliding one's at batch 16 x 32K in session 24, with the indexer and compressor kernels a small part:
this says which kernels fill the rest.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.timing import timed_chain  # noqa: E402
from decode import add_model_args, build_model, make_scan, synthetic_cache  # noqa: E402
from dsv4_jax.layers.hyper import hc_collapse, hc_expand, hc_head_collapse, hc_weights  # noqa: E402


def time_scan(fn, args, steps, repeats):
    """µs per call of `args = fn(*args)` as `steps` dependent calls in one jitted scan."""
    return 1e6 * timed_chain(lambda c: fn(*c), args, steps, reps=repeats)


def unrolled(fn, carry, n):
    """n dependent calls of `carry = fn(*carry)` (a Python loop: one program, no loop kernels)."""
    for _ in range(n):
        carry = fn(*carry)
    return carry


def kernel_list(label, f, args, unroll, top, lines):
    """Print and keep the CUPTI kernel list of f(*args) (`unroll` dependent calls): per call, the launches and the
    sum of their durations, then the `top` largest kernels by name (launches a call, µs a call)."""
    from benchmarks.decode_kernels import group_kernels
    from benchmarks.timing import cupti_kernels

    groups = group_kernels(cupti_kernels(f, *args), unroll)
    launches = sum(g["per_call"] for g in groups.values())
    total = sum(g["us_per_call"] for g in groups.values())
    out = [f"  kernels of {label}: {launches:.0f} launches / call, {total:.1f} us of kernels / call"]
    for name, g in list(groups.items())[:top]:
        out.append(f"    {g['us_per_call']:8.1f} us  {g['per_call']:4.1f}x  {name[:90]}")
    for line in out:
        print(line, flush=True)
    lines.extend(out)


def attention_parts(graphdef, state, i, x, positions, start, ones, cache):
    """[(label, fn, carry)] for layer i's compressed attention: each part of its call alone, as a dependent chain
    (`carry = fn(*carry)`), with the same inputs as the layer's call."""
    from pallas_kernels.sparse_attention import sparse_attention

    from dsv4_jax.config import CSA

    layer = nnx.merge(graphdef, state).layers[i].attn
    lc, fmt = cache.layers[i], cache.fmt
    parts = []

    def compressor(x_, comp_state, entries, st=state):
        a = nnx.merge(graphdef, st).layers[i].attn
        entries, comp_state = a.compressor(x_, positions, start, ones, comp_state, entries,
                                           key_format=fmt.compressed_key_format, impl=a.attention_impl)
        return x_, comp_state, entries
    parts.append(("compressor", compressor, (x, lc.compressor, lc.compressed_kv)))
    if layer.kind == CSA:
        def idx_compressor(x_, idx_state, keys, st=state):
            a = nnx.merge(graphdef, st).layers[i].attn
            keys, idx_state = a.indexer.compressor(x_, positions, start, ones, idx_state, keys,
                                                   key_format=fmt.indexer, rotate=fmt.indexer_rotate,
                                                   impl=a.attention_impl)
            return x_, idx_state, keys
        parts.append(("indexer compressor", idx_compressor, (x, lc.indexer, lc.indexer_keys)))
        qr = layer.q_norm(layer.wq_a(x))

        def select(qr_, st=state):
            a = nnx.merge(graphdef, st).layers[i].attn
            picks = a.indexer.select(x, qr_, positions, lc.indexer_keys, fmt.indexer, fmt.indexer_rotate,
                                     impl=a.attention_impl, picks=a.indexer_picks)
            return (qr_ + 0.0 * picks[..., :1].astype(qr_.dtype),)
        parts.append(("indexer select", select, (qr,)))
    trace = []
    layer(x, positions, start, ones, lc, fmt, trace=trace)
    r = trace[0]

    def op(q, r=r, a=layer):
        o = sparse_attention(q, r["window_pool"], r["window_idx"], r["compressed_pool"], r["compressed_idx"],
                             r["sinks"], scale=q.shape[-1] ** -0.5, compressed_len=r["compressed_len"],
                             impl=a.attention_impl, kernel=a.attention_kernel)
        return (q + 0.0 * o.astype(q.dtype),)
    parts.append(("sparse attention op", op, (r["q"],)))
    return parts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p, dtype="bfloat16")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out")
    p.add_argument("--parts", action="store_true", help="also time the parts of compressed layers' attention")
    p.add_argument("--kernels", action="store_true", help="CUPTI kernel lists of the step and the attention rows (GPU)")
    p.add_argument("--unroll", type=int, default=4, help="dependent calls per CUPTI kernel list")
    p.add_argument("--top", type=int, default=8, help="kernels named per CUPTI list")
    args = p.parse_args(argv)
    model, name = build_model(args)
    cfg, B, L = model.config, args.batch, args.context
    graphdef, state = nnx.split(model)
    fmt = dict(kv_dtype=args.kv_dtype, indexer_dtype=args.indexer_dtype)
    cache = synthetic_cache(model, B, L + args.steps, L, fmt)
    dev = jax.devices()[0]
    lines = [f"# benchmarks/decode_breakdown.py {' '.join(argv or sys.argv[1:])}",
             f"# model: {name}: {cfg.summary()}",
             f"# device: {dev.platform} ({dev.device_kind}), jax {jax.__version__}, batch {B}, context {L}, "
             f"dtype {args.dtype}, attention {args.attention_impl}; µs per call, {args.steps} dependent calls per "
             f"jitted scan, median of {args.repeats}",
             f"{'component':<28} {'us/call':>10}"]
    for line in lines:
        print(line, flush=True)
    rows = []

    def report(label, us, part=False):
        if not part:   # the parts of a row are inside it: not summed again
            rows.append((label, us))
        lines.append(f"{label:<28} {us:>10.1f}")
        print(lines[-1], flush=True)

    tok = jnp.zeros((B,), jnp.int32)
    full = make_scan(graphdef, args.steps)
    exe = full.lower(state, cache, tok).compile()
    jax.block_until_ready(exe(state, cache, tok))
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(exe(state, cache, tok))
        times.append(time.perf_counter() - t0)
    report("full decode step", 1e6 * statistics.median(times) / args.steps)
    if args.kernels:
        kernel_list("full decode step", make_scan(graphdef, args.unroll), (state, cache, tok), args.unroll, args.top,
                    lines)

    key = jax.random.PRNGKey(0)
    streams = jax.random.normal(key, (B, 1, cfg.hc_mult, cfg.hidden_size), jnp.float32).astype(model.dtype)
    x = streams[:, :, 0]
    positions = jnp.full((B, 1), L, jnp.int32)
    start, ones = jnp.full((B,), L, jnp.int32), jnp.ones((B,), jnp.int32)
    ids = jnp.zeros((B, 1), jnp.int32)
    hc = None
    for i in range(cfg.num_hidden_layers):
        kind = cfg.layer_types[i]

        def pre(s, st=state, i=i):
            blk = nnx.merge(graphdef, st).layers[i]
            w = hc_weights(s, blk.hc_attn_fn[...], blk.hc_attn_base[...], blk.hc_attn_scale[...], **blk._hc_kwargs)
            y = blk.attn_norm(hc_collapse(s, w[0]))
            return (s + y[:, :, None].astype(s.dtype) * 1e-3,)
        report(f"L{i} {kind:<7} mHC pre-mix", time_scan(pre, (streams,), args.steps, args.repeats))

        def attn(x_, lc, st=state, i=i):
            out, lc = nnx.merge(graphdef, st).layers[i].attn(x_, positions, start, ones, lc, cache.fmt)
            return x_ + out * 1e-3, lc
        report(f"L{i} {kind:<7} attention", time_scan(attn, (x, cache.layers[i]), args.steps, args.repeats))
        if args.kernels:
            kernel_list(f"L{i} {kind} attention", jax.jit(lambda c: unrolled(attn, c, args.unroll)),
                        ((x, cache.layers[i]),), args.unroll, args.top, lines)
        if args.parts and kind != "sliding":
            for label, fn, carry in attention_parts(graphdef, state, i, x, positions, start, ones, cache):
                report(f"L{i} {kind:<7}   {label}", time_scan(fn, carry, args.steps, args.repeats), part=True)

        def moe(x_, st=state, i=i):
            return (x_ + nnx.merge(graphdef, st).layers[i].ffn(x_, ids) * 1e-3,)
        report(f"L{i} {kind:<7} MoE", time_scan(moe, (x,), args.steps, args.repeats))

        if hc is None:
            blk0 = model.layers[i]
            hc = hc_weights(streams, blk0.hc_attn_fn[...], blk0.hc_attn_base[...], blk0.hc_attn_scale[...],
                            **blk0._hc_kwargs)

        def post(s, f=x, w=hc):
            return (hc_expand(f, s, w[1], w[2]),)
        report(f"L{i} {kind:<7} mHC post-mix", time_scan(post, (streams,), args.steps, args.repeats))

    def head(s, st=state):
        m = nnx.merge(graphdef, st)
        y = hc_head_collapse(s, m.hc_head_fn[...], m.hc_head_base[...], m.hc_head_scale[...], eps=cfg.hc_eps,
                             norm_eps=cfg.rms_norm_eps)
        logits = m.head(m.norm(y), jnp.float32)
        return (s + jnp.max(logits, axis=-1)[..., None, None].astype(s.dtype) * 1e-3,)
    report("LM head (hc head+norm+vocab)", time_scan(head, (streams,), args.steps, args.repeats))
    # every layer runs the mHC pre- and post-mix twice (around attention and around the MoE)
    total = sum(us * (2 if "mHC" in label else 1) for label, us in rows[1:])
    lines.append(f"{'sum (mHC counted twice)':<28} {total:>10.1f}")
    print(lines[-1])
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
