"""Where the time of the threshold top-k goes: each stage of `topk.topk_threshold` timed alone (H200 diagnostic).

    PYTHONPATH=. python benchmarks/topk_stages.py [--cases 1x262144,64x32768] [--out DIR]

Stages (k = 512 or --k, random normal scores [R, T]; each timed as dependent calls in one jitted scan, `timing.timed_chain`):
  full_lax         lax.top_k over all T (the baseline)
  full_threshold   the GPU default (`topk_threshold(impl="pallas_compact")`)
  full_nocond      the same without any overflow handling (fast path only): the price of exactness
  full_rank        impl="pallas" (rank-counting kernels for tau and the order, no sort)
  full_ties        the default on rows of a few distinct values (every row overflows: the radix fix-up kernel runs)
  lax_ties         lax.top_k on those rows (the fix-up takes its tau == K* shortcut there: one counting pass)
  full_radix       rows with > k distinct keys above a plateau at the bound: the fix-up's radix select runs
  gmax             ordered keys + strided group maxima [R, G]
  tau              gmax + lax.top_k over the G maxima (the threshold)
  compact          `compact_pallas` alone (tau given)
  order            lax.top_k over the `capacity` compacted slots + the index gather
  cond_trivial     a lax.cond on a device predicate with two trivial branches: the fixed price of a conditional
  full_select      impl="pallas_select": Triton bound kernel + compaction + fix-up + Triton k-set selection, then
                   lax.top_k over the k picks only (session 6)
  full_set         the same, sorted=False: the picks as an index set, no sort at all
  bound            gmax + `bound_pallas` (their k-th largest by a radix select kernel; compare with `tau`)
  select           `select_pallas` alone on the compacted slots (the exact k-set, ascending position)
  order_k          lax.top_k over k picks + the index gather (the sort left in full_select)
  fused_set        full_set's selection as one Triton kernel, one program per row (`topk_fused.fused_select`)
  fused_ties       the same on full_ties' rows (every row overflows: the in-kernel fix-up runs)
  hist_set         impl="pallas_hist", sorted=False: one Triton program per row, radix select by 11-bit histograms
                   (`topk_hist.hist_select`, session 33), the index set written by the kernel
  hist             the same with sorted picks (the k picks' keys ordered by lax.top_k)
  hist_direct      `topk_hist.hist_select` called directly, also on rows short enough for topk_threshold's
                   small-row shortcut (T <= capacity: a plain lax.top_k)
  hist_ties        hist_set on full_ties' rows (heavy ties: hot histogram counters, entries equal to K*)
  hist_pos         hist_set on |scores| (no negative half: the log bins of pass 1 spread them, less atomic contention)
  hist_prefix      hist_set on rows valid only in their first T / 10 entries (a decode cache filled to L < T)
  set_prefix       full_set (the chain) on hist_prefix's rows
  hist_half        hist_set on rows valid only in their first T / 2 entries
  set_half         full_set on hist_half's rows
  tour_set         impl="pallas_tour", sorted=False: `topk_hist.tournament_select` (segments of a row keep their own
                   top-k sets, one program each, then one program per row selects among them; session 36)
  tour_prefix / tour_half / tour_ties   tour_set on hist_prefix's / hist_half's / full_ties' rows
  tour_seg         the tournament's first stage alone (each segment's top-k set)
  tour_fused       tour_set with its last segment stage and the final selection in one kernel (fuse_final=True:
                   the last program of a row to finish selects among the row's survivors; session 38)
  tour_fused_prefix  tour_fused on hist_prefix's rows
  touch            the chain's own carry update alone (the harness overhead, subtracted from nothing)
Prints a table of us per call; writes DIR/topk_stages.json. --stages picks a subset (comma list; touch always runs;
it also restricts the stages the *-configs sweeps time).
--select-configs 'bound_warps=2,select_warps=2;select_bits=4' times bound / select / full_select / full_set once per
option set of `topk.SELECT_KERNEL_CONFIG` (rows named like `full_set[select_warps=2]`); --fused-configs
'num_warps=16;matrix=0,rows_per_step=8' times fused_set once per option set of `topk_fused.FUSED_KERNEL_CONFIG`;
--hist-configs 'num_warps=16,chunk=16384;resident=0' times the hist stages once per option set of
`topk_hist.HIST_KERNEL_CONFIG`; --tour-configs 'seg_len=2048,seg_warps=4;final_max=4096' the tour stages once per
option set of `topk_hist.TOUR_CONFIG`.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.timing import timed_chain
from pallas_kernels.indexer import topk as T_
from pallas_kernels.indexer import topk_fused as TF
from pallas_kernels.indexer import topk_hist as TH

K = 512


def stages(R, T, k=K, only=None, label=""):
    interp = jax.default_backend() == "cpu"  # CPU smoke runs: Triton kernels in the interpreter
    scores = jax.random.normal(jax.random.key(R * 7 + T), (R, T), jnp.float32)
    group, capacity = T_.threshold_layout(T, k)
    keys0 = T_._ordered_i32(scores)
    tau0 = T_._threshold(keys0, k, group)
    ck0, cp0, n0 = T_.compact_reference(keys0, tau0, capacity)
    kk0, pk0 = jax.lax.top_k(ck0, k)                  # some k keys / positions (order_k's input)
    pk0 = jnp.take_along_axis(cp0, pk0, axis=1)

    def fast_only(s):
        keys = T_._ordered_i32(s)
        tau = T_._threshold(keys, k, group)
        ck, cp, n = T_.compact_pallas(s, keys, tau, capacity, interpret=interp)
        slot = jax.lax.top_k(ck, k)[1]
        return jnp.where(slot < n[:, None], jnp.take_along_axis(cp, slot, axis=1), -1)

    def cond_trivial(s):
        pred = s[0, 0] > 1e30
        return jax.lax.cond(pred, lambda: jnp.ones((R, 1), jnp.int32), lambda: jnp.zeros((R, 1), jnp.int32))

    ties = jnp.round(scores * 0.5) * 2.0    # even integers: ~16% of a row ties at the bound, every row overflows
    prefix = lambda s, n: jnp.where(jnp.arange(T) < T // n, s, -jnp.inf)   # valid in the first T / n entries only

    fns = {
        "touch": lambda s: jnp.zeros((R, 1), jnp.int32),
        "full_lax": lambda s: jax.lax.top_k(s, k)[1],
        "full_threshold": lambda s: T_.topk_threshold(s, k, impl="pallas_compact", interpret=interp),
        "full_nocond": fast_only,
        "full_rank": lambda s: T_.topk_threshold(s, k, impl="pallas", interpret=interp),
        "full_ties": lambda s: T_.topk_threshold(jnp.where(s[:, :1] > 1e30, 0.0, ties), k, impl="pallas_compact",
                                                 interpret=interp),
        "lax_ties": lambda s: jax.lax.top_k(jnp.where(s[:, :1] > 1e30, 0.0, ties), k)[1],
        "full_radix": lambda s: T_.topk_threshold(jnp.where(s[:, :1] > 1e30, 0.0, plateau), k,
                                                  impl="pallas_compact", interpret=interp),
        "gmax": lambda s: T_._strided_group_max(T_._ordered_i32(s), group),
        "tau": lambda s: T_._threshold(T_._ordered_i32(s), k, group)[:, None],
        "compact": lambda s: T_.compact_pallas(s, T_._ordered_i32(s), tau0, capacity, interpret=interp)[1],
        "order": lambda s: jnp.take_along_axis(cp0, jax.lax.top_k(jnp.where(s[:, :1] > 1e30, 0, ck0), k)[1],
                                               axis=1),
        "cond_trivial": cond_trivial,
        "full_select": lambda s: T_.topk_threshold(s, k, impl="pallas_select", interpret=interp),
        "full_set": lambda s: T_.topk_threshold(s, k, impl="pallas_select", sorted=False, interpret=interp),
        "fused_set": lambda s: T_.topk_threshold(s, k, impl="pallas_fused", sorted=False, interpret=interp),
        "fused_ties": lambda s: T_.topk_threshold(jnp.where(s[:, :1] > 1e30, 0.0, ties), k, impl="pallas_fused",
                                                  sorted=False, interpret=interp),
        "hist_set": lambda s: T_.topk_threshold(s, k, impl="pallas_hist", sorted=False, interpret=interp),
        "hist": lambda s: T_.topk_threshold(s, k, impl="pallas_hist", interpret=interp),
        "hist_direct": lambda s: TH.hist_select(s, k, finite_only=True, set_out=True, interpret=interp),
        "hist_ties": lambda s: T_.topk_threshold(jnp.where(s[:, :1] > 1e30, 0.0, ties), k, impl="pallas_hist",
                                                 sorted=False, interpret=interp),
        "hist_pos": lambda s: T_.topk_threshold(jnp.abs(s), k, impl="pallas_hist", sorted=False, interpret=interp),
        "hist_prefix": lambda s: T_.topk_threshold(prefix(s, 10), k, impl="pallas_hist", sorted=False,
                                                   interpret=interp),
        "set_prefix": lambda s: T_.topk_threshold(prefix(s, 10), k, impl="pallas_select", sorted=False,
                                                  interpret=interp),
        "hist_half": lambda s: T_.topk_threshold(prefix(s, 2), k, impl="pallas_hist", sorted=False, interpret=interp),
        "set_half": lambda s: T_.topk_threshold(prefix(s, 2), k, impl="pallas_select", sorted=False, interpret=interp),
        "tour_set": lambda s: T_.topk_threshold(s, k, impl="pallas_tour", sorted=False, interpret=interp),
        "tour_prefix": lambda s: T_.topk_threshold(prefix(s, 10), k, impl="pallas_tour", sorted=False,
                                                   interpret=interp),
        "tour_half": lambda s: T_.topk_threshold(prefix(s, 2), k, impl="pallas_tour", sorted=False, interpret=interp),
        "tour_seg": lambda s: TH.tournament_stage(s, k, interpret=interp)[1],
        "tour_fused": lambda s: TH.tournament_select(s, k, finite_only=True, set_out=True, fuse_final=True,
                                                     interpret=interp),
        "tour_fused_prefix": lambda s: TH.tournament_select(prefix(s, 10), k, finite_only=True, set_out=True,
                                                            fuse_final=True, interpret=interp),
        "tour_ties": lambda s: T_.topk_threshold(jnp.where(s[:, :1] > 1e30, 0.0, ties), k, impl="pallas_tour",
                                                 sorted=False, interpret=interp),
        "bound": lambda s: T_.bound_pallas(T_._strided_group_max(T_._ordered_i32(s), group), k,
                                           interpret=interp)[:, None],
        "select": lambda s: T_.select_pallas(jnp.where(s[:, :1] > 1e30, 0, ck0), cp0, n0, k, capacity,
                                             interpret=interp)[1],
        "order_k": lambda s: jnp.take_along_axis(pk0, jax.lax.top_k(jnp.where(s[:, :1] > 1e30, 0, kk0), k)[1],
                                                 axis=1),
    }
    if only:
        fns = {n: f for n, f in fns.items() if n == "touch" or n in only}
    n_iter = 200 if R * T <= (1 << 18) else 50
    # plateau of 1.0 (20% of a row) under > k distinct larger values packed in a few strided groups: overflow with
    # more than k keys above the bound, so the fix-up kernel runs its radix select
    G = -(-T // group)
    u = jax.random.uniform(jax.random.key(5), (R, T), jnp.float32, -3.0, 0.5)
    plat = jnp.where(jax.random.uniform(jax.random.key(6), (R, T)) < 0.2, 1.0, u)
    cols = jnp.arange(T)
    big = (cols % G >= 5) & (cols % G < 5 + -(-3 * k // (2 * group)))
    plateau = jnp.where(big[None, :], 2.0 + jax.random.uniform(jax.random.key(7), (R, T)), plat)
    kt = T_._ordered_i32(ties)
    kp = T_._ordered_i32(plateau)
    tp = T_._threshold(kp, k, group)
    row = dict(R=R, T=T, k=k, group=group, capacity=capacity, survivors_max=int(jnp.max(n0)),
               plateau_survivors_min=int(jnp.min(T_.compact_reference(kp, tp, capacity)[2])),
               plateau_above_min=int(jnp.min(jnp.sum(kp > tp[:, None], axis=1))),
               ties_survivors_min=int(jnp.min(T_.compact_reference(kt, T_._threshold(kt, k, group), capacity)[2])))
    for name, fn in fns.items():
        def step(c, fn=fn):
            s, acc = c
            out = fn(s)
            dep = jnp.sum(out[:, :1]).astype(jnp.float32)
            return s.at[:, :1].add(0.0 * dep), acc + dep
        try:
            row[name] = timed_chain(step, (scores, jnp.zeros((), jnp.float32)), n_iter) * 1e6
        except Exception as e:  # noqa: BLE001 - report and go on
            row[name] = float("nan")
            row[name + "_err"] = repr(e)[:300]
        print(f"  R={R} T={T} {name:>15}{label}: {row[name]:8.1f} us", flush=True)
    return row


def sweep(R, T, configs, table, flag, names, k=K):
    """The stages `names` timed once per ';'-separated option set of `configs`, each set applied to the config dict
    `table` (read at trace time by the kernels' wrappers) and restored after; rows named like `full_set[opts]`."""
    rows = []
    for cfg in (configs.split(";") if configs else []):
        opts = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in cfg.split(",") if kv}
        unknown = set(opts) - set(table)
        if unknown:
            raise SystemExit(f"{flag}: unknown keys {sorted(unknown)}; known: {sorted(table)}")
        saved = dict(table)
        table.update(opts)
        try:
            row = stages(R, T, k=k, only=set(names), label=f" [{cfg}]")
        finally:
            table.clear()
            table.update(saved)
        rows.append(dict(R=R, T=T, config=cfg, **{f"{n}[{cfg}]": v for n, v in row.items()
                                                   if n in ("touch",) + tuple(names)}))
    return rows


