"""The Mosaic attention kernel's phase-profile reader (benchmarks/mosaic_phase_profile.py) on a synthetic trace in
the format of Mosaic GPU's profiler dump (CPU only; the kernel's profiled build is checked in test_gpu_lowering)."""

import numpy as np
import pytest

from benchmarks.mosaic_phase_profile import summarize


def _trace(rng):
    """2 CTAs x 3 warpgroups; tid = 1 + warpgroup + 3 x CTA; ts = (start_ns + cycles) / 1e3 as the dump writes."""
    tracks = []
    plan = {0: [("c_wait_q", 300), ("c_wait_full", 50), ("c_scores", 200), ("c_pv", 100), ("c_wait_full", 70),
                ("c_scores", 200), ("c_pv", 100), ("c_epilogue", 400)],
            2: [("p_setup", 250), ("p_wait_empty", 0), ("p_issue", 600), ("p_wait_empty", 80), ("p_issue", 600)]}
    plan[1] = plan[0]
    for cta, start_ns in ((0, 1000.0), (1, 5000.0)):
        for wg, regions in plan.items():
            t, events = 0.0, []
            for name, cyc in regions:
                events.append(dict(name=name, ph="B", ts=(start_ns + t) / 1e3, pid=1 + cta, tid=1 + wg + 3 * cta))
                t += cyc
                events.append(dict(name=name, ph="E", ts=(start_ns + t) / 1e3, pid=1 + cta, tid=1 + wg + 3 * cta))
                t += 10   # 10 cycles between regions (outside every region)
            tracks.append(events)
    rng.shuffle(tracks)   # tracks in any order, each in its record order (as the dump writes them)
    return {"displayTimeUnit": "ns", "traceEvents": [e for tr in tracks for e in tr]}


def test_summarize_phase_profile():
    s = summarize(_trace(np.random.default_rng(0)), clock_ghz=2.0)
    assert s["n_ctas"] == 2 and s["start_spread_us"] == pytest.approx(4.0)
    cons, prod = s["roles"]["consumer"], s["roles"]["producer"]
    assert cons["regions"]["c_wait_full"]["per_cta_cycles"] == pytest.approx(120)
    assert cons["regions"]["c_wait_full"]["count_per_cta"] == pytest.approx(2)
    assert cons["regions"]["c_scores"]["cycles_each"] == pytest.approx(200)
    span = 300 + 50 + 200 + 100 + 70 + 200 + 100 + 400 + 7 * 10
    assert cons["span_cycles"] == pytest.approx(span) and cons["span_us"] == pytest.approx(span / 2000)
    assert cons["regions"]["(outside regions)"]["per_cta_cycles"] == pytest.approx(70)
    assert sum(r["share"] for r in cons["regions"].values()) == pytest.approx(1.0)
    assert prod["regions"]["p_issue"]["per_cta_cycles"] == pytest.approx(1200)
    assert prod["regions"]["p_wait_empty"]["count_per_cta"] == pytest.approx(2)
    assert list(prod["regions"])[0] == "p_issue"   # regions largest first
    # the outside-regions time by where it lies: 10 cycles after each region but the last
    assert cons["gaps"]["c_pv -> c_wait_full"] == pytest.approx(10)
    assert cons["gaps"]["c_wait_full -> c_scores"] == pytest.approx(20)
    assert sum(cons["gaps"].values()) == pytest.approx(70) and sum(prod["gaps"].values()) == pytest.approx(40)


@pytest.mark.parametrize("max_steps", [1, 2, 7, 64, 65])
def test_profile_entries_keep_warpgroup_slices_aligned(max_steps):
    """Each warpgroup's profiler slice starts at wg x entries i32 words and is written with 8 B stores: the count must
    be even (an odd one faulted on the H200 with "misaligned address"), and it must hold every region of the loop."""
    from pallas_kernels.sparse_attention.gpu_mosaic import profile_entries

    n = profile_entries(max_steps)
    assert n % 64 == 0 and n >= 3 + 4 * (5 * max_steps + 2)


