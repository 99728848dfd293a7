"""Compile the Pallas TPU (Mosaic) kernels with libtpu for a TPU target on a machine without a TPU.

    python3 -m venv /tmp/tpuvenv && /tmp/tpuvenv/bin/pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')" pytest -e .
    PYTHONPATH=.:tests /tmp/tpuvenv/bin/python benchmarks/tpu_offline.py [--topology v6e:2x2] [--only NAME,...]

Why: CI lowers every TPU kernel (`tests/test_tpu_lowering.py`: Pallas' Mosaic lowering, in Python), but Mosaic's
own compiler -- layout assignment, the tiling rules of memref slices and DMAs, VMEM allocation -- runs in libtpu,
and until session 50 no kernel here had been through it. jax compiles ahead of time for a TPU topology it only
describes (`jax.experimental.topologies.get_topology_desc`): libtpu runs on the CPU, no TPU attached. This compiles
each kernel configuration of test_tpu_lowering.py that way, then one prefill and one decode step of the embedded
model on the TPU kernels (DSV4_KERNEL_PLATFORM=tpu makes the dispatchers pick them on this CPU host), and prints, per
case, OK with the compile time and the executable's memory use, or the compiler's error.

Kept out of the project's own environment: with libtpu installed, jax would probe for a TPU at every backend start.
The TPU generation some lowering rules ask for (e.g. `sign` on v6e+) is registered for the "cpu" device kind, as
the lowering tests do.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")   # libtpu's start-up looks these up; a description only
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v6e-4")
# the kernel dispatchers pick the TPU kernels although jax's default backend here is the CPU (pallas_kernels.dispatch)
os.environ.setdefault("DSV4_KERNEL_PLATFORM", "tpu")


def topology_device(topology: str):
    """The first device of a described (not attached) TPU topology, e.g. "v6e:2x2"."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]


def register_cpu_as(chip: str = "v6e"):
    """Lowering rules that ask for the TPU generation get `chip`'s (they look at jax.devices()[0], the CPU)."""
    import jax
    from jax._src.pallas.mosaic import tpu_info

    version = {"v5e": tpu_info.ChipVersion.TPU_V5E, "v6e": tpu_info.ChipVersion.TPU_V6E}[chip]
    tpu_info.registry[jax.devices()[0].device_kind] = lambda: tpu_info.get_tpu_info_for_chip(version, 1)


def compile_for(device, fn, *args, donate: bool = True, row_major: bool = False):
    """jit(fn) compiled by libtpu for `device` (a topology device); args are arrays or ShapeDtypeStructs. donate:
    every argument donated, as the engine donates its caches (an output a kernel aliases to an input then needs
    no copy of that input). row_major: every argument's device layout declared row-major (`jax.experimental.layout`)
    instead of XLA's TPU default, which for minor dims off the 128 lanes is column-major."""
    import jax
    from jax.experimental.layout import Format, Layout
    from jax.sharding import SingleDeviceSharding

    sharding = SingleDeviceSharding(device)
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    donate_argnums = tuple(range(len(args))) if donate else ()
    kw = {}
    if row_major:
        kw["in_shardings"] = jax.tree.map(
            lambda a: Format(Layout(major_to_minor=tuple(range(len(a.shape)))), sharding), args)
    return jax.jit(fn, donate_argnums=donate_argnums, **kw).trace(*specs).lower().compile()


