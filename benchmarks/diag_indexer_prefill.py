"""Diagnostic for the indexer prefill picks on the GPU (the bf16-key case failed there in session 3 while its
scores matched): for several kernel configurations, the scores kernel called directly and inside the query-chunked
top-k path, against the jnp reference, and the picks against the reference picks. Prints one line per
(format, configuration): max |score error| / row scale (direct, chunked), #query rows whose picks differ beyond
near-ties, and where the worst errors sit (query index mod block_q, key index mod block_t).

    PYTHONPATH=.:tests python benchmarks/diag_indexer_prefill.py [--fmts bf16,None] [--small]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.indexer import indexer_scores, indexer_topk, indexer_topk_reference
from pallas_kernels.indexer.gpu import indexer_scores_gpu, topk_from_scores
from test_indexer_kernels import make

CONFIGS = {"default": {}, "bq1": dict(block_q=1), "bq2": dict(block_q=2), "bq8": dict(block_q=8),
           "f32": dict(precision="f32"), "bf16": dict(precision="bf16"), "stages1": dict(num_stages=1),
           "warps8": dict(num_warps=8), "splits1": dict(num_splits=1)}


def rel_err(out, ref):
    out, ref = np.asarray(out)[..., :ref.shape[-1]], np.asarray(ref)
    fin = np.isfinite(ref)
    if not np.array_equal(np.isfinite(out), fin):
        return float("inf"), None
    scale = np.where(fin, np.abs(ref), 0).max(-1, keepdims=True) + 1e-30
    e = np.abs(np.where(fin, out, 0) - np.where(fin, ref, 0)) / scale
    return float(e.max()), tuple(int(i) for i in np.unravel_index(np.argmax(e), e.shape))


def bad_rows(picks, ref_picks, s):
    picks, ref_picks = np.asarray(picks), np.asarray(ref_picks)
    sp = np.take_along_axis(s, np.maximum(picks, 0), -1)
    sr = np.take_along_axis(s, np.maximum(ref_picks, 0), -1)
    fin = np.where(np.isfinite(s), np.abs(s), 0).max(-1, keepdims=True)
    bad = (np.abs(np.where(ref_picks >= 0, sp - sr, 0)) > 1e-4 * fin + 1e-7).any(-1) | ((picks < 0) != (ref_picks < 0)).any(-1)
    return np.argwhere(bad)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmts", default="bf16,None")
    ap.add_argument("--small", action="store_true", help="CPU smoke: a small case in the interpreter")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    a = ap.parse_args()
    interpret = jax.default_backend() != "gpu"
    B, S, T, k = (1, 20, 90, 16) if a.small else (2, 300, 700, 512)
    for fmt in a.fmts.split(","):
        fmt = None if fmt == "None" else fmt
        q, w, keys, nv = make(B, S, 64, T, fmt, rotate=fmt in ("fp8", "fp4"), causal=True)
        ref = np.asarray(indexer_scores(q, w, keys, nv))
        ref_picks = indexer_topk_reference(q, w, keys, nv, k=k)
        for name in a.configs.split(","):
            opts = CONFIGS[name]
            try:
                direct = indexer_scores_gpu(q, w, keys, nv, interpret=interpret, **opts)
                e_d, at_d = rel_err(direct, ref)
                chunks = [indexer_scores_gpu(q[:, i:i + 256], w[:, i:i + 256], keys, nv[:, i:i + 256],
                                             interpret=interpret, pad_to_block=True, **opts) for i in range(0, S, 256)]
                e_c, at_c = rel_err(jnp.concatenate([c[..., :T] for c in chunks], 1), ref)
                picks_direct = topk_from_scores(direct, min(k, T))
                picks = indexer_topk(q, w, keys, nv, k=k, impl="pallas", **opts)
                rows_d = bad_rows(picks_direct, ref_picks, ref)
                rows = bad_rows(picks, ref_picks, ref)
                print(f"fmt={fmt} {name:8s} err direct {e_d:.2e} at {at_d} | chunked {e_c:.2e} at {at_c} | "
                      f"bad pick rows: topk(direct) {len(rows_d)}, indexer_topk {len(rows)} {rows[:6].tolist()}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
                print(f"fmt={fmt} {name:8s} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
