"""Decode step time vs context length for the full model (reference path unless --attention-impl says otherwise).

    PYTHONPATH=. python benchmarks/decode.py [--checkpoint DIR | --preset v4-flash --layers 4 ...]
        [--contexts 128,256,...,8192] [--steps 64] [--batch 1] [--dtype float32|bfloat16] [--out FILE]

What is timed: for each context length L, a cache of capacity L + steps is filled to length L, then `--steps`
DEPENDENT decode steps (token_{k+1} = argmax(logits_k), each step `forward_chunk(model, tok[:, None], cache, ones)`)
run inside ONE jitted `lax.scan`; wall time of that call from dispatch to `block_until_ready` (after a warm-up
call; median of `--repeats`) divided by `--steps` = µs/step. Python dispatch (100-250 µs per call) is therefore
paid once per scan, not per step. Compilation is excluded (AOT, reported separately).

How the cache is filled: by default with random values and lengths = L ("synthetic"): every shape is static, so a
decode step does the same work whatever the cache holds (window gather, indexer scores over all entries < capacity/4,
top-k, HCA gather over capacity/ratio entries, masked by position). `--prefill` instead runs a real prefill of L random
tokens first (one more compile per L; slow on CPU for long contexts).

Model: the embedded default checkpoint (tiny random DeepSeek-V4 architecture) unless --checkpoint or --preset is
given; a preset is built with random weights (seed 0), optionally at reduced depth (--layers keeps the first N layers
of the schedule) and with fewer experts (--experts) so it fits.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402


def build_model(args, abstract=False):
    """(model, description). abstract: a preset's shapes and dtypes only (nnx.eval_shape; `--floor-only`)."""
    from dsv4_jax.config import PRESETS
    from dsv4_jax.layers.moe import EXPERTS_CONFIG

    if args.experts_gmm is not None:
        EXPERTS_CONFIG["grouped_matmul"] = args.experts_gmm   # read when the step is traced
    if getattr(args, "fp4_config", None):
        from benchmarks.timing import parse_options
        from pallas_kernels.grouped_matmul import fp4

        opts = parse_options(args.fp4_config)
        unknown = sorted(set(opts) - set(fp4.DEFAULT_CONFIG))
        if unknown:
            raise SystemExit(f"--fp4-config: unknown options {unknown} (the kernel's: {sorted(fp4.DEFAULT_CONFIG)})")
        fp4.DEFAULT_CONFIG.update(opts)   # the FP4-weight kernel's defaults, read when it is traced
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    if args.preset:
        from dsv4_jax.model import DeepseekV4ForCausalLM

        cfg = PRESETS[args.preset]()
        if args.layers:
            n = args.layers
            cfg = cfg.replace(num_hidden_layers=n, layer_types=cfg.layer_types[:n],
                              compress_ratios=cfg.compress_ratios[:n], num_hash_layers=min(cfg.num_hash_layers, n))
        if args.experts:
            cfg = cfg.replace(n_routed_experts=args.experts,
                              num_experts_per_tok=min(cfg.num_experts_per_tok, args.experts))
        make = lambda: DeepseekV4ForCausalLM(cfg, dtype=dtype, attention_impl=args.attention_impl, rngs=nnx.Rngs(0),
                                             indexer_picks=args.indexer_picks, attention_kernel=args.attention_kernel,
                                             expert_weights=args.expert_weights)
        model = nnx.eval_shape(make) if abstract else make()
        return model, f"preset {args.preset} (random weights, {cfg.num_hidden_layers} layers)"
    from dsv4_jax.checkpoint import load_pretrained

    if args.checkpoint:
        path, name = args.checkpoint, args.checkpoint
    else:
        from dsv4_jax.assets import embedded_checkpoint_path

        path, name = embedded_checkpoint_path(), "embedded tiny-v4"
    return load_pretrained(path, dtype=dtype, attention_impl=args.attention_impl, progress=False,
                           indexer_picks=args.indexer_picks, attention_kernel=args.attention_kernel,
                           expert_weights=args.expert_weights), name


