"""Diagnosis of the session-20 GPU model-test failure of the Mosaic indexer kernel (issue #5).

Result (H200, session 21, results/h200_s21r1_mdiag.log + the saved captures): the q the indexer got on the GPU was
not quantized at all, while the CPU's was: XLA's GPU compiler had folded q's fake quantization away
(benchmarks/diag_fake_quantize.py; fixed in formats.fake_quantize). The kernels were not at fault.

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


def capture_decode_inputs(steps: int, impl: str = "reference"):
    """-> (list of (q, w, keys, nv) numpy/pytree captures, one per decode step, index_topk) of the model run with
    attention_impl=impl (with "pallas": the inputs the pallas path's indexer kernel got, its kernel="auto" on Mosaic
    where it applies, as in the model test)."""
    from pallas_kernels.indexer import gpu_mosaic

    cfg = tiny(head_dim=512, qk_rope_head_dim=64, index_head_dim=128, index_topk=8)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (16, 36 + steps))
    captured = []
    real = indexer_layer.indexer_topk

    def spy(q, w, keys, nv, *, k, **kw):
        if q.shape[1] == 1:   # decode
            jax.debug.callback(lambda *a: captured.append(a), q, w, keys, nv)
        return real(q, w, keys, nv, k=k, **kw)

    indexer_layer.indexer_topk = spy
    auto = gpu_mosaic.AUTO
    gpu_mosaic.AUTO = True
    try:
        m = DeepseekV4ForCausalLM(cfg, rngs=nnx.Rngs(7), attention_impl=impl)
        cache = m.init_cache(16, 64, indexer_dtype="fp8", indexer_rotate=True)
        _, cache = m.prefill(ids[:, :36], cache)
        for t in range(36, 36 + steps):
            _, cache = m.decode(ids[:, t], cache)
        jax.effects_barrier()
    finally:
        indexer_layer.indexer_topk = real
        gpu_mosaic.AUTO = auto
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
    ap.add_argument("--save", default=None, help="write every capture (both model paths) to this .npz")
    a = ap.parse_args()
    captured, k = capture_decode_inputs(a.steps)
    captured_pallas, _ = capture_decode_inputs(a.steps, "pallas")
    if a.save:
        arrays = {}
        for tag, caps in (("ref", captured), ("pallas", captured_pallas)):
            for step, (q, w, keys, nv) in enumerate(caps):
                arrays.update({f"{tag}{step}_q": np.asarray(q), f"{tag}{step}_w": np.asarray(w),
                               f"{tag}{step}_kv": np.asarray(keys.values.astype(np.float32)),
                               f"{tag}{step}_ks": np.asarray(keys.scale), f"{tag}{step}_nv": np.asarray(nv)})
        np.savez_compressed(a.save, **arrays)
    for step, ((q, w, keys, nv), (qp, wp, keysp, nvp)) in enumerate(zip(captured, captured_pallas)):
        dq = np.abs(np.asarray(qp, np.float32) - np.asarray(q, np.float32)).reshape(q.shape[0], -1).max(-1)
        dk = np.abs(np.asarray(keysp.values.astype(np.float32)) - np.asarray(keys.values.astype(np.float32))
                    ).reshape(q.shape[0], -1).max(-1)
        print(f"step {step}: pallas-path inputs vs reference-path: rows whose q differ {np.nonzero(dq)[0].tolist()} "
              f"(max {dq.max():.3g}), rows whose key codes differ {np.nonzero(dk)[0].tolist()}; n_visible equal "
              f"{bool(np.all(np.asarray(nv) == np.asarray(nvp)))}")
    print("== captures of the reference path ==")
    _compare(captured, k)
    print("== captures of the pallas path (the inputs the model test's kernel got) ==")
    _compare(captured_pallas, k)


def _compare(captured, k):
    on_gpu = jax.default_backend() == "gpu"
    kernels = {"triton": dict(kernel="triton"), "mosaic_fp8": dict(kernel="mosaic", precision="fp8")}
    if on_gpu:
        kernels["mosaic_f16"] = dict(kernel="mosaic", precision="f16")
    for step, cap in enumerate(captured):
        # debug.callback hands over host-side (CPU) arrays: back onto the default device for the kernels
        q, w, keys, nv = jax.device_put(cap, jax.devices()[0])
        ref = np.asarray(indexer_scores(q, w, keys, nv))
        srt = -np.sort(-np.where(np.isfinite(ref), ref, -np.inf), axis=-1)[:, 0]
        gap = (srt[:, k - 1] - srt[:, k]) / np.max(np.abs(np.where(np.isfinite(ref), ref, 0)), axis=-1)[:, 0]
        print(f"step {step}: T={ref.shape[-1]} n_visible={np.unique(np.asarray(nv))}; smallest gap between the "
              f"k-th and (k+1)-th reference score / row scale: {np.nanmin(gap):.2e} (row {int(np.nanargmin(gap))})")
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
