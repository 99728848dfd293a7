"""benchmarks/mosaic_offline.py: Mosaic GPU kernels compiled for sm_90a without a GPU.

The parsers and the occupancy arithmetic run everywhere. The compile tests need jax's CUDA plugin wheels
(`python benchmarks/mosaic_offline.py fetch`, ~130 MB), gcc and nm; they skip where those are missing (CI). Where
they run they guard the fp4 indexer kernels' register budget: the converter warpgroup's 256-thread CTAs must stay
at <= 128 registers and spill nothing, or an SM holds one CTA instead of two.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import pytest

from benchmarks import mosaic_offline as mo
from tiers import full

PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'indexer_scores_fp4_mosaic_fp8_t128_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for indexer_scores_fp4_mosaic_fp8_t128_mosaic_gpu_kernel
    24 bytes stack frame, 16 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 134 registers, used 2 barriers, 1 bytes smem
"""


def test_parse_ptxas_log():
    info = mo.parse_ptxas_log(PTXAS_LOG)
    assert info == dict(name="indexer_scores_fp4_mosaic_fp8_t128_mosaic_gpu_kernel", registers=134, stack_bytes=24,
                        spill_stores=16, spill_loads=20)
    with pytest.raises(ValueError, match="not a ptxas -v log"):
        mo.parse_ptxas_log("ptxas info    : 0 bytes gmem\n")


def test_wgmma_serialization_notes_are_found():
    """ptxas' wgmma serialization note (what session 72's loop-carried accumulators drew) is read from the log."""
    log = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
           "non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline "
           "stage in the function 'k'\n" + PTXAS_LOG)
    r = mo.KernelResources(name="k", registers=128, spill_stores=0, spill_loads=0, stack_bytes=0, threads=512,
                           shared_bytes=1024, setmaxnreg=(), ptxas_log=log, ptx_path=None, cubin_path=None,
                           sass_path=None)
    assert r.wgmma_serialized == ["C7514"] and "wgmma serialized (C7514)" in r.line()
    assert dataclasses.replace(r, ptxas_log=PTXAS_LOG).wgmma_serialized == []


def test_ptx_threads_and_register_budgets():
    ptx = (".visible .entry k(\n)\n.maxntid 384, 1, 1\n.minnctapersm 1\n{\n"
           "\tsetmaxnreg.dec.sync.aligned.u32 \t56;\n\tsetmaxnreg.inc.sync.aligned.u32 \t224;\n}")
    assert mo.ptx_threads(ptx) == 384
    assert mo.ptx_setmaxnreg(ptx) == (56, 224)
    assert mo.ptx_threads(".reqntid 128, 2, 1") == 256
    with pytest.raises(ValueError, match="maxntid"):
        mo.ptx_threads(".entry k()")


@pytest.mark.parametrize("regs, threads, smem, ctas", [
    (134, 128, 48168, 3),      # fp4 scores alone: 136 x 128 registers -> 3 CTAs; 48 KB of shared memory -> 4
    (139, 128, 81952, 2),      # under the segment top-k: shared memory allows 2
    (96, 256, 106552, 2),      # the converter warpgroup's CTA: 2 by shared memory (and 2 by registers)
    (129, 256, 60000, 1),      # one register over 128 at 256 threads: 136 x 256 x 2 > 64K
    (168, 384, 230456, 1),     # the attention kernel: one CTA fills the SM
    (32, 64, 0, 32),           # the CTA cap
])
def test_ctas_per_sm(regs, threads, smem, ctas):
    r = mo.KernelResources(name="k", registers=regs, spill_stores=0, spill_loads=0, stack_bytes=0, threads=threads,
                           shared_bytes=smem, setmaxnreg=(), ptxas_log="", ptx_path=None, cubin_path=None,
                           sass_path=None)
    assert r.ctas_per_sm == ctas
    assert f"-> {ctas} CTA(s) an SM" in r.line()


