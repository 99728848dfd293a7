"""Builds the embedded default checkpoint: dsv4_jax/assets/tiny-v4/ (config.json + model.safetensors).

A small DeepSeek-V4-architecture model (`dsv4_jax.config.tiny()`: sliding, CSA and HCA layers, Lightning Indexer,
hash + learned MoE, mHC) with deterministic random weights (`nnx.Rngs(SEED)`), written in DeepSeek's ORIGINAL layout
(FP8 e4m3 + ue8m0 block scales, FP4 e2m1 routed experts, bf16/f32 elsewhere) by the checkpoint writer. Rerunning the
script reproduces the same bytes.

    python scripts/build_embedded_model.py [--out DIR] [--seed 0] [--check]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

SEED = 0


def build(out: str, seed: int = SEED) -> dict[str, str]:
    import jax.numpy as jnp
    from flax import nnx

    from dsv4_jax.checkpoint.writer import save_deepseek_checkpoint
    from dsv4_jax.config import tiny
    from dsv4_jax.model import DeepseekV4ForCausalLM

    config = tiny()
    model = DeepseekV4ForCausalLM(config, dtype=jnp.float32, attention_impl="reference", rngs=nnx.Rngs(seed))
    save_deepseek_checkpoint(model, config, out, quantize=True)
    digests = {}
    for f in sorted(os.listdir(out)):
        with open(os.path.join(out, f), "rb") as fh:
            digests[f] = hashlib.sha256(fh.read()).hexdigest()
    return digests


def main(argv=None) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    default_out = os.path.join(root, "dsv4_jax", "assets", "tiny-v4")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=default_out)
    p.add_argument("--seed", type=int, default=SEED)
    args = p.parse_args(argv)
    sys.path.insert(0, root)
    digests = build(args.out, args.seed)
    total = 0
    for f, d in digests.items():
        size = os.path.getsize(os.path.join(args.out, f))
        total += size
        print(f"{f:<24} {size:>10,} B  sha256 {d}")
    print(f"wrote {args.out} ({total:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