def model_cases():
    """(name, fn, args): one jitted chunk of the embedded model (all three layer types, attention_impl="pallas":
    the TPU attention / indexer / compressor kernels) as prefill (S = 16) and decode (S = 1) steps, with the exact
    cache and with the bf16 KV + fp4 indexer-key cache (the embedded model's head_dim 64 has no FP8 KV layout)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import dsv4_jax
    from dsv4_jax.model import forward_chunk

    model = dsv4_jax.load_pretrained(dsv4_jax.embedded_checkpoint_path(), attention_impl="pallas")
    graphdef, state = nnx.split(model)

    def step(state, ids, cache, lengths):
        return forward_chunk(nnx.merge(graphdef, state), ids, cache, lengths)

    out = []
    for fmt in (dict(), dict(kv_dtype="bf16", indexer_dtype="fp4")):   # (fp8 KV rows need head_dim 512)
        cache = model.init_cache(2, 256, **fmt)
        for S in (16, 1):
            ids = jnp.zeros((2, S), jnp.int32)
            lengths = jnp.asarray(np.full((2,), S, np.int32))
            label = "bf16kv_fp4idx" if fmt else "exact"
            out.append((f"model_{'prefill' if S > 1 else 'decode'}_{label}", step, (state, ids, cache, lengths)))
    return out


def flash_cases():
    """(name, fn, args) at V4-Flash sizes, as shapes only (no data): the attention kernel's decode at B = 64 (128
    window + 512 CSA entries over a 128K-context pool, and 8192 HCA entries) and a 4K-query prefill chunk, bf16 and
    FP8 pools; the indexer's decode at B = 64 x 32768 keys (128K context) per key format and a 4K-query prefill;
    the compressors' 16K-token prefill and B = 64 decode. VMEM budgets that tiny test shapes never reach show here."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.compressor.tpu import compress_chunk_tpu
    from pallas_kernels.indexer import formats as F
    from pallas_kernels.indexer.tpu import indexer_topk_tpu
    from pallas_kernels.sparse_attention.fp8_layout import quantize_kv_fp8
    from pallas_kernels.sparse_attention.tpu import sparse_attention_tpu

    sds, i32, f32 = jax.ShapeDtypeStruct, jnp.int32, jnp.float32
    out = []
    H, D, W = 64, 512, 128
    for fp8 in (False, True):
        for label, B, S, K, pool_rows in (("csa_decode_b64", 64, 1, 512, 64 * 32768),
                                          ("hca8k_decode_b64", 64, 1, 8192, 64 * 8192),
                                          ("csa_prefill_s4096", 1, 4096, 512, 32768)):
            def pool(n):
                p = sds((n, D), jnp.bfloat16)
                return jax.eval_shape(quantize_kv_fp8, p) if fp8 else p
            args = (sds((B, S, H, D), jnp.bfloat16), pool(B * W if S == 1 else S + W), sds((B, S, W), i32),
                    pool(pool_rows), sds((B, S, K), i32), sds((H,), f32))
            out.append((f"flash_attention_{label}_{'fp8' if fp8 else 'bf16'}",
                        lambda *a: sparse_attention_tpu(*a, scale=D ** -0.5), args))
    for fmt in ("bf16", "fp8", "fp4"):
        for label, B, S, T in (("decode_b64_t32768", 64, 1, 32768), ("prefill_s4096", 1, 4096, 32768)):
            keys = jax.eval_shape(lambda k, fmt=fmt: F.quantize(k, fmt), sds((B, T, 128), f32))
            args = (sds((B, S, 64, 128), f32), sds((B, S, 64), f32), keys, sds((B, S), i32))
            out.append((f"flash_indexer_{fmt}_{label}",
                        lambda q, w, k, n: indexer_topk_tpu(q, w, k, n, k=512), args))
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, 64, 2) / 64))   # 64 RoPE dims, as V4-Flash
    for label, B, S, r, overlap, d, fmt in (("csa_prefill_s16384", 1, 16384, 4, True, 512, None),
                                            ("hca_prefill_s16384", 1, 16384, 128, False, 512, None),
                                            ("indexer_prefill_s16384", 1, 16384, 4, True, 128, "fp4"),
                                            ("csa_decode_b64", 64, 1, 4, True, 512, None)):
        c = 2 if overlap else 1
        cap = 32768 // r
        entries = jax.eval_shape(lambda e, fmt=fmt: F.quantize(e, fmt, f32), sds((B, cap, d), f32))
        args = (sds((B, S, c * d), f32), sds((B, S, c * d), f32), sds((B,), i32), sds((B,), i32),
                sds((B, r, c * d), f32), sds((B, r, c * d), f32),
                sds((B, r, d), f32) if overlap else None, sds((B, r, d), f32) if overlap else None, entries)
        kw = dict(ratio=r, overlap=overlap, norm_weight=jnp.ones((d,), f32), eps=1e-6,
                  inv_freq=inv_freq, norm_dtype=f32, key_format=fmt,
                  rotate=fmt is not None)
        out.append((f"flash_compressor_{label}", lambda *a, kw=kw: compress_chunk_tpu(*a, **kw), args))
    return out


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "f64": 8}


