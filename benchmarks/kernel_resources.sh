#!/usr/bin/env bash
# Registers / spills / shared memory of the compiled Pallas-Triton kernels (H200 diagnostic). jax >= 0.11 compiles a
# Pallas-Triton kernel to PTX in Python (jax._src.lib.triton.compile); this script wraps that call to keep each
# kernel's PTX, compiles the decode sparse-attention kernel (B = 64; bf16 / FP8 pools, a few configs), the indexer
# scores kernel (bf16 / fp8 / fp4 keys) and the top-k kernels, then runs `ptxas -v` (sm_90a) on every PTX. jax 0.11.2
# (H200 session 5) exposed no such Python call (nothing captured), so XLA's dump is searched for PTX as well.
#   device run:  OUT=$OUT bash benchmarks/kernel_resources.sh      (writes $OUT/kernel_resources.log)
set -o pipefail
OUT=${OUT:-/tmp/kres}; D=$OUT/ptx; X=/tmp/kres_xla_dump; mkdir -p "$D" "$X"
export PYTHONPATH=.:tests XLA_PYTHON_CLIENT_PREALLOCATE=false PTX_DIR=$D
XLA_FLAGS="--xla_dump_to=$X" timeout 250 python3 - <<'EOF' 2>&1 | grep -v -i warning | tail -40
import os, re
import jax, jax.numpy as jnp
import jax._src.pallas.triton.pallas_call_registration as R

D = os.environ["PTX_DIR"]
tag = {"v": "x"}


def wrap(orig):
    def capture(platform, ir, arch, *a, **kw):
        res = orig(platform, ir, arch, *a, **kw)
        m = re.search(r"\.entry\s+(\w+)", res.asm)
        name = f"{tag['v']}__{m.group(1) if m else 'kernel'}_w{kw.get('num_warps')}_s{kw.get('num_stages')}"
        with open(os.path.join(D, name + ".ptx"), "w") as f:
            f.write(res.asm)
        print(f"{name}: smem {res.smem_bytes} B", flush=True)
        return res
    return capture


# the module object(s) through which the registration calls `<triton module>.compile` (its import name differs
# between jax versions): patch the attribute on each, so the call-time lookup finds the wrapper
import importlib, sys
try:
    importlib.import_module("jax._src.lib.triton")
except ImportError:
    pass
mods = {id(o): o for o in list(vars(R).values()) + list(sys.modules.values())
        if o is not None and callable(getattr(o, "compile", None)) and "triton" in getattr(o, "__name__", "")
        and getattr(o, "__name__", "").startswith(("jax", "jaxlib"))}
print("patched:", [m.__name__ for m in mods.values()] or sorted(k for k in vars(R) if not k.startswith("__")))
for m in mods.values():
    m.compile = wrap(m.compile)
from test_sparse_attention import make_inputs, call
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.indexer import formats
from pallas_kernels.indexer.gpu import indexer_topk_gpu

attn = [("bf16", False, {}), ("bf16_nw16", False, dict(num_warps=16)), ("bf16_dc256", False, dict(d_chunk=256)),
        ("bf16_bk32s4", False, dict(block_k=32, num_stages=4)), ("fp8", True, {}),
        ("fp8_f16", True, dict(fp8_operands="f16")), ("fp8_nw16", True, dict(num_warps=16))]
for v, fp8, opts in attn:
    tag["v"] = "attn_" + v
    inp = make_inputs(64, 1, 64, 512, 64 * 128, 64 * 600, 128, 512, fp8=fp8)
    try:
        jax.block_until_ready(call(sparse_attention, inp, impl="pallas", **opts))
    except Exception as e:  # noqa: BLE001
        print(v, "failed:", repr(e)[:300])
B, T, H, dI = 64, 32768, 64, 128
for fmt in ("bf16", "fp8", "fp4"):
    tag["v"] = "idx_" + fmt
    keys = formats.quantize(jax.random.normal(jax.random.key(0), (B, T, dI)), fmt)
    q = formats.fake_quantize(jax.random.normal(jax.random.key(1), (B, 1, H, dI)), fmt)
    w = jax.random.normal(jax.random.key(2), (B, 1, H))
    jax.block_until_ready(indexer_topk_gpu(q, w, keys, jnp.full((B, 1), T, jnp.int32), k=512))
print("compiled", len(os.listdir(D)), "kernels")
EOF
PTXAS=$(command -v ptxas || ls /usr/local/cuda/bin/ptxas 2>/dev/null || find / -name ptxas -type f 2>/dev/null | head -1)
echo "ptxas: $PTXAS"
echo "xla dump: $(ls "$X" | wc -l) files; suffixes:"; ls "$X" | sed 's/.*\.//' | sort | uniq -c | sort -rn | head -12
# PTX modules in XLA's dump that hold one of our kernels (by its pallas_call name)
for f in $(grep -l -E "^\.visible \.entry|^\.entry" "$X"/* 2>/dev/null); do
  grep -q -E "sparse_attn|indexer|topk|compress" "$f" && cp "$f" "$D/xla__$(basename "$f").ptx"
done
{
for f in "$D"/*.ptx; do
  [ -f "$f" ] || continue
  arch=$(grep -m1 -o "sm_90a\|sm_90" "$f"); arch=${arch:-sm_90a}
  info=$("$PTXAS" -arch=$arch -v "$f" -o /dev/null 2>&1 | grep -E "registers|spill" | tr '\n' ' ')
  echo "$(basename "$f" .ptx): $info"
done
} > "$OUT/kernel_resources.log" 2>&1
cat "$OUT/kernel_resources.log"
rm -rf "$X"

