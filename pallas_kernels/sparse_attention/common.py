"""Input validation and flattening shared by the sparse-attention kernels (GPU and TPU)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .fp8_layout import HEAD_DIM, Fp8KVPool


@dataclasses.dataclass(frozen=True)
class Source:
    """One KV source flattened for a kernel: the pool (array or Fp8KVPool), idx [BT, K] int32, len [BT] int32."""

    pool: object
    idx: object
    length: object
    n_rows: int
    k: int
    fp8: bool


def _pool_info(pool, name):
    if isinstance(pool, Fp8KVPool):
        pool.validate(name)
        return pool.nope.shape[0], HEAD_DIM, True
    if not hasattr(pool, "ndim") or pool.ndim != 2:
        raise ValueError(f"{name} must be a [rows, head_dim] array or an Fp8KVPool, got {getattr(pool, 'shape', type(pool))}")
    if not jnp.issubdtype(pool.dtype, jnp.floating):
        raise ValueError(f"{name} must have a float dtype (or be an Fp8KVPool), got {pool.dtype}")
    return pool.shape[0], pool.shape[1], False


def validate(q, window_kv, window_idx, compressed_kv, compressed_idx, sinks, window_len, compressed_len, scale):
    """Raise ValueError with a clear message on bad shapes / dtypes. Returns (B, T, H, D)."""
    if getattr(q, "ndim", None) != 4:
        raise ValueError(f"q must be [batch, queries, heads, head_dim], got shape {getattr(q, 'shape', None)}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype}")
    b, t, h, d = q.shape
    if (compressed_kv is None) != (compressed_idx is None):
        raise ValueError("compressed_kv and compressed_idx must both be given or both be None")
    if compressed_kv is None and compressed_len is not None:
        raise ValueError("compressed_len given without compressed_kv")
    for pool, idx, length, name in (
        (window_kv, window_idx, window_len, "window"),
        (compressed_kv, compressed_idx, compressed_len, "compressed"),
    ):
        if pool is None:
            continue
        n, pd, _ = _pool_info(pool, f"{name}_kv")
        if pd != d:
            raise ValueError(f"{name}_kv head_dim {pd} != q head_dim {d}")
        if getattr(idx, "ndim", None) != 3 or tuple(idx.shape[:2]) != (b, t):
            raise ValueError(f"{name}_idx must be [batch={b}, queries={t}, k], got {getattr(idx, 'shape', None)}")
        if not jnp.issubdtype(idx.dtype, jnp.integer):
            raise ValueError(f"{name}_idx must be an integer array, got {idx.dtype}")
        if idx.shape[2] < 1:
            raise ValueError(f"{name}_idx must have at least one entry per query")
        if length is not None:
            if tuple(getattr(length, "shape", ())) != (b, t):
                raise ValueError(f"{name}_len must be [batch={b}, queries={t}], got {getattr(length, 'shape', None)}")
            if not jnp.issubdtype(length.dtype, jnp.integer):
                raise ValueError(f"{name}_len must be an integer array, got {length.dtype}")
    if getattr(sinks, "shape", None) != (h,):
        raise ValueError(f"sinks must be [heads={h}], got {getattr(sinks, 'shape', None)}")
    if not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a Python float, got {type(scale)}")
    return b, t, h, d


def flatten_source(pool, idx, length, bt: int, pad_to: int, clip: bool = True) -> Source:
    """idx [B,T,K] -> [BT, Kpad] int32 (padded with -1 to a multiple of pad_to); len -> [BT] int32 clipped to [0, K]
    (clip=False: as given, for a kernel that clamps them itself)."""
    k = idx.shape[-1]
    idx2 = idx.reshape(bt, k).astype(jnp.int32)
    kp = -(-k // pad_to) * pad_to
    if kp != k:
        idx2 = jnp.pad(idx2, ((0, 0), (0, kp - k)), constant_values=-1)
    if length is None:
        len2 = jnp.full((bt,), k, jnp.int32)
    else:
        len2 = length.reshape(bt).astype(jnp.int32)
        if clip:
            len2 = jnp.clip(len2, 0, k)
    n_rows = pool.nope.shape[0] if isinstance(pool, Fp8KVPool) else pool.shape[0]
    return Source(pool, idx2, len2, n_rows, kp, isinstance(pool, Fp8KVPool))


def combine_splits(o_parts, lse_parts, sinks, out_dtype):
    """Merge split-K partials. o_parts [..., S, H, D] (any float dtype; each normalised by its own sum), lse_parts
    [..., S, H] (natural log, -inf = empty); sinks [H]. Returns (o [..., H, D] out_dtype, lse [..., H]).

    Two XLA kernels on the GPU: the per-(row, head) weights w_s = exp(lse_s - m) / (sum_s exp(lse_s - m) +
    exp(sink - m)), then one elementwise pass o = sum_s w_s o_s over the partials as stored. The split axis S is
    static and small, so both are unrolled over it: written with reductions over S and an einsum (up to session
    13), XLA emitted three kernels, an f32 copy of the partials included (CSA B=64 decode: 5.8 us of kernels next
    to the attention kernel's 26.5, session 14's benchmarks/decode_kernels.py)."""
    sinks = sinks.astype(jnp.float32)
    n = lse_parts.shape[-2]
    lse_s = [lse_parts[..., i, :].astype(jnp.float32) for i in range(n)]
    m = sinks
    for x in lse_s:
        m = jnp.maximum(m, x)                      # [..., H] finite (the sink is)
    w = [jnp.exp(x - m) for x in lse_s]            # 0 for empty splits
    sw = sum(w[1:], w[0])
    inv = 1.0 / (sw + jnp.exp(sinks - m))
    wn = jnp.stack([x * inv for x in w], axis=-2)  # [..., S, H]: one small array, so one small kernel
    o = sum(wn[..., i, :, None] * o_parts[..., i, :, :].astype(jnp.float32) for i in range(n))
    lse = jnp.where(sw > 0, jnp.log(sw) + m, -jnp.inf)
    return o.astype(out_dtype), lse


N_SM = 132   # the H100's and the H200's SMs


# The split count past one wave of CTAs (`wave_splits`), in units of one CTA's 64-row step (~2.9 us on the H100 with
# every SM gathering; H100 session 57, results/h100_s57r2_dk.log): a CTA's fixed cost (q and output tiles, the first
# block's latency, the epilogue), the XLA merge's (launch, then per (row, split) partial), and the least gain the
# estimate must promise before the default leaves one split a row.
WAVE_CTA_FIXED = 2.0
WAVE_MERGE = (2.0, 0.005)
WAVE_MIN_GAIN = 0.15
WAVE_MAX_SPLITS = 16


def wave_estimate(rows: int, total_blocks: int, n_splits: int, n_sm: int = N_SM) -> float:
    """A decode call's time in CTA steps with `n_splits` splits a row, one CTA an SM (the kernel's ~200 KB of shared
    memory): waves of n_sm CTAs, each as long as its CTA's steps plus the fixed cost, and the XLA merge where
    n_splits > 1 (past one wave the clusters of the in-kernel merge do not all fit)."""
    steps = -(-total_blocks // n_splits) + WAVE_CTA_FIXED
    merge = WAVE_MERGE[0] + WAVE_MERGE[1] * rows * n_splits if n_splits > 1 else 0.0
    return -(-rows * n_splits // n_sm) * steps + merge


def wave_splits(rows: int, total_blocks: int, n_sm: int = N_SM) -> int:
    """Splits a row where the rows alone fill more than one wave of CTAs. One split a row leaves the last wave
    with rows - n_sm CTAs that take as long as a full one: HCA-8K (130 steps a row) at B = 136 took 722.8 us
    against 384.4 at B = 128 on the H100, and 517.0 with 4 splits (FP8: 956.1 -> 618.3); B = 192 718.2 -> 614.2
    with 2. Short lists gain nothing measurable (CSA and HCA-1K at B = 136 / 192: 1-2 splits within 1-4 us or
    slower with the merge), hence the margin: the count with the lowest `wave_estimate`, if it promises
    WAVE_MIN_GAIN over one split, else 1."""
    est = {ns: wave_estimate(rows, total_blocks, ns, n_sm)
           for ns in range(1, max(1, min(total_blocks, WAVE_MAX_SPLITS)) + 1)}
    best = min(est, key=est.get)
    return best if est[best] < (1.0 - WAVE_MIN_GAIN) * est[1] else 1


def split_count(rows: int, total_blocks: int, decode: bool, block_k: int = 64, n_sm: int = N_SM) -> int:
    """Both GPU kernels' default split-K count: rows = CTAs (programs) a split needs, total_blocks of block_k entries
    a row. Up to one wave, enough splits to fill the SMs, at least two blocks a split; past it, `wave_splits` for
    decode shapes (counted in 64-entry steps, the unit it was fitted in) and one split a row for prefill's (many
    waves, each query with its own list)."""
    if rows <= n_sm:
        return max(1, min(n_sm // max(rows, 1), max(1, total_blocks // 2)))
    if decode:
        return wave_splits(rows, -(-total_blocks * block_k // 64), n_sm)
    return 1