_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = ([a-z0-9]+)\[([0-9,]*)\](\{[^}]*\})? ([\w\-]+)\((.*)$")
_CALLEES = re.compile(r"(?:calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)"
                      r"|branch_computations=\{([^}]*)\}")


def _layout_core(layout: str | None) -> str:
    """A layout's dims order and tiling, without the memory space (S(n)): a copy that only changes the space is a
    staging copy (e.g. into VMEM), not a relayout."""
    return re.sub(r"S\(\d+\)", "", layout or "").rstrip(":}") if layout else ""


def _relayouts(hlo_text: str) -> list:
    """The relayout copies of a compiled TPU module (see `relayout_copies`), each as a dict: bytes, loop (inside a
    while loop's body), and what it is (dtype, dims, the operand's and the result's layouts, jax's op name)."""
    comps, defs, copies = {}, {}, []
    current = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            current = current.lstrip("%")
            comps[current] = set()
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        _, name, dtype, dims, layout, op, rest = m.groups()
        defs[name] = layout
        for callee in _CALLEES.finditer(rest):
            if callee.group(1):
                comps[current].add(callee.group(1))
            else:
                comps[current].update(c.strip().lstrip("%") for c in callee.group(2).split(","))
        if op == "copy":
            operand = re.match(r"%([\w.\-]+)\)", rest)
            op_name = re.search(r'op_name="([^"]*)"', rest)
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            copies.append(dict(comp=current, operand=operand.group(1) if operand else None, layout=layout,
                               bytes=n * _BYTES.get(dtype, 4), what=f"{dtype}[{dims}]",
                               op_name=op_name.group(1) if op_name else ""))
    # computations run by a while loop (its body and condition, and whatever they call)
    in_loop, todo = set(), [c for line in hlo_text.splitlines() if " while(" in line
                            for c in re.findall(r"(?:body|condition)=%([\w.\-]+)", line)]
    while todo:
        c = todo.pop()
        if c not in in_loop:
            in_loop.add(c)
            todo.extend(comps.get(c, ()))
    out = []
    for c in copies:
        src = defs.get(c["operand"]) if c["operand"] is not None else None
        if c["operand"] is not None and _layout_core(src) == _layout_core(c["layout"]):
            continue
        out.append(dict(c, loop=c["comp"] in in_loop, src_layout=src))
    return out


def relayout_copies(hlo_text: str) -> dict:
    """Bytes of a compiled TPU module's relayouts: `copy` ops whose result's dims order or tiling differs from the
    operand's (XLA's relayouts, e.g. of a pool whose default TPU layout is column-major -- [N, 448] e4m3, minor dims
    off the 128 lanes -- into the row-major layout a Pallas kernel's operand demands). Copies that only stage an
    operand in another memory space are left out. Returns {"total", "entry", "loop"}: "loop" = inside a while loop's
    body (per iteration: per decode step in the engine's loop), "entry" = once per call, outside any loop."""
    out = {"total": 0, "entry": 0, "loop": 0}
    for c in _relayouts(hlo_text):
        out["total"] += c["bytes"]
        out["loop" if c["loop"] else "entry"] += c["bytes"]
    return out


def largest_relayouts(hlo_text: str, n: int) -> list:
    """The n largest relayout copies as (bytes, one line: dtype[dims] layout -> layout, loop or not, jax's op)."""
    rows = sorted(_relayouts(hlo_text), key=lambda c: -c["bytes"])[:n]
    return [(c["bytes"], f"{c['what']} {c['src_layout']} -> {c['layout']}{'  (loop)' if c['loop'] else ''}"
                         f"  {c['op_name'][-90:]}") for c in rows]


def compile_engine_case(device, fn, args, layouts):
    """An `engine_cases` program compiled by libtpu for `device`: the cache (args[1]) donated, as the engine donates
    it; with layouts, its arrays declared in them as inputs and as the returned cache (the program's last output),
    as `generate` compiles its programs on a TPU."""
    import jax
    from jax.experimental.layout import Format
    from jax.sharding import SingleDeviceSharding

    sharding = SingleDeviceSharding(device)
    specs = list(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args))
    kw = {}
    if layouts is not None:
        leaves, treedef = jax.tree_util.tree_flatten(args[1])
        fmts = [Format(l, sharding) if l is not None else sharding for l in layouts]
        specs[1] = jax.tree_util.tree_unflatten(
            treedef, [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=f) for a, f in zip(leaves, fmts)])
        out = jax.eval_shape(fn, *args)
        kw["out_shardings"] = tuple([None] * (len(out) - 1) + [jax.tree_util.tree_unflatten(treedef, fmts)])
    return jax.jit(fn, donate_argnums=(1,), **kw).trace(*specs).lower().compile()