def test_decode_kernels_grouping_and_case_specs():
    """benchmarks/decode_kernels.py: CUPTI's kernel list over a chain of U calls -> launches and us per call."""
    from benchmarks.decode_kernels import group_kernels, parse_case

    g = group_kernels([("attn", 20.0), ("combine", 3.0), ("attn", 22.0), ("combine", 5.0)], unroll=2)   # us
    assert list(g) == ["attn", "combine"]
    assert g["attn"]["per_call"] == 1 and g["attn"]["us_each"] == pytest.approx(21)
    assert g["combine"]["us_per_call"] == pytest.approx(4)
    assert parse_case("csa64:n_splits=1+split_scores=true") == ("csa64", dict(n_splits=1, split_scores=True))
    assert parse_case("csa16") == ("csa16", {})
    from benchmarks.decode_kernels import case_shape

    assert case_shape("csa16") == ("csa", 16, 512, "bf16", 64)
    assert case_shape("hca8k136_fp8") == ("hca", 136, 8192, "fp8", 64)
    assert case_shape("hca1k72_h128") == ("hca", 72, 1024, "bf16", 128)
    with pytest.raises(ValueError, match="unknown case"):
        case_shape("hca8k")


def test_indexer_profile_roles_and_per_block():
    """The indexer's profile (benchmarks/indexer_phase_profile.py): warpgroup 0 is the scorer, 1 the converter
    (tid = 1 + warpgroup + 2 x CTA), and per_block divides each role's per-CTA figures by the blocks a CTA scored."""
    from benchmarks.indexer_phase_profile import ROLES, per_block

    plan = {0: [("s_wait_q", 100)] + [("s_wait", 30), ("s_mma", 200), ("s_epilogue", 300), ("s_hist", 50)] * 3
            + [("s_select", 900)],
            1: [("c_wait_keys", 40), ("c_convert", 250), ("c_wait_slot", 400), ("c_store", 60)] * 3}
    events = []
    for cta in range(2):
        for wg, regions in plan.items():
            t = 0.0
            for name, cyc in regions:
                for ph in ("B", "E"):
                    events.append(dict(name=name, ph=ph, ts=(1000.0 * cta + t) / 1e3, pid=1, tid=1 + wg + 2 * cta))
                    t += cyc if ph == "B" else 0
    s = summarize({"traceEvents": events}, clock_ghz=2.0, warpgroups=2, roles_of=ROLES)
    assert set(s["roles"]) == {"scorer", "converter"} and s["n_ctas"] == 2
    pb = per_block(s)
    assert pb["scorer"]["s_mma"] == pytest.approx(200) and pb["scorer"]["s_select"] == pytest.approx(300)
    assert pb["converter"]["c_wait_slot"] == pytest.approx(400)
    assert pb["scorer"]["(span)"] == pytest.approx((100 + 3 * 580 + 900) / 3)


def test_run_profiled_reads_the_last_trace(tmp_path):
    """run_profiled (both profile scripts): warm calls of the plain function, three profiled calls, then the newest
    trace of the dump directory as a dict, older ones removed; no trace is an error that says so."""
    import json

    from benchmarks.mosaic_phase_profile import run_profiled

    calls = []

    def profiled(x):
        calls.append(x)
        with open(tmp_path / f"{len(calls):04d}-trace.json", "w") as f:
            json.dump({"traceEvents": [], "call": len(calls)}, f)
        return x

    trace, n = run_profiled(lambda x: x, profiled, (np.float32(1.0),), str(tmp_path), warm_ms=1.0)
    assert trace["call"] == 3 and n >= 0 and len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0003-trace.json"]
    with pytest.raises(RuntimeError, match="no trace"):
        run_profiled(lambda x: x, lambda x: x, (np.float32(1.0),), str(tmp_path / "empty"), warm_ms=1.0)