def _offline_or_skip(tmp_path):
    try:
        mo.plugin_paths()
    except FileNotFoundError:
        pytest.skip("jax's CUDA plugin wheels not fetched (python benchmarks/mosaic_offline.py fetch)")
    for tool in ("gcc", "nm"):
        if not shutil.which(tool):
            pytest.skip(f"no {tool}")
    try:
        mo.default_cuda_root()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    if "compiler" not in _COMPILER:
        _COMPILER["compiler"] = mo.OfflineMosaic(str(tmp_path))
    return _COMPILER["compiler"]


_COMPILER: dict = {}   # one per process: the plugin and the stand-in driver stay loaded


def _indexer_args(fmt, B=64, T=32768, H=64):
    """The indexer kernels' decode inputs as shapes only (q, w, keys in `fmt`, n_visible); default V4-Flash decode
    at 128K context."""
    from pallas_kernels.indexer import formats as F

    sds = jax.ShapeDtypeStruct
    return (sds((B, 1, H, 128), jnp.float32), sds((B, 1, H), jnp.float32),
            jax.eval_shape(lambda k: F.quantize(k, fmt), sds((B, T, 128), jnp.float32)), sds((B, 1), jnp.int32))


def _segment_set_kernel(compiler, monkeypatch, fmt="fp4", precision=None, B=64, T=32768, **mosaic_config):
    """The offline compile of the segment top-k pipeline's Mosaic scores kernel (k = 512) over `fmt` keys at B rows
    x T keys, with these MOSAIC_CONFIG entries set (a new function each call: jit's trace cache does not see
    MOSAIC_CONFIG)."""
    from pallas_kernels.indexer import gpu_mosaic
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    for name, value in mosaic_config.items():
        monkeypatch.setitem(gpu_mosaic.MOSAIC_CONFIG, name, value)
    kw = {} if precision is None else dict(precision=precision)
    (r,) = compiler.compile_jitted(lambda *a: indexer_topk_gpu(*a, k=512, kernel="mosaic", topk="segment_set", **kw),
                                   *_indexer_args(fmt, B=B, T=T))
    return r


def test_offline_compile_of_a_pallas_kernel(tmp_path):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    compiler = _offline_or_skip(tmp_path)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    fn = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 128), jnp.float32),
                        compiler_params=plgpu.CompilerParams())
    (r,) = compiler.compile_jitted(fn, jax.ShapeDtypeStruct((64, 128), jnp.float32))
    assert r.threads == 128 and r.registers > 0 and r.spill_stores == 0
    assert r.shared_bytes >= 2 * 64 * 128 * 4          # the input and output blocks
    assert os.path.getsize(r.cubin_path) > 0 and open(r.cubin_path, "rb").read(4) == b"\x7fELF"


@pytest.mark.parametrize("converter, tables, select", [(2, "registers", True), (2, "shared", True),
                                                       (1, "registers", False), (2, "registers", False),
                                                       (2, "rows", True), (1, "rows", False)])
def test_fp4_converter_kernels_fit_two_ctas_an_sm(tmp_path, converter, tables, select):
    from pallas_kernels.indexer import gpu_mosaic
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    compiler = _offline_or_skip(tmp_path)
    saved = dict(gpu_mosaic.MOSAIC_CONFIG)
    rows = tables == "rows"   # fp4_layout "rows" (session 50)
    gpu_mosaic.MOSAIC_CONFIG.update(fp4_converter=converter, fp4_tables="registers" if rows else tables,
                                    fp4_layout="rows" if rows else "fragments")
    try:
        if select:
            fn = lambda *a: indexer_topk_gpu(*a, k=512, kernel="mosaic", topk="segment_set", precision="fp8")
        else:
            fn = lambda *a: gpu_mosaic.indexer_scores_mosaic(*a, precision="fp8")
        (r,) = compiler.compile_jitted(fn, *_indexer_args("fp4"))
    finally:
        gpu_mosaic.MOSAIC_CONFIG.update(saved)
    assert f"_cv{converter}" in r.name and ("_rows" in r.name) == rows
    assert r.threads == 256
    assert r.spill_stores == 0 and r.spill_loads == 0, r.ptxas_log
    assert r.registers <= 128, r.line()
    assert r.ctas_per_sm == 2, r.line()