def flash4_model():
    """V4-Flash's first four layers (two sliding, CSA, HCA; 8 routed experts), bf16, on the Pallas kernels, as
    shapes only (`nnx.eval_shape`: no weights are drawn)."""
    import jax.numpy as jnp
    from flax import nnx

    from dsv4_jax.config import PRESETS
    from dsv4_jax.model import DeepseekV4ForCausalLM

    cfg = PRESETS["v4-flash"]()
    cfg = cfg.replace(num_hidden_layers=4, layer_types=cfg.layer_types[:4], compress_ratios=cfg.compress_ratios[:4],
                      num_hash_layers=1, n_routed_experts=8, num_experts_per_tok=min(cfg.num_experts_per_tok, 8))
    return nnx.eval_shape(lambda: DeepseekV4ForCausalLM(cfg, dtype=jnp.bfloat16, attention_impl="pallas",
                                                        rngs=nnx.Rngs(0)))


def engine_cases(flash: bool = True):
    """(name, fn, args, cache_layouts) for the engine's two programs (`dsv4_jax.engine`: the prefill of a padded
    batch and the on-device decode loop), the cache in XLA's default TPU layouts ("xla") and in the kernels'
    (`dsv4_jax.cache.cache_layouts`, as `generate` places it on a TPU: "kernel"). The model: the embedded one, and
    with flash, V4-Flash's first four layers (two sliding, CSA, HCA; 8 routed experts) as shapes only, B = 8 at a
    32K-token capacity, FP8 KV + fp4 indexer keys and bf16 KV + fp8 keys. args[1] is the cache; cache_layouts: None
    or a Layout (None = XLA's default) per cache leaf, for `compile_engine_case`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import dsv4_jax
    from dsv4_jax.cache import cache_layouts
    from dsv4_jax.engine import _decode_program, _prefill_program

    models = []
    model = dsv4_jax.load_pretrained(dsv4_jax.embedded_checkpoint_path(), attention_impl="pallas", progress=False)
    models.append(("tiny", model, 2, 256, 16, (dict(), dict(kv_dtype="bf16", indexer_dtype="fp4"))))
    if flash:
        models.append(("flash4", flash4_model(), 8, 32768, 512, (dict(kv_dtype="fp8", indexer_dtype="fp4"),
                                                               dict(kv_dtype="bf16", indexer_dtype="fp8"))))
    sds, i32, f32 = jax.ShapeDtypeStruct, jnp.int32, jnp.float32
    out = []
    key, scalars = sds((2,), jnp.uint32), (sds((), f32), sds((), i32), sds((), f32))
    for mname, m, B, cap, S, fmts in models:
        graphdef, state = nnx.split(m)
        state = jax.tree.map(lambda a: sds(a.shape, a.dtype), state)
        pre = (lambda st, c, ids, ln, k, t, tk, tp, g=graphdef: _prefill_program(g, st, c, ids, ln, k, t, tk, tp))
        dec = (lambda st, c, first, n, eos, k, t, tk, tp, g=graphdef:
               _decode_program(g, st, c, first, n, eos, k, t, tk, tp, buf_len=64))
        for fmt in fmts:
            cache = jax.eval_shape(lambda fmt=fmt: m.init_cache(B, cap, **fmt))
            label = f"{fmt.get('kv_dtype', 'exact')}kv_{fmt.get('indexer_dtype', 'exact')}idx"
            for layouts in ("xla", "kernel"):
                lays = cache_layouts(cache, "tpu") if layouts == "kernel" else None
                out.append((f"engine_{mname}_prefill_{label}_{layouts}", pre,
                            (state, cache, sds((B, S), i32), sds((B,), i32), key) + scalars, lays))
                out.append((f"engine_{mname}_decode_{label}_{layouts}", dec,
                            (state, cache, sds((B,), i32), sds((), i32), sds((), i32), key) + scalars, lays))
    return out


def layer_cases(batch: int = 8, seq: int = 512, capacity: int = 32768):
    """(name, fn, args, cache_layouts) for one V4-Flash attention layer's prefill chunk (CSA, layer 2; HCA, layer 3)
    of [batch, seq] tokens into a `capacity`-token cache, FP8 KV + fp4 indexer keys, the cache in the kernels'
    layouts: the q / o chain's relayouts in isolation (~95 s a compile at the defaults, against ~230 s for
    the four-layer engine program); and the CSA layer's indexer alone over fp4 and fp8 keys (session 53). For
    `compile_engine_case` (the cache, or the keys, is args[1], returned last)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv4_jax.cache import CacheFormat, cache_layouts

    model = flash4_model()
    cfg = model.config
    cache = jax.eval_shape(lambda: model.init_cache(batch, capacity, kv_dtype="fp8", indexer_dtype="fp4"))
    fmt = CacheFormat("fp8", "fp4", False)
    sds = jax.ShapeDtypeStruct
    out = []
    for layer in (2, 3):
        graphdef, state = nnx.split(model.layers[layer].attn)
        state = jax.tree.map(lambda a: sds(a.shape, a.dtype), state)

        def fn(st, cache, x, positions, start, n_valid, layer=layer, graphdef=graphdef):
            y, lc = nnx.merge(graphdef, st)(x, positions, start, n_valid, cache.layers[layer], fmt)
            return y, cache.replace(layers=cache.layers[:layer] + (lc,) + cache.layers[layer + 1:])

        args = (state, cache, sds((batch, seq, cfg.hidden_size), jnp.bfloat16), sds((batch, seq), jnp.int32),
                sds((batch,), jnp.int32), sds((batch,), jnp.int32))
        kind = cfg.layer_types[layer]
        out.append((f"layer_flash_{kind}_prefill_{batch}x{seq}_fp8kv_fp4idx", fn, args, cache_layouts(cache, "tpu")))
    # the CSA layer's indexer alone (q projection, RoPE, scores kernel, top-k, set conversion; ~20 s a compile):
    # "cache" = its keys, in the kernel's layouts, returned last as `compile_engine_case` wants
    graphdef, state = nnx.split(model.layers[2].attn.indexer)
    state = jax.tree.map(lambda a: sds(a.shape, a.dtype), state)
    for key_fmt in ("fp4", "fp8"):
        keys = jax.eval_shape(lambda: model.init_cache(batch, capacity, kv_dtype="fp8", indexer_dtype=key_fmt)
                              ).layers[2].indexer_keys

        def fn(st, keys, x, qr, positions, key_fmt=key_fmt):
            picks = nnx.merge(graphdef, st).select(x, qr, positions, keys, key_fmt, impl="pallas", picks="set")
            return picks, keys

        args = (state, keys, sds((batch, seq, cfg.hidden_size), jnp.bfloat16),
                sds((batch, seq, cfg.q_lora_rank), jnp.bfloat16), sds((batch, seq), jnp.int32))
        out.append((f"layer_flash_csa_indexer_{batch}x{seq}_{key_fmt}idx", fn, args, cache_layouts(keys, "tpu")))
    return out


