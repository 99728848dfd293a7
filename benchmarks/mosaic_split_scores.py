"""split_scores on the H200: does it run (each variant in its own process, since a CUDA fault poisons the
context), is it correct, and is it faster than the default Mosaic kernel?

    PYTHONPATH=. python benchmarks/mosaic_split_scores.py --out DIR [--time-limit S]

Phase 1, one child process per variant, `benchmarks/mosaic_attention.check` on four decode configurations (ragged
lengths, an empty compressed list, -1 / out-of-range / duplicate entries, 1-3 splits, K = 256 / 512 / 1024):
  ss             exchange buffers right after the ring (1 KB aligned)
and only if it fails, to locate the fault:
  ss_noexchange  no P exchange (wrong output by design: only whether the half-width score wgmma runs)
  ss_tail        the session-10 layout (exchange buffers after the barriers, 8 mod 16 B): faulted then
Phase 2, if "ss" passed: `mosaic_attention.py --cases ss` (default vs split_scores on CSA decode B=64 / 128 and
prefill S=4K), in a child process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = {"ss": dict(split_scores=True),
            "ss_noexchange": dict(split_scores=True, _diag="ss_noexchange"),
            "ss_tail": dict(split_scores=True, _diag="ss_tail")}
CONFIGS = [(2, 512, dict(n_splits=1)), (3, 512, dict(n_splits=3)), (2, 1024, {}), (5, 256, dict(n_splits=2))]


def child(name):
    import numpy as np

    from benchmarks.mosaic_attention import check

    rng = np.random.default_rng(0)
    for b, kc, opts in CONFIGS:
        r = check(rng, b, kc, {**opts, **VARIANTS[name]})
        r["variant"] = name
        print("RESULT", json.dumps(r), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--child", default=None)
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per phase-1 child")
    ap.add_argument("--phase2-limit", type=float, default=150.0)
    a = ap.parse_args()
    if a.child:
        return child(a.child)
    os.makedirs(a.out, exist_ok=True)
    out = dict(checks=[], phase2=None)
    env = dict(os.environ, PYTHONPATH=".")
    for name in VARIANTS:
        if name != "ss" and out["checks"][0]["status"] == "exit 0" and all(r.get("ok") for r in out["checks"][0]["rows"]):
            break   # the fix works: no need to locate the session-10 fault
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True,
                               timeout=a.time_limit, env=env)
            rows = [json.loads(l[7:]) for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            status = "exit %d" % p.returncode
            tail = "" if p.returncode == 0 else "\n".join(
                l for l in p.stderr.splitlines() if "arning" not in l)[-1500:]
        except subprocess.TimeoutExpired as e:   # keep what the child printed before the limit
            out_txt = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            rows = [json.loads(l[7:]) for l in out_txt.splitlines() if l.startswith("RESULT ")]
            status, tail = "timeout", ""
        rec = dict(variant=name, status=status, s=round(time.time() - t0, 1), rows=rows, stderr_tail=tail)
        print(f"[{name}] {status} in {rec['s']} s", flush=True)
        for r in rows:
            print("   ", {k: r[k] for k in ("b", "kc", "rel_err", "lse_max_abs_err", "nan", "ok") if k in r}, flush=True)
        if tail:
            print("    stderr:", tail[-800:], flush=True)
        out["checks"].append(rec)
    ss = next(c for c in out["checks"] if c["variant"] == "ss")
    if ss["status"] == "exit 0" and ss["rows"] and all(r.get("ok") for r in ss["rows"]):
        try:
            p = subprocess.run([sys.executable, "benchmarks/mosaic_attention.py", "--out", a.out, "--cases", "ss",
                                "--no-checks", "--variants", "mosaic,mosaic_ss"], capture_output=True, text=True,
                               timeout=a.phase2_limit, env=env)
            out["phase2"] = [l for l in p.stdout.splitlines() if l.startswith(("time", "ceilings"))]
        except subprocess.TimeoutExpired as e:
            out["phase2"] = [l for l in (e.stdout or b"").decode().splitlines() if l.startswith(("time", "ceil"))] \
                + ["timeout"]
        for l in out["phase2"]:
            print(l, flush=True)
    else:
        print("phase 2 skipped: split_scores did not pass its checks", flush=True)
    with open(os.path.join(a.out, "mosaic_split_scores.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