def test_profiled_fp4_segment_kernel_keeps_two_ctas_an_sm(tmp_path, monkeypatch):
    """benchmarks/indexer_phase_profile.py profiles fp4 at B = 64 x 128K: its records (MOSAIC_CONFIG["profile"])
    must leave the segment top-k's kernel at 2 CTAs an SM, or the profile shows another schedule than the timed
    one (session 74: 115000 B of shared memory, 112 registers)."""
    compiler = _offline_or_skip(tmp_path)
    monkeypatch.setattr(jax.debug, "callback", lambda *a, **k: None)   # the trace's dump (a host callback)
    r = _segment_set_kernel(compiler, monkeypatch, profile=str(tmp_path / "traces"))
    assert "_cv2_rows" in r.name and r.spill_stores == 0 and r.registers <= 128, r.line()
    assert r.ctas_per_sm == 2, r.line()


SASS = """
.text.k:
   -:-:-:Y:01        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
   -:-:1:Y:04        /*0010*/                   LDS.128 R4, [R2] ;
   1:-:-:Y:02        /*0020*/                   PRMT R5, R4, R6, R7 ;
   -:-:-:Y:01        /*0030*/                   STS.128 [R3], R4 ;
   -:-:-:Y:05        /*0040*/              @!P0 BRA `(.L_x_1) ;
.L_x_2:
   -:-:-:Y:01        /*0050*/                   QGMMA.64x64x32.F32.E5M2.E5M2 R8, gdesc[UR4], R8 ;
   -:-:-:Y:02        /*0060*/                   FMNMX.NAN R9, R8, RZ, !PT ;
   -:-:-:Y:05        /*0070*/               @P1 BRA `(.L_x_2) ;
   -:-:-:Y:05        /*0080*/                   EXIT ;
"""


def test_sass_loops_finds_the_block_loops():
    from benchmarks.sass_loops import block_loops, loops, parse

    instructions, labels = parse(SASS)
    assert len(instructions) == 9 and labels == {".L_x_1": 0x10, ".L_x_2": 0x50}
    found = loops(instructions, labels)
    assert [(lp.start, lp.end, len(lp.body), lp.stall_cycles) for lp in found] == [(0x10, 0x40, 4, 12),
                                                                                    (0x50, 0x70, 3, 8)]
    assert found[0].histogram()["BRA"] == 1     # a predicated opcode counts as its opcode
    blocks = block_loops(instructions, labels)
    assert blocks["converter"].start == 0x10 and blocks["scores"].start == 0x50


