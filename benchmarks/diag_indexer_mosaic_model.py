"""Diagnosis of the session-20 GPU model-test failure of the Mosaic indexer kernel (issue #5).

    PYTHONPATH=.:tests python benchmarks/diag_indexer_mosaic_model.py [--steps 4]

The tiny model of tests/test_model_pallas_quantized.py::test_fp8_indexer_keys_on_mosaic_kernel_match_reference
(index_head_dim 128, fp8 rotated indexer keys, batch 16, 16 key slots) runs on the reference path; a spy captures
the CSA indexer's inputs (q, weights, keys, n_visible) at every decode step. Each capture is then scored by every
kernel that applies here and compared with the reference scores row by row: max |error| / the row's max |score|,
whether the -inf pattern matches, and whether the row's top-k set (k = index_topk) equals the reference's.
On a GPU: Mosaic f16 (the default precision), Mosaic fp8, Triton; on the CPU: Triton and Mosaic fp8 interpreted.
A row that differs only on the GPU's Mosaic f16 kernel localises the failure to that path.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from flax import nnx

jax.config.update("jax_default_matmul_precision", "highest")

import dsv4_jax.layers.indexer as indexer_layer  # noqa: E402
from dsv4_jax.config import tiny  # noqa: E402
from dsv4_jax.model import DeepseekV4ForCausalLM  # noqa: E402
from pallas_kernels.indexer import indexer_scores, indexer_scores_pallas  # noqa: E402


def capture_decode_inputs(steps: int):
    """-> (list of (q, w, keys, nv) numpy/pytree captures, one per decode step, index_topk)."""
    cfg = tiny(head_dim=512, qk_rope_head_dim=64, index_head_dim=128, index_topk=8)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (16, 36 + steps))
    captured = []
    real = indexer_layer.indexer_topk

    def spy(q, w, keys, nv, *, k, **kw):
        if q.shape[1] == 1:   # decode
            jax.debug.callback(lambda *a: captured.append(a), q, w, keys, nv)
        return real(q, w, keys, nv, k=k, **kw)

    indexer_layer.indexer_topk = spy
    try:
        m = DeepseekV4ForCausalLM(cfg, rngs=nnx.Rngs(7), attention_impl="reference")
        cache = m.init_cache(16, 64, indexer_dtype="fp8", indexer_rotate=True)
        _, cache = m.prefill(ids[:, :36], cache)
        for t in range(36, 36 + steps):
            _, cache = m.decode(ids[:, t], cache)
        jax.effects_barrier()
    finally:
        indexer_layer.indexer_topk = real
    return captured, cfg.index_topk


def rows_off(out, ref, k=None, tol=1e-4):
    """Scores out / ref [B, 1, T] -> (relative error per row [B] (max |out - ref| over the reference's finite
    entries / the row's max |ref|), whether the -inf pattern matches [B], whether the top-k sets match [B] (all
    True without k), the rows where any check fails)."""
    fin = np.isfinite(ref)
    scale = np.max(np.where(fin, np.abs(ref), 0), axis=-1)[:, 0]
    err = np.max(np.where(fin, np.abs(np.where(fin, out, 0) - np.where(fin, ref, 0)), 0), axis=-1)[:, 0] / scale
    inf_ok = np.all(np.isfinite(out) == fin, axis=-1)[:, 0]
    same = np.ones_like(inf_ok)
    if k is not None:
        top = lambda s: np.sort(np.argsort(-s, axis=-1, kind="stable")[..., :k], axis=-1)
        same = np.all(top(out) == top(ref), axis=-1)[:, 0]
    return err, inf_ok, same, np.nonzero((err > tol) | ~inf_ok | ~same)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    captured, k = capture_decode_inputs(a.steps)
    on_gpu = jax.default_backend() == "gpu"
    kernels = {"triton": dict(kernel="triton"), "mosaic_fp8": dict(kernel="mosaic", precision="fp8")}
    if on_gpu:
        kernels["mosaic_f16"] = dict(kernel="mosaic", precision="f16")
    for step, (q, w, keys, nv) in enumerate(captured):
        ref = np.asarray(indexer_scores(q, w, keys, nv))
        print(f"step {step}: T={ref.shape[-1]} n_visible={np.unique(np.asarray(nv))}")
        for name, opts in kernels.items():
            try:
                out = np.asarray(indexer_scores_pallas(q, w, keys, nv, impl="pallas", **opts))
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"  {name:11s} failed: {e!r}"[:300])
                continue
            err, inf_ok, same, bad = rows_off(out, ref, k)
            print(f"  {name:11s} max rel err {err.max():.2e}; rows off (err > 1e-4, -inf pattern or top-{k} set): "
                  f"{bad.tolist()}")
            for b in bad[:4]:
                print(f"    row {b}: err {err[b]:.3e}, -inf ok {bool(inf_ok[b])}, top-k same {bool(same[b])}; "
                      f"kernel {np.round(out[b, 0, :12], 4).tolist()}\n"
                      f"           reference {np.round(ref[b, 0, :12], 4).tolist()}")


if __name__ == "__main__":
    main()
