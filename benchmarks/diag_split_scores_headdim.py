"""split_scores vs the default Mosaic kernel at head_dim 128 / 256 / 512 (H200, session 12 call 7): relative error of
each against the reference op on the GPU tests' random inputs (ragged lengths), decode and prefill shapes.

    PYTHONPATH=.:tests python benchmarks/diag_split_scores_headdim.py
"""
import sys; sys.path[:0] = [".", "tests"]
import numpy as np
from test_sparse_attention import make_inputs, call
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.sparse_attention.reference import sparse_attention as ref
for d in (128, 256, 512):
    for (b, t, nw, nc, kw, kc) in [(4, 1, 128, 300, 128, 512), (1, 64, 512, 200, 100, 60), (2, 16, 64, 40, 8, 16)]:
        inp = make_inputs(b, t, 64, d, nw, nc, kw, kc, ragged=True)
        r = np.asarray(call(ref, inp)[0], np.float32)
        for ss in (False, True):
            try:
                o = np.asarray(call(sparse_attention, inp, impl="pallas", kernel="mosaic", split_scores=ss)[0], np.float32)
                print(d, b, t, kw, kc, "ss" if ss else "noss", float(np.linalg.norm(o - r) / np.linalg.norm(r)), flush=True)
            except Exception as e:
                print(d, b, t, kw, kc, ss, "ERR", str(e)[:200], flush=True)
