"""split_scores vs the default Mosaic kernel at head_dim 128 / 256 / 512 (H200, session 12 call 7): the relative
error of each against the reference op on the GPU tests' random inputs (ragged lengths), decode and prefill shapes.
Results: results/h200_s12r7_ss_headdim.log.

    PYTHONPATH=.:tests python benchmarks/diag_split_scores_headdim.py
"""

from __future__ import annotations

import sys

import numpy as np

# (B, T, window rows, compressed rows, K_w, K_c)
CASES = [(4, 1, 128, 300, 128, 512), (1, 64, 512, 200, 100, 60), (2, 16, 64, 40, 8, 16)]


def main():
    from pallas_kernels.sparse_attention import sparse_attention
    from pallas_kernels.sparse_attention.reference import sparse_attention as reference
    from test_sparse_attention import call, make_inputs

    for d in (128, 256, 512):
        for b, t, n_w, n_c, k_w, k_c in CASES:
            inp = make_inputs(b, t, 64, d, n_w, n_c, k_w, k_c, ragged=True)
            ref = np.asarray(call(reference, inp)[0], np.float32)
            for ss in (False, True):
                try:
                    o = np.asarray(call(sparse_attention, inp, impl="pallas", kernel="mosaic", split_scores=ss)[0],
                                   np.float32)
                    err = float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
                    print(d, b, t, k_w, k_c, "ss" if ss else "noss", err, flush=True)
                except Exception as e:   # report, keep going
                    print(d, b, t, k_w, k_c, "ss" if ss else "noss", "ERROR", str(e)[:200], flush=True)


if __name__ == "__main__":
    sys.path[:0] = [".", "tests"]
    main()