def _only(names, stages_arg):
    """The sweep's stages, restricted to --stages where given."""
    return tuple(n for n in names if not stages_arg or n in stages_arg.split(","))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x262144,64x32768,64x262144")
    ap.add_argument("--out", default="/tmp/topk_stages")
    ap.add_argument("--stages", default=None, help="comma list of stage names (default: all)")
    ap.add_argument("--k", type=int, default=K, help="picks per row (default 512, V4-Flash's index_topk)")
    ap.add_argument("--select-configs", default=None,
                    help="';'-separated option sets of topk.SELECT_KERNEL_CONFIG (k=v,k=v): the radix-select "
                         "kernels' stages timed once per set")
    ap.add_argument("--fused-configs", default=None,
                    help="';'-separated option sets of topk_fused.FUSED_KERNEL_CONFIG: fused_set timed once per set")
    ap.add_argument("--hist-configs", default=None,
                    help="';'-separated option sets of topk_hist.HIST_KERNEL_CONFIG: the hist stages timed once per set")
    ap.add_argument("--tour-configs", default=None,
                    help="';'-separated option sets of topk_hist.TOUR_CONFIG: the tour stages timed once per set")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = []
    print(jax.devices(), flush=True)
    for c in a.cases.split(","):
        R, T = (int(x) for x in c.split("x"))
        rows.append(stages(R, T, k=a.k, only=set(a.stages.split(",")) if a.stages else None))
        rows += sweep(R, T, a.select_configs, T_.SELECT_KERNEL_CONFIG, "--select-configs",
                      _only(("bound", "select", "full_select", "full_set"), a.stages), k=a.k)
        rows += sweep(R, T, a.fused_configs, TF.FUSED_KERNEL_CONFIG, "--fused-configs", _only(("fused_set",), a.stages),
                      k=a.k)
        rows += sweep(R, T, a.hist_configs, TH.HIST_KERNEL_CONFIG, "--hist-configs",
                      _only(("hist_set", "hist_ties", "hist_prefix", "hist_pos", "hist_direct", "hist_half", "tour_seg"),
                            a.stages),
                      k=a.k)
        rows += sweep(R, T, a.tour_configs, TH.TOUR_CONFIG, "--tour-configs",
                      _only(("tour_set", "tour_prefix", "tour_half", "tour_ties", "tour_seg", "tour_fused",
                             "tour_fused_prefix"), a.stages), k=a.k)
        with open(os.path.join(a.out, "topk_stages.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