def step_floor_bytes(state, config, batch: int, context: int, kv_dtype=None, indexer_dtype=None) -> dict:
    """The bytes one decode step of `batch` sequences at `context` tokens must read at least, by part:
    * params: every parameter once, except the routed experts, the embedding and the hash layers' token -> expert
      table, of which only the rows the step uses count (the embedding's and the table's `batch` rows);
    * experts: per MoE layer, the expected number of distinct routed experts `batch` tokens pick, E (1 - (1 - k /
      E)^batch) (uniform, independent routing: what random tokens through hash layers and random gates give; the
      benchmark's own routing, not a trained model's), each expert's w1, w3, w2 once;
    * cache: per sequence, each layer's window rows (min(context, window)), its compressed rows (CSA: min(top-k,
      context / 4) picked; HCA: all context / 128) in the KV layout, and each CSA layer's context / 4 indexer keys.
    `state`: the model's parameters (arrays or ShapeDtypeStructs). Activations, q and the outputs are left out (a few
    MB). The floor in us is the sum over the copy bandwidth (`timing.measure_ceilings`)."""
    import math

    from dsv4_jax.accounting import indexer_row_bytes, kv_row_bytes

    params = experts = 0
    E, k = config.n_routed_experts, config.num_experts_per_tok
    active = E * (1 - (1 - k / E) ** batch)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]
        nbytes = math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
        if "experts" in names and "shared_experts" not in names:
            experts += nbytes / E * active
        elif "embed" in names or "tid2eid" in names:
            nbytes_row = nbytes / leaf.shape[0]
            params += nbytes_row * batch
        else:
            params += nbytes
    model_itemsize = jnp.dtype(config_dtype(state)).itemsize
    kv_row = kv_row_bytes(config, kv_dtype) if kv_dtype else model_itemsize * config.head_dim
    idx_row = indexer_row_bytes(config, indexer_dtype) if indexer_dtype else model_itemsize * config.index_head_dim
    rows = idx_keys = 0
    for kind, ratio in zip(config.layer_types, config.compress_ratios):
        rows += min(context, config.sliding_window)
        if kind == "csa":
            rows += min(config.index_topk, context // ratio)
            idx_keys += context // ratio
        elif kind == "hca":
            rows += context // ratio
    cache = batch * (rows * kv_row + idx_keys * idx_row)
    return dict(params=params, experts=experts, cache=cache, total=params + experts + cache, active_experts=active)


def config_dtype(state):
    """The dtype of the model's largest floating parameter (its weights' dtype; FP4 experts are uint8 bytes)."""
    leaves = [x for x in jax.tree_util.tree_leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    return max(leaves, key=lambda x: x.size).dtype


def _init_cache(model, batch, capacity, fmt):
    if not any(fmt.values()):
        return model.init_cache(batch, capacity)
    return model.init_cache(batch, capacity, **fmt)


def synthetic_cache(model, batch, capacity, length, fmt, seed=0):
    """A cache of `capacity` tokens whose arrays hold random values and whose lengths are `length`."""
    cache = _init_cache(model, batch, capacity, fmt)
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    new = []
    for k, leaf in zip(keys, leaves):
        if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype.itemsize >= 2:  # not fp8 codes / scales
            new.append(jax.random.normal(k, leaf.shape, jnp.float32).astype(leaf.dtype))
        else:
            new.append(leaf)
    cache = jax.tree_util.tree_unflatten(treedef, new)
    return cache.replace(lengths=jnp.full((batch,), length, jnp.int32))


def prefilled_cache(model, batch, capacity, length, fmt, seed=0):
    from dsv4_jax.model import forward_chunk

    graphdef, state = nnx.split(model)
    ids = jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, model.config.vocab_size, jnp.int32)
    f = jax.jit(lambda s, c, i: forward_chunk(nnx.merge(graphdef, s), i, c, jnp.full((batch,), length, jnp.int32))[1])
    return jax.block_until_ready(f(state, _init_cache(model, batch, capacity, fmt), ids))


def make_scan(graphdef, steps):
    from dsv4_jax.model import forward_chunk

    def run(state, cache, tok):
        model = nnx.merge(graphdef, state)
        ones = jnp.ones(tok.shape, jnp.int32)

        def body(carry, _):
            tok, cache = carry
            logits, cache = forward_chunk(model, tok[:, None], cache, ones)
            return (jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache), None

        (tok, cache), _ = jax.lax.scan(body, (tok, cache), None, length=steps)
        return tok, cache.lengths

    return jax.jit(run)


def add_model_args(p, dtype="float32"):
    """The arguments `build_model` and the cache formats read (shared with decode_breakdown.py)."""
    p.add_argument("--checkpoint")
    p.add_argument("--preset", choices=("v4-flash", "v4-pro", "tiny"))
    p.add_argument("--layers", type=int, default=0, help="keep the first N layers of a preset (0 = all)")
    p.add_argument("--experts", type=int, default=0, help="routed experts of a preset (0 = as configured)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=dtype)
    p.add_argument("--attention-impl", default="reference", choices=("reference", "pallas", "auto"))
    p.add_argument("--attention-kernel", default="auto", choices=("auto", "mosaic", "triton"),
                   help="GPU sparse-attention kernel (auto: Mosaic GPU where it applies)")
    p.add_argument("--indexer-picks", default="auto", choices=("auto", "sorted", "set"),
                   help="order of the CSA indexer's picks (auto: set on the GPU kernel path)")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default=None, help="KV cache rows (default: exact)")
    p.add_argument("--indexer-dtype", choices=("bf16", "fp8", "fp4"), default=None, help="indexer key rows")
    p.add_argument("--expert-weights", choices=("dequantized", "fp4"), default="dequantized",
                   help="routed experts in the model dtype or as FP4 bytes (`layers.moe.EXPERT_WEIGHTS`; a preset "
                        "draws random bytes)")
    p.add_argument("--fp4-config", default=None,
                   help="with --expert-weights fp4 on the kernel: its options for the whole step, e.g. "
                        "'decode=join_t,num_warps=2,block_n=64' (`grouped_matmul.fp4.DEFAULT_CONFIG`; default: its)")
    p.add_argument("--experts-gmm", choices=("reference", "pallas", "auto"), default=None,
                   help="the routed experts' grouped matmuls: XLA's ragged dot or pallas_kernels.grouped_matmul "
                        "(default: the model's, layers.moe.EXPERTS_CONFIG)")


def main(argv=None):
    p = argparse.ArgumentParser(description="decode step time vs context length")
    add_model_args(p)
    p.add_argument("--contexts", default="128,256,512,1024,2048,4096,8192")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prefill", action="store_true", help="fill the cache by a real prefill instead of random values")
    p.add_argument("--out", help="also write the table to this file")
    p.add_argument("--copy-gbps", type=float, default=None,
                   help="copy bandwidth for the floor column (default: measured, `timing.measure_ceilings`)")
    p.add_argument("--floor-only", action="store_true",
                   help="print each context's read floor (`step_floor_bytes`) from the model's shapes alone (no "
                        "weights built, nothing timed: e.g. a past GPU run's floor on the CPU, with --copy-gbps)")
    args = p.parse_args(argv)
    if args.floor_only:
        if not (args.preset and args.copy_gbps):
            p.error("--floor-only needs --preset and --copy-gbps")
        model, name = build_model(args, abstract=True)
        _, state = nnx.split(model)
        print(f"# read floor of one decode step: {name}: {model.config.summary()}, {args.dtype}, batch "
              f"{args.batch}, cache kv {args.kv_dtype or 'exact'} / indexer {args.indexer_dtype or 'exact'}, copy "
              f"{args.copy_gbps:.0f} GB/s")
        print(f"{'context':>8} {'params MB':>10} {'experts MB':>11} {'active':>7} {'cache MB':>9} {'floor us':>9}")
        for L in [int(x) for x in args.contexts.split(",")]:
            fb = step_floor_bytes(state, model.config, args.batch, L, args.kv_dtype, args.indexer_dtype)
            print(f"{L:>8} {fb['params'] / 1e6:>10.1f} {fb['experts'] / 1e6:>11.1f} {fb['active_experts']:>7.1f} "
                  f"{fb['cache'] / 1e6:>9.1f} {fb['total'] / (args.copy_gbps * 1e3):>9.1f}")
        return 0

    model, name = build_model(args)
    from dsv4_jax.layers.moe import EXPERTS_CONFIG

    fmt = dict(kv_dtype=args.kv_dtype, indexer_dtype=args.indexer_dtype)
    cfg = model.config
    graphdef, state = nnx.split(model)
    dev = jax.devices()[0]
    if args.copy_gbps:
        copy_gbps = args.copy_gbps
    else:
        from benchmarks.timing import measure_ceilings

        copy_gbps = measure_ceilings()["copy_GBps"]
    lines = [
        f"# benchmarks/decode.py — command: python benchmarks/decode.py {' '.join(argv or sys.argv[1:])}",
        f"# model: {name}: {cfg.summary()}",
        f"# device: {dev.platform} ({dev.device_kind}), {os.cpu_count()} CPUs, jax {jax.__version__}, "
        f"{platform.machine()}, dtype {args.dtype}, attention {args.attention_impl}, batch {args.batch}, "
        f"load average at start {os.getloadavg()[0]:.2f}, cache kv {args.kv_dtype or 'exact'} / indexer "
        f"{args.indexer_dtype or 'exact'}, routed experts {args.expert_weights}"
        f"{' (kernel ' + args.fp4_config + ')' if args.fp4_config else ''}, their grouped matmul "
        f"{EXPERTS_CONFIG['grouped_matmul']}",
        f"# timed: {args.steps} dependent decode steps in one jitted lax.scan, median of {args.repeats} calls "
        f"after warm-up, / steps; cache {'prefilled' if args.prefill else 'synthetic (random values, lengths = L)'}; "
        f"capacity = L + steps; floor: the step's reads (`step_floor_bytes`: parameters, the expected active "
        f"experts, the cache rows) at {copy_gbps:.0f} GB/s copy bandwidth",
        f"{'context':>8} {'capacity':>9} {'us/step':>10} {'tokens/s':>10} {'min us':>9} {'compile s':>10} "
        f"{'floor us':>9} {'x floor':>8}",
    ]
    for line in lines:
        print(line, flush=True)
    scan = make_scan(graphdef, args.steps)
    for L in [int(x) for x in args.contexts.split(",")]:
        cap = L + args.steps
        cache = (prefilled_cache if args.prefill else synthetic_cache)(model, args.batch, cap, L, fmt)
        tok = jnp.zeros((args.batch,), jnp.int32)
        t0 = time.perf_counter()
        exe = scan.lower(state, cache, tok).compile()
        compile_s = time.perf_counter() - t0
        out = jax.block_until_ready(exe(state, cache, tok))  # warm-up
        assert int(out[1][0]) == L + args.steps
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(exe(state, cache, tok))
            times.append(time.perf_counter() - t0)
        us = 1e6 * statistics.median(times) / args.steps
        floor_us = step_floor_bytes(state, cfg, args.batch, L, args.kv_dtype, args.indexer_dtype)["total"] / (
            copy_gbps * 1e3)
        line = (f"{L:>8} {cap:>9} {us:>10.1f} {args.batch * 1e6 / us:>10.1f} "
                f"{1e6 * min(times) / args.steps:>9.1f} {compile_s:>10.1f} {floor_us:>9.1f} {us / floor_us:>8.2f}")
        lines.append(line)
        print(line, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
