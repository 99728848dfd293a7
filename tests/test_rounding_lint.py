"""No narrowing float round trip that XLA's GPU compiler could fold away in the model's jitted programs.

Under jit, XLA GPU (`--xla_allow_excess_precision`, on by default) rewrites convert(convert(x: f32) -> narrower)
-> f32 to x. Code that means to round (the indexer q's fake quantization, the FP8 KV rows' bf16 step, the bf16x2
split) must round by bit arithmetic or behind an optimization barrier, or the GPU silently skips the rounding, in
some programs and not others: it broke the bf16x2 split in session 4 and the fp8-indexer model test in sessions
20-21 (results/README_indexer_compressor.md). This
lowers the prefill and decode programs on the CPU (StableHLO, before any backend pass) and looks for direct
convert chains wide -> narrow -> wide. The f32 model has none. The bf16 model keeps its intended f32 -> bf16 -> f32
activation casts (RMSNorm, hyper-connections, RoPE outputs in the model dtype: excess precision there is harmless),
but no chain through anything narrower than bf16.
"""

import re

import jax.numpy as jnp
import pytest
from flax import nnx

from dsv4_jax.config import tiny
from dsv4_jax.model import DeepseekV4ForCausalLM, _jitted_chunk_impl
from tiers import full_tier

_CONVERT = re.compile(r"\s*(%[\w#.]+) = stablehlo\.convert (%[\w#.]+) : \(tensor<([^>]*)>\) -> tensor<([^>]*)>")


def round_trips(stablehlo: str):
    """[(wide, narrow)] for every direct convert chain wide float -> narrower float -> the same wide float."""
    made = {}
    found = []
    for line in stablehlo.splitlines():
        m = _CONVERT.match(line)
        if not m:
            continue
        res, src, t_in, t_out = m.groups()
        t_in, t_out = t_in.split("x")[-1], t_out.split("x")[-1]
        made[res] = (t_in, t_out)
        if src in made and made[src] == (t_out, t_in) and t_out.startswith("f") and t_in != t_out:
            found.append((t_out, t_in))
    return found


@full_tier   # ~35 s a case (lowering the whole model); the CPU / GPU fake-quantize tests stay in the default tier
@pytest.mark.parametrize("dtype,kv,idx", [(jnp.float32, "fp8", "fp8"), (jnp.float32, None, "fp4"),
                                          (jnp.bfloat16, "fp8", "fp8"), (jnp.bfloat16, "bf16", "fp4")])
def test_no_foldable_narrowing_round_trip(dtype, kv, idx):
    cfg = tiny(head_dim=512, qk_rope_head_dim=64, index_head_dim=64)
    model = DeepseekV4ForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype, attention_impl="reference")
    cache = model.init_cache(2, 32, kv_dtype=kv, indexer_dtype=idx, indexer_rotate=True)
    graphdef, state = nnx.split(model)
    for S in (12, 1):   # prefill, decode
        text = _jitted_chunk_impl.lower(graphdef, state, cache, jnp.zeros((2, S), jnp.int32),
                                        jnp.full((2,), S, jnp.int32)).as_text()
        chains = round_trips(text)
        if dtype == jnp.float32:
            assert not chains, f"S={S}: foldable round trips {sorted(set(chains))}"
        else:
            assert all(narrow == "bf16" for _, narrow in chains), f"S={S}: {sorted(set(chains))}"
            assert chains, "the bf16 model's activation casts were expected (is the parser still matching?)"


def test_the_lint_sees_an_unprotected_round_trip():
    import jax

    from pallas_kernels.indexer import formats as F

    unprotected = jax.jit(lambda x: F.dequantize(F.quantize(x, "fp8"), jnp.float32)).lower(jnp.ones((4, 128)))
    assert round_trips(unprotected.as_text()) == [("f32", "f8E4M3FN")]
    assert round_trips(jax.jit(lambda x: F.fake_quantize(x, "fp8")).lower(jnp.ones((4, 128))).as_text()) == []
