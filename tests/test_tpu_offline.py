"""Every Pallas TPU kernel configuration, and the embedded model's prefill / decode step on them, compiles with
libtpu for a v6e topology (benchmarks/tpu_offline.py).

Lowering (tests/test_tpu_lowering.py, in CI) runs Pallas' Python side only; Mosaic's compiler in libtpu enforces
more (session 50 found the attention kernel's single-row DMAs of bf16 / e4m3 rows and its bool selects, and the
indexer's fp32 contract precision on bf16 operands, all rejected there). libtpu compiles ahead of time for a
described topology on a CPU host, but installing it changes how jax starts, so it lives in its own environment:

    python3 -m venv /tmp/tpuvenv && /tmp/tpuvenv/bin/pip install "jax[tpu]==<this jax>" pytest -e .
    PYTHONPATH=.:tests /tmp/tpuvenv/bin/python -m pytest tests/test_tpu_offline.py

Skipped wherever libtpu is not installed (CI, the project's own environment).
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed (see this module's docstring)", allow_module_level=True)

from benchmarks import tpu_offline  # noqa: E402  (sets libtpu's start-up variables before jax starts it)

_CASES = tpu_offline.cases() + tpu_offline.model_cases()   # every kernel config, then the whole embedded model


@pytest.fixture(scope="module")
def v6e():
    tpu_offline.register_cpu_as("v6e")
    return tpu_offline.topology_device("v6e:2x2")


@pytest.mark.parametrize("case", range(len(_CASES)), ids=[c[0] for c in _CASES])
def test_kernel_compiles_with_libtpu(v6e, case):
    name, fn, args = _CASES[case]
    compiled = tpu_offline.compile_for(v6e, fn, *args)
    assert compiled.memory_analysis() is not None, name


_ENGINE = tpu_offline.engine_cases(flash=False)   # the engine's programs for the embedded model, both cache layouts


@pytest.mark.parametrize("case", range(len(_ENGINE)), ids=[c[0] for c in _ENGINE])
def test_engine_program_compiles_with_libtpu(v6e, case):
    name, fn, args, layouts = _ENGINE[case]
    compiled = tpu_offline.compile_engine_case(v6e, fn, args, layouts)
    assert compiled.memory_analysis() is not None, name


def test_kernel_layouts_keep_the_fp8_pools_out_of_the_decode_loops_copies(v6e):
    """V4-Flash's first four layers, FP8 KV + fp4 indexer keys, B = 8 at 32K tokens: in XLA's default layouts the
    decode loop relays the cache's pools out twice a step (96 MB a step, session 51); in the kernels' layouts
    (`dsv4_jax.cache.cache_layouts`) what is left a step is activations and compressor states (34 MB in session 51,
    13 MB with session 52's q / o pins). ~2 min."""
    cases = {c[0]: c for c in tpu_offline.engine_cases(flash=True) if "flash4_decode_fp8kv" in c[0]}
    loop = {}
    for name, (_, fn, args, layouts) in cases.items():
        text = tpu_offline.compile_engine_case(v6e, fn, args, layouts).as_text()
        loop[name.rsplit("_", 1)[1]] = tpu_offline.relayout_copies(text)["loop"]
    assert loop["kernel"] < 0.5 * loop["xla"], loop


def test_row_major_pins_halve_a_prefill_chunks_relayouts(v6e, monkeypatch):
    """One V4-Flash CSA attention layer, a B = 8 x 512-token prefill chunk (FP8 KV, fp4 keys): XLA's TPU layout
    assignment kept S minor along the q / o chain and relaid each [B, S, 64, 512] tensor out into and out of the
    kernel (3.18 GB, session 52); the layer's row-major pins (`dsv4_jax.layers.common.pin_row_major`) cut that at
    least to 0.7x. ~4 min (two compiles)."""
    import dsv4_jax.layers.attention as attention_layer

    def relayouts():
        (name, fn, args, layouts), = [c for c in tpu_offline.layer_cases() if "_csa_prefill" in c[0]]
        return tpu_offline.relayout_copies(tpu_offline.compile_engine_case(v6e, fn, args, layouts).as_text())["total"]

    pinned = relayouts()
    monkeypatch.setattr(attention_layer, "pin_row_major", lambda x, active: x)
    unpinned = relayouts()
    assert pinned < 0.7 * unpinned, (pinned, unpinned)


@pytest.mark.parametrize("key_fmt", ["fp4", "fp8"])
def test_indexer_prefill_relays_q_out_only_into_its_chunks(v6e, key_fmt):
    """The V4-Flash CSA layer's indexer alone over a B = 8 x 512-query prefill chunk (two 256-query chunks): q's
    projection written per head (`matmul_heads`), the chunks sliced where q lies (`chunking.map_query_chunks`) and,
    for fp4 keys, q's fake quantization and even / odd split inside the kernel. Outside the chunk loop XLA relaid
    out 848 MB (fp4) / 362 MB (fp8) before session 53; now only small arrays. Inside it, per 256-query chunk: at
    most the chunk's q and lax.top_k's three full-size copies (XLA's TPU sort works with the rows on the lanes).
    ~15 s."""
    (name, fn, args, layouts), = [c for c in tpu_offline.layer_cases() if c[0].endswith(f"indexer_8x512_{key_fmt}idx")]
    copies = tpu_offline.relayout_copies(tpu_offline.compile_engine_case(v6e, fn, args, layouts).as_text())
    chunk_scores = 8 * 256 * 8192 * 4
    assert copies["entry"] < 32e6, copies
    assert copies["loop"] <= 4 * chunk_scores + 1e6, copies
