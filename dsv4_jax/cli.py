"""`dsv4-jax` command line: `generate` and `info`.

    dsv4-jax generate [--checkpoint DIR] --prompt "1 2 3" [--prompt ...] --max-new-tokens N
                      [--temperature T] [--top-k K] [--top-p P] [--seed S] [--eos-id ID|none] [--max-len L]
                      [--dtype float32|bfloat16]
    dsv4-jax generate --checkpoint DIR --text "The capital of France is" [--text ...] [--tokenizer FILE_OR_DIR]
    dsv4-jax info [--checkpoint DIR | --preset v4-flash|v4-pro|tiny] [--context 1048576] [--batch-size 1]

Prompts are token ids (--prompt, space- or comma-separated) or text (--text), encoded by the checkpoint's
tokenizer.json (`dsv4_jax.tokenizer`; --tokenizer points elsewhere); with --text the continuation is printed as
text too, and generation stops at the tokenizer's EOS token (else the model config's eos_token_id) unless
--eos-id says otherwise. Without --checkpoint both commands use the embedded default checkpoint (a tiny
random-weight DeepSeek-V4-architecture model shipped with the package; it has no tokenizer).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence


def _parse_prompt(text: str) -> list[int]:
    parts = text.replace(",", " ").split()
    if not parts:
        raise argparse.ArgumentTypeError("empty prompt; give token ids like \"1 2 3\"")
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"prompt {text!r} is not a list of integer token ids (e.g. \"1 2 3\")")


def _parse_eos(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--eos-id {text!r} is not a token id or 'none'")


_EOS_UNSET = object()   # --eos-id not given: none for token-id prompts, the tokenizer's EOS for text prompts


def _text_prompts(args, ckpt: str):
    """(prompts as token ids, the tokenizer) for --text; (args.prompt, None) for --prompt."""
    if args.text is None:
        if args.tokenizer:
            raise SystemExit("dsv4-jax: error: --tokenizer applies to --text prompts only")
        return args.prompt, None
    from dsv4_jax.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(args.tokenizer or ckpt)
        return [tok.encode(t) for t in args.text], tok
    except (OSError, ImportError, ValueError) as e:
        raise SystemExit(f"dsv4-jax: error: {e}")


def _checkpoint_dir(arg: str | None) -> tuple[str, bool]:
    if arg:
        if not os.path.isdir(arg):
            raise SystemExit(f"dsv4-jax: error: checkpoint directory {arg!r} does not exist")
        return arg, False
    from dsv4_jax.assets import embedded_checkpoint_path

    return embedded_checkpoint_path(), True


def _load_config(ckpt: str):
    from dsv4_jax.config import DeepseekV4Config

    path = os.path.join(ckpt, "config.json")
    if not os.path.isfile(path):
        raise SystemExit(f"dsv4-jax: error: {path} not found")
    return DeepseekV4Config.from_json_file(path)


def _fmt(n: float) -> str:
    from dsv4_jax.accounting import format_bytes

    return format_bytes(n)


# ------------------------------------------------------------------------------------------------------ generate
def cmd_generate(args) -> int:
    import jax
    import jax.numpy as jnp

    from dsv4_jax.accounting import cache_bytes
    from dsv4_jax.checkpoint import load_pretrained
    from dsv4_jax.engine import generate_with_stats

    ckpt, embedded = _checkpoint_dir(args.checkpoint)
    prompts, tok = _text_prompts(args, ckpt)   # before the weights load: a missing tokenizer fails at once
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    model = load_pretrained(ckpt, dtype=dtype, attention_impl=args.attention_impl, progress=not embedded,
                            indexer_picks=args.indexer_picks, attention_kernel=args.attention_kernel,
                            expert_weights=args.expert_weights)
    cfg = model.config
    print(f"checkpoint: {ckpt}{' (embedded default, random weights)' if embedded else ''}")
    print(f"model: {cfg.summary()}")
    print(f"dtype: {args.dtype}, routed experts: {args.expert_weights}, device: {jax.devices()[0].platform} "
          f"({jax.devices()[0].device_kind})")
    eos_id, eos_from = args.eos_id, "--eos-id"
    if eos_id is _EOS_UNSET:   # token ids: no stop; text: the tokenizer's eos_token, else config.json's eos_token_id
        if tok is None:
            eos_id = None
        elif tok.eos_id is not None:
            eos_id, eos_from = tok.eos_id, "tokenizer_config.json"
        else:
            eos_id, eos_from = cfg.eos_token_id, "config.json"
    if tok is not None:
        print(f"tokenizer: {tok.path} ({tok.vocab_size:,} tokens; model vocab_size {cfg.vocab_size:,}); "
              f"bos {tok.bos_id if tok.add_bos else 'not added'}, stop at eos: "
              f"{'none' if eos_id is None else f'{eos_id} ({tok.token(eos_id)!r}, {eos_from})'}")
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_id=eos_id,
              max_len=args.max_len, kv_dtype=args.kv_dtype, indexer_dtype=args.indexer_dtype,
              indexer_rotate=args.indexer_rotate)
    compile_s = 0.0
    try:
        for _ in range(max(0, args.warmup)):  # untimed runs: compile + first-execution overheads
            compile_s += generate_with_stats(model, prompts, args.max_new_tokens, **kw)[1].compile_s
        tokens, st = generate_with_stats(model, prompts, args.max_new_tokens, **kw)
        compile_s += st.compile_s
    except ValueError as e:
        raise SystemExit(f"dsv4-jax: error: {e}")
    for i, (p, t) in enumerate(zip(prompts, tokens)):
        if tok is not None:
            print(f"[{i}] prompt text: {args.text[i]!r}")
        print(f"[{i}] prompt ({len(p)} tokens): {' '.join(map(str, p))}")
        print(f"[{i}] new tokens ({len(t)}): {' '.join(map(str, t))}")
        if tok is not None:
            print(f"[{i}] new text: {tok.decode(t)!r}")
    if args.max_new_tokens == 0:
        return 0
    print(f"compile: {compile_s:.2f} s (ahead-of-time, excluded from the rates below); timed run after "
          f"{args.warmup} untimed warm-up run(s) of the same request")
    print(f"prefill: {st.prefill_s * 1e3:.2f} ms for {st.batch_size} prompt(s) padded to {st.padded_prompt_len} "
          f"tokens ({st.prefill_tokens_per_s:,.0f} prompt tokens/s), incl. sampling the first new token")
    if st.decode_steps:
        print(f"decode: {st.decode_steps} steps x batch {st.batch_size} in {st.decode_s * 1e3:.2f} ms = "
              f"{st.step_ms:.3f} ms/step, {st.decode_tokens_per_s:,.1f} tokens/s "
              f"(one on-device while_loop, timed dispatch -> block_until_ready, incl. sampling)")
    else:
        print("decode: 0 steps (every row finished with its first token)")
    final = max(st.prompt_lengths) + max(st.new_tokens)
    cb = cache_bytes(cfg, final, st.batch_size, "bf16", "bf16")
    cf = cache_bytes(cfg, final, st.batch_size, "fp8", "fp8")
    rows = (f"kv {args.kv_dtype or args.dtype}, indexer {args.indexer_dtype or args.dtype}"
            f"{', Hadamard' if args.indexer_rotate else ''}")
    print(f"cache: allocated {_fmt(st.cache_bytes)} (capacity {st.max_len} tokens x batch {st.batch_size}, "
          f"{rows}); at {final} tokens the bf16 layout needs {_fmt(cb.total)}, the fp8 layout "
          f"{_fmt(cf.total)} (dense MLA bf16: {_fmt(cb.dense_mla)})")
    return 0


# ------------------------------------------------------------------------------------------------------ info
def info_text(cfg, context: int, batch_size: int = 1, source: str = "") -> str:
    from dsv4_jax.accounting import cache_bytes, kv_row_bytes, indexer_row_bytes, per_token_bytes
    from dsv4_jax.config import LAYER_TYPES

    lines = []
    if source:
        lines.append(f"source: {source}")
    lines.append(cfg.summary())
    counts = {t: cfg.layer_types.count(t) for t in LAYER_TYPES}
    sched = " ".join({"sliding": "S", "csa": "C", "hca": "H"}[t] for t in cfg.layer_types)
    lines.append(f"layer schedule (S=sliding, C=CSA, H=HCA): {sched}")
    lines.append(f"row formats: kv bf16 {kv_row_bytes(cfg, 'bf16')} B, kv fp8 {kv_row_bytes(cfg, 'fp8')} B; "
                 f"indexer bf16 {indexer_row_bytes(cfg, 'bf16')} B, fp8 {indexer_row_bytes(cfg, 'fp8')} B, "
                 f"fp4 {indexer_row_bytes(cfg, 'fp4')} B")
    lines.append("")
    lines.append(f"KV cache at context {context:,} tokens, batch {batch_size} "
                 f"(window ring + fp32 compressor states + compressed entries + indexer keys):")
    layouts = [("bf16", "bf16", "bf16 (kv bf16, indexer bf16)"), ("fp8", "fp8", "fp8 (kv fp8 584-style, indexer fp8)")]
    res = {name: cache_bytes(cfg, context, batch_size, kv, ix) for kv, ix, name in layouts}
    hdr = f"  {'layer type':<12}{'layers':>7}"
    for _, _, name in layouts:
        short = name.split(" ")[0]
        hdr += f"{short + ' total':>16}{short + ' B/token':>16}"
    lines.append(hdr)
    denom = max(1, context * batch_size)
    for t in LAYER_TYPES:
        row = f"  {t:<12}{counts[t]:>7}"
        for _, _, name in layouts:
            b = res[name].by_type[t].total
            row += f"{_fmt(b):>16}{b / denom:>16,.2f}"
        lines.append(row)
    row = f"  {'total':<12}{cfg.num_hidden_layers:>7}"
    for _, _, name in layouts:
        b = res[name].total
        row += f"{_fmt(b):>16}{b / denom:>16,.2f}"
    lines.append(row)
    row = f"  {'dense MLA':<12}{cfg.num_hidden_layers:>7}"
    for _, _, name in layouts:
        b = res[name].dense_mla
        row += f"{_fmt(b):>16}{b / denom:>16,.2f}"
    lines.append(row)
    lines.append(f"  (dense MLA = one {cfg.head_dim}-dim latent row per token per layer, every token of every layer, "
                 f"same row format, no window / compression)")
    for _, _, name in layouts:
        r = res[name]
        lines.append(f"  {name}: {r.dense_mla / max(1, r.total):.2f}x smaller than dense MLA")
    lines.append("")
    lines.append("long-context bytes per token (compressed KV + indexer keys, excluding windows and states; spec §4.5):")
    for kv, ix in (("bf16", "bf16"), ("fp8", "fp8"), ("fp8", "fp4")):
        lines.append(f"  kv {kv:<4} indexer {ix:<4}: {per_token_bytes(cfg, kv, ix):,.4f} B/token")
    return "\n".join(lines)


def cmd_info(args) -> int:
    from dsv4_jax.config import PRESETS

    if args.preset and args.checkpoint:
        raise SystemExit("dsv4-jax: error: give --checkpoint or --preset, not both")
    if args.preset:
        cfg = PRESETS[args.preset]()
        source = f"preset {args.preset}"
    else:
        ckpt, embedded = _checkpoint_dir(args.checkpoint)
        cfg = _load_config(ckpt)
        source = f"{ckpt}/config.json" + (" (embedded default)" if embedded else "")
    if args.context < 1 or args.batch_size < 1:
        raise SystemExit("dsv4-jax: error: --context and --batch-size must be >= 1")
    print(info_text(cfg, args.context, args.batch_size, source))
    return 0


# ------------------------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    from dsv4_jax.config import PRESETS

    p = argparse.ArgumentParser(prog="dsv4-jax", description="DeepSeek-V4 in JAX: generation and model info.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate tokens from token-id or text prompts")
    g.add_argument("--checkpoint", help="checkpoint directory (default: the embedded tiny model)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", type=_parse_prompt,
                     help='token ids, e.g. "1 2 3"; repeat for a batch of prompts')
    src.add_argument("--text", action="append",
                     help="a text prompt, encoded by the checkpoint's tokenizer.json; repeat for a batch")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer.json, or a directory holding it, for --text (default: the checkpoint directory)")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--eos-id", type=_parse_eos, default=_EOS_UNSET,
                   help="stop a row after this token; 'none' never stops early (default: none for --prompt; for "
                        "--text the tokenizer's eos_token, else config.json's eos_token_id)")
    g.add_argument("--max-len", type=int, default=None, help="cache capacity in tokens (default: bucketed)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    g.add_argument("--kv-dtype", choices=("bf16", "fp8"), default=None,
                   help="KV cache rows: default exact (model dtype); fp8 = 584-byte production layout")
    g.add_argument("--indexer-dtype", choices=("bf16", "fp8", "fp4"), default=None,
                   help="indexer key cache rows: default exact (model dtype)")
    g.add_argument("--indexer-rotate", action="store_true", help="Walsh-Hadamard rotation of indexer q/k")
    g.add_argument("--warmup", type=int, default=1,
                   help="untimed runs of the same request before the timed one (default 1; same tokens each run)")
    g.add_argument("--attention-impl", choices=("auto", "reference", "pallas"), default="auto",
                   help="sparse attention implementation (auto: Pallas kernel where available, else reference)")
    g.add_argument("--attention-kernel", choices=("auto", "mosaic", "triton"), default="auto",  # GPU_KERNELS
                   help="GPU sparse-attention kernel: auto (Mosaic GPU for bf16 models with 64 or 128 heads and bf16 "
                        "caches, else Triton), mosaic, triton")
    g.add_argument("--indexer-picks", choices=("auto", "sorted", "set"), default="auto",  # PICKS; no jax at parse
                   help="order of the CSA indexer's picks: sorted (best first, as the reference), set (ascending "
                        "index; the GPU top-k skips its last sort) or auto (set on the GPU kernel path, else sorted)")
    g.add_argument("--expert-weights", choices=("dequantized", "fp4"), default="dequantized",  # EXPERT_WEIGHTS
                   help="routed experts held dequantized in --dtype (default) or as the checkpoint's FP4 bytes "
                        "(3.8x less memory; DeepSeek-layout checkpoints with FP4 experts)")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="config summary and KV-cache bytes")
    i.add_argument("--checkpoint", help="checkpoint directory (reads config.json only)")
    i.add_argument("--preset", choices=sorted(PRESETS), help="a built-in config instead of a checkpoint")
    i.add_argument("--context", type=int, default=1 << 20, help="context length in tokens (default 1048576)")
    i.add_argument("--batch-size", type=int, default=1)
    i.set_defaults(func=cmd_info)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