def test_fp4_segment_kernel_barriers_a_block(tmp_path, monkeypatch):
    """Session 74's two orderings of the fp4 converter path under the segment top-k, offline (SASS of the per-block
    loops). seg_sync "barrier": the scorer orders its segment scores with one warpgroup barrier and no fence
    ("commit": Pallas' bracketed store and commit_smem, 3 barriers and the fence). conv_sync "arrive": the converter
    fences its stores and arrives with no warpgroup barrier and issues no copy (the scorer issues the key copies,
    each behind Pallas' own barrier); "commit": commit_smem, then the two copies, 3 barriers; "early" (session 75):
    the two copies right after the conversion, then the fence and the arrival, 2 barriers. seg_hist "converter"
    (session 75): the converter counts the streamed histogram."""
    from benchmarks.sass_loops import block_loops, parse

    compiler = _offline_or_skip(tmp_path)
    if not compiler.nvdisasm:
        pytest.skip("no nvdisasm (python benchmarks/mosaic_offline.py fetch unpacks one)")
    ops = ("BAR.SYNC.DEFER_BLOCKING", "MEMBAR.ALL.CTA", "UTMALDG.4D")
    counts = {}
    for seg_sync, conv_sync, seg_hist in (("barrier", "arrive", "scorer"), ("barrier", "commit", "scorer"),
                                          ("commit", "commit", "scorer"), ("barrier", "early", "scorer"),
                                          ("barrier", "commit", "converter"), ("barrier", "early", "converter")):
        r = _segment_set_kernel(compiler, monkeypatch, B=8, T=4096, seg_sync=seg_sync, conv_sync=conv_sync,
                                seg_hist=seg_hist)
        assert r.spill_stores == 0 and r.registers <= 128 and r.ctas_per_sm >= 2, r.line()
        loops = block_loops(*parse(open(r.sass_path).read()))
        counts[seg_sync, conv_sync, seg_hist] = {role: tuple(lp.histogram()[op] for op in ops)
                                                 for role, lp in loops.items()}
    # (barriers, memory fences, key copies) a block
    assert counts["barrier", "commit", "scorer"] == dict(scores=(1, 0, 0), converter=(3, 1, 1)), counts
    assert counts["commit", "commit", "scorer"] == dict(scores=(3, 1, 0), converter=(3, 1, 1)), counts
    assert counts["barrier", "arrive", "scorer"] == dict(scores=(3, 0, 1), converter=(0, 1, 0)), counts
    # "early" (session 75): the converter's two copies behind Pallas' barrier each, no commit_smem barrier
    assert counts["barrier", "early", "scorer"] == dict(scores=(1, 0, 0), converter=(2, 1, 1)), counts
    # seg_hist "converter" (session 75): the scorer's loop has no barrier left (its scores go over by mbarrier
    # arrivals), the converter's the same as without it (the histogram waits on an mbarrier)
    assert counts["barrier", "commit", "converter"] == dict(scores=(0, 0, 0), converter=(3, 1, 1)), counts
    assert counts["barrier", "early", "converter"] == dict(scores=(0, 0, 0), converter=(2, 1, 1)), counts


@pytest.mark.parametrize("B,T", [(64, 131072), full(64, 1 << 20), full(16, 131072)])
def test_two_warpgroup_selection_compiles_at_two_ctas_an_sm(tmp_path, monkeypatch, B, T):
    """select_wgs 2 (session 76): the fp4 segment top-k kernel whose converter warpgroup joins the selection keeps
    2 CTAs an SM without spills, and its selection syncs the pair barrier over both warpgroups (ptxas: barrier 15,
    256 threads), no longer barrier 1 over the scorer's 128."""
    from pallas_kernels.indexer.mosaic_select import PAIR_BARRIER

    compiler = _offline_or_skip(tmp_path)
    if not compiler.nvdisasm:
        pytest.skip("no nvdisasm (python benchmarks/mosaic_offline.py fetch unpacks one)")
    r = _segment_set_kernel(compiler, monkeypatch, B=B, T=T, seg_hist="converter", conv_sync="early", select_wgs=2)
    assert r.name.endswith("_hcv_s2_mosaic_gpu_kernel") and r.threads == 256, r.line()
    assert r.spill_stores == 0 and r.registers <= 128 and r.ctas_per_sm == 2, r.line()
    bars = {line.split("BAR.SYNC.DEFER_BLOCKING")[1].split(";")[0].strip()
            for line in open(r.sass_path).read().splitlines() if "BAR.SYNC.DEFER_BLOCKING" in line}
    assert f"{PAIR_BARRIER:#x}, 0x100" in bars and "0x1, 0x80" not in bars, bars


@pytest.mark.parametrize("fmt,options", [("fp4", {}), full("fp4", dict(seg_hist="converter", conv_sync="early",
                                                                       select_wgs=2)),
                                         ("fp8", {}), full("fp8", dict(precision="fp8"))])
def test_fused_q_prep_compiles_at_two_ctas_an_sm(tmp_path, monkeypatch, fmt, options):
    """q_prep "fused" (session 76): the kernel whose scorer prepares its row's q from global memory (64 values a
    thread in the WGMMA layout) keeps 2 CTAs an SM at B = 64 x 128K without spills (fp4: 106 registers, alone and
    with session 75-76's converter options; fp8 keys at either precision)."""
    compiler = _offline_or_skip(tmp_path)
    r = _segment_set_kernel(compiler, monkeypatch, fmt, **options, q_prep="fused")
    assert r.name.endswith("_qf_mosaic_gpu_kernel"), r.line()
    assert r.spill_stores == 0 and r.ctas_per_sm == 2, r.line()   # (fp8: one warpgroup, up to 255 registers)