def cases():
    """(name, fn, args) for every TPU kernel configuration of tests/test_tpu_lowering.py's default tier, plus
    V4-Flash decode shapes of the attention and indexer kernels."""
    import jax
    import jax.numpy as jnp

    from test_compressor_kernels import make as make_compressor
    from test_indexer_kernels import make as make_indexer
    from test_sparse_attention import make_inputs as make_attention

    out = []
    from pallas_kernels.sparse_attention.tpu import sparse_attention_tpu

    keys = ("q", "window_kv", "window_idx", "compressed_kv", "compressed_idx", "sinks")
    for fp8 in (False, True):
        for t, label in ((1, "decode"), (4, "prefill")):
            inp = make_attention(2, t, 64, 512, 300, 200, 128, 64, fp8=fp8, ragged=True)
            args = tuple(inp[k] for k in keys) + (inp["window_len"], inp["compressed_len"])
            out.append((f"attention_{label}_{'fp8' if fp8 else 'bf16'}",
                        lambda *a: sparse_attention_tpu(*a[:6], scale=512 ** -0.5, window_len=a[6],
                                                        compressed_len=a[7]), args))
    for dt in (jnp.float32,):   # the exact-mode f32 model's pools (f16 ones are refused: no f16 Mosaic arguments)
        inp = make_attention(2, 1, 64, 512, 300, 200, 128, 64, ragged=True)
        args = tuple(inp[k].astype(dt) if k.endswith("_kv") else inp[k] for k in keys)
        out.append((f"attention_decode_{jnp.dtype(dt).name}",
                    lambda *a: sparse_attention_tpu(*a, scale=512 ** -0.5), args))
    from pallas_kernels.indexer.tpu import indexer_topk_tpu

    for fmt, rotate in ((None, False), ("bf16", False), ("fp8", True), ("fp4", True)):
        for S in (1, 19):
            q, w, k, nv = make_indexer(2, S, 64, 300, fmt, rotate, causal=S > 1)
            out.append((f"indexer_{fmt or 'f32'}_S{S}", lambda q, w, k, n: indexer_topk_tpu(q, w, k, n, k=64),
                        (q, w, k, nv)))
    from pallas_kernels.compressor.tpu import compress_chunk_tpu

    for r, overlap, d, fmt, S in ((4, True, 128, "fp4", 1), (4, True, 128, "fp8", 33), (4, True, 512, None, 40),
                                  (128, False, 512, None, 1), (4, True, 512, "kv_fp8", 40)):
        inp, kw = make_compressor(2, S, r, overlap, d, None if fmt == "kv_fp8" else fmt)
        if fmt == "kv_fp8":
            from pallas_kernels.sparse_attention.fp8_layout import quantize_kv_fp8_rows

            inp["entries"], kw["key_format"] = quantize_kv_fp8_rows(inp["entries"]), "kv_fp8"
        ckeys = ("kv", "gate", "start", "n_valid", "state_kv", "state_gate", "prev_kv", "prev_gate", "entries")
        rotate = fmt in ("bf16", "fp8", "fp4")
        out.append((f"compressor_r{r}_d{d}_{fmt}_S{S}",
                    lambda *a, kw=kw, rotate=rotate: compress_chunk_tpu(*a, **kw, rotate=rotate),
                    tuple(inp[k] for k in ckeys)))
    from pallas_kernels.grouped_matmul import grouped_matmul_tpu
    from pallas_kernels.grouped_matmul.fp4 import Fp4Weights
    from pallas_kernels.grouped_matmul.tpu import grouped_matmul_fp4_tpu

    sds = jax.ShapeDtypeStruct
    for M, E, K, N, dtype in ((96, 256, 4096, 2048, jnp.bfloat16), (20, 8, 64, 32, jnp.float32)):
        out.append((f"grouped_matmul_{M}x{E}x{K}x{N}_{jnp.dtype(dtype).name}", grouped_matmul_tpu,
                    (sds((M, K), dtype), sds((E, K, N), dtype), sds((E,), jnp.int32))))
    for M, E, K, N, dtype in ((96, 256, 4096, 2048, jnp.bfloat16), (40, 8, 256, 128, jnp.float32)):
        rhs = Fp4Weights(sds((E, N, K // 2), jnp.uint8), sds((E, N, K // 32), jnp.uint8))
        out.append((f"grouped_matmul_fp4_{M}x{E}x{K}x{N}_{jnp.dtype(dtype).name}", grouped_matmul_fp4_tpu,
                    (sds((M, K), dtype), rhs, sds((E,), jnp.int32))))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="v6e:2x2")
    ap.add_argument("--chip", default="v6e", choices=("v5e", "v6e"))
    ap.add_argument("--only", default=None, help="comma-separated case names (prefix match; flash_* are V4-Flash sizes)")
    ap.add_argument("--engine", choices=("tiny", "flash"), default="tiny",
                    help="the engine's programs (engine_*) for the embedded model only, or also V4-Flash's first 4 "
                         "layers (slow: ~30 s a compile)")
    ap.add_argument("--layers", action="store_true",
                    help="also one V4-Flash CSA and one HCA attention layer's 4K-token prefill chunk, and the CSA "
                         "layer's indexer alone (layer_flash_*)")
    ap.add_argument("--no-pins", action="store_true",
                    help="compile without the attention q / o chain's row-major pins (dsv4_jax.layers.common."
                         "pin_row_major), for the before / after of session 52")
    ap.add_argument("--list-copies", type=int, default=0, metavar="N",
                    help="print each compiled program's N largest relayout copies")
    ap.add_argument("--traceback", action="store_true")
    ap.add_argument("--row-major", action="store_true",
                    help="declare every input's device layout row-major (removes XLA's relayout copies)")
    a = ap.parse_args()
    import jax

    print(f"jax {jax.__version__}, libtpu compile for {a.topology} (no TPU attached)", flush=True)
    device = topology_device(a.topology)
    register_cpu_as(a.chip)
    only = a.only.split(",") if a.only else None
    failed = 0
    all_cases = [c + (None, False) for c in cases() + flash_cases() + model_cases()]
    if a.no_pins:
        import dsv4_jax.layers.attention as attention_layer

        attention_layer.pin_row_major = lambda x, active: x
    all_cases += [c[:3] + (c[3], True) for c in engine_cases(flash=a.engine == "flash")]
    if a.layers:
        all_cases += [c[:3] + (c[3], True) for c in layer_cases()]
    for name, fn, args, layouts, engine in all_cases:
        if only and not any(name.startswith(o) for o in only):
            continue
        t0 = time.time()
        try:
            if engine:
                compiled = compile_engine_case(device, fn, args, layouts)
            else:
                compiled = compile_for(device, fn, *args, row_major=a.row_major)
            mem = compiled.memory_analysis()
            temp = getattr(mem, "temp_size_in_bytes", None)
            hlo = compiled.as_text()
            copies = relayout_copies(hlo)
            print(f"OK     {name}: {time.time() - t0:.1f} s, temp {temp} B, relayout copies {copies['total'] / 1e6:.1f}"
                  f" MB ({copies['loop'] / 1e6:.1f} MB of them a loop iteration)", flush=True)
            for nbytes, line in largest_relayouts(hlo, a.list_copies) if a.list_copies else ():
                print(f"         {nbytes / 1e6:8.1f} MB  {line}", flush=True)
        except Exception as e:   # one case's failure must not hide the others'
            failed += 1
            msg = str(e).strip().splitlines()
            print(f"FAILED {name}: {type(e).__name__}: {' | '.join(msg[:6])[:1500]}", flush=True)
            if a.traceback:
                traceback.print_exc()
    print(f"{failed} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
