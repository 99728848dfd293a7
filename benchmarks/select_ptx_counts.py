"""Instructions and collectives the in-kernel top-k's PTX executes per thread (CPU, `tests/ptx_sim.py`): the plain
selection (`segment_select_ptx` after the streamed first-level histogram) against the pruned one
(SELECT_CONFIG prune: the threshold after the split's first half, later blocks' candidates appended, the selection
over the list), on one split of normal scores. Not a timing: a count of what each thread issues, to set the
expectation for the H200 (the selection's tail is latency-bound, one warpgroup per CTA; session 40 measured the
plain tail at ~8.8 us for 8192 keys).

    PYTHONPATH=.:tests python benchmarks/select_ptx_counts.py [--n 8192] [--k 512] [--slack 64] [--cap 2048]
"""

from __future__ import annotations

import argparse
import os
import sys


def counts(n=8192, bt=128, k=512, slack=64, cap=2048, seed=0):
    """{path: (instructions a thread issues during the stream, after it, collectives after it)} and the candidates."""
    import numpy as np

    from ptx_sim import Cta, Memory
    from pallas_kernels.indexer import mosaic_select as M
    from test_ptx_sim import GK, GP, IDX, S0, U0, _stream, _u

    slots, nb = k + slack, n // bt
    J = nb // 2 - 1
    u = _u(np.random.default_rng(seed).standard_normal(n).astype(np.float32))
    out = {}
    for name in ("plain", "pruned"):
        cta = Cta(shared=Memory(), glob=Memory(), seed=1)
        _stream(cta, u, bt=bt, prune=(J, k, cap) if name == "pruned" else None)
        stream, e0, c0 = cta.executed, cta.executed, cta.collectives
        if name == "plain":
            cta.run(M.segment_select_ptx(k, slots, hist_ready=True), [U0, S0, n, 0, GK, GP])
        else:
            cta.run(M.prune_final_ptx(k, slots), [U0, S0, n, IDX, GK, GP, 0])
            out["candidates"] = cta.shared.load(S0 + M.PRUNE_COUNT)
        out[name] = (stream / cta.n, (cta.executed - e0) / cta.n, cta.collectives - c0)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--slack", type=int, default=64)
    ap.add_argument("--cap", type=int, default=2048)
    a = ap.parse_args()
    res = counts(a.n, k=a.k, slack=a.slack, cap=a.cap)
    print(f"one split of {a.n} normal scores, k {a.k}, slack {a.slack}; pruned: {res['candidates']} candidates "
          f"(list capacity {a.cap})")
    print(f"{'':8} {'stream instr/thread':>20} {'tail instr/thread':>18} {'tail collectives':>17}")
    for name in ("plain", "pruned"):
        s, t, c = res[name]
        print(f"{name:8} {s:20.0f} {t:18.0f} {c:17d}")


if __name__ == "__main__":
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [root, os.path.join(root, "tests")]
    main()