def test_fp4_rows_layout_issues_fewer_converter_instructions(tmp_path):
    """fp4_layout "rows" (session 50) against the fragment layout, offline: the converter loop's SASS a block (437
    -> 290 with ptxas 12.8 / 13.0 when measured), under the segment top-k."""
    from benchmarks.sass_loops import block_loops, parse
    from pallas_kernels.indexer import gpu_mosaic
    from pallas_kernels.indexer.gpu import indexer_topk_gpu

    compiler = _offline_or_skip(tmp_path)
    if not compiler.nvdisasm:
        pytest.skip("no nvdisasm (python benchmarks/mosaic_offline.py fetch unpacks one)")
    args = _indexer_args("fp4", B=8, T=4096)
    counts = {}
    saved = dict(gpu_mosaic.MOSAIC_CONFIG)
    try:
        for layout in ("fragments", "rows"):
            gpu_mosaic.MOSAIC_CONFIG.update(fp4_converter=2, fp4_layout=layout)
            (r,) = compiler.compile_jitted(
                lambda *a: indexer_topk_gpu(*a, k=512, kernel="mosaic", topk="segment_set", precision="fp8"), *args)
            found = block_loops(*parse(open(r.sass_path).read()))
            counts[layout] = {k: len(lp.body) for k, lp in found.items()}
    finally:
        gpu_mosaic.MOSAIC_CONFIG.update(saved)
    assert counts["rows"]["converter"] < 0.75 * counts["fragments"]["converter"], counts
    assert abs(counts["rows"]["scores"] - counts["fragments"]["scores"]) < 0.1 * counts["fragments"]["scores"], counts


def _attention_case(fp8, t):
    import numpy as np

    from benchmarks.sparse_attention import D, make_case
    from pallas_kernels.sparse_attention.gpu_mosaic import sparse_attention_mosaic

    q, wpool, cpool, sinks, widx, cidx = make_case(np.random.default_rng(0), "csa", 2, t, 512, 2048, fp8, 1)
    return (lambda *a: sparse_attention_mosaic(*a, scale=D ** -0.5)), (q, wpool, widx[0], cpool, cidx[0], sinks)


def _indexer_case(fmt, select):
    from pallas_kernels.indexer.gpu import indexer_topk_gpu
    from pallas_kernels.indexer.gpu_mosaic import indexer_scores_mosaic

    args = _indexer_args(fmt)
    if select:
        return (lambda *a: indexer_topk_gpu(*a, k=512, kernel="mosaic", topk="segment_set")), args
    return (lambda *a: indexer_scores_mosaic(*a)), args


@pytest.mark.parametrize("name", ["attention_decode_bf16", "attention_decode_fp8", "attention_prefill_bf16",
                                  "attention_prefill_fp8", "indexer_bf16", "indexer_fp8", "indexer_fp4",
                                  "indexer_fp8_segment_set", "indexer_fp4_segment_set"])
def test_default_mosaic_kernels_do_not_spill(tmp_path, name):
    """Every Mosaic GPU kernel on its default configuration compiles for sm_90a without spills (offline; the
    indexer at V4-Flash decode shapes, B = 64 x 128K). A spill here is a regression a GPU timing would only show
    as a slowdown."""
    compiler = _offline_or_skip(tmp_path)
    if name.startswith("attention"):
        fn, args = _attention_case("fp8" in name, 1 if "decode" in name else 64)
    else:
        fmt = name.split("_")[1]
        fn, args = _indexer_case(fmt, name.endswith("segment_set"))
    results = compiler.compile_jitted(fn, *args)
    for r in results:
        assert r.spill_stores == 0 and r.spill_loads == 0, r.line()
        assert r.ctas_per_sm >= 1, r.line()
        assert not r.wgmma_serialized, r.line() + "\n" + r.ptxas_log
