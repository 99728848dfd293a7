"""Writes DeepSeek-V4 checkpoints in the ORIGINAL DeepSeek layout (spec §5), optionally FP8/FP4 quantized.

dtype policy with quantize=True (as the released checkpoints):
  FP8 e4m3 + F8_E8M0 `.scale` [ceil(N/128), ceil(K/128)]: attn.{wq_a,wq_b,wkv,wo_a,wo_b}, attn.indexer.wq_b,
      ffn.shared_experts.{w1,w2,w3}
  I8-packed FP4 + F8_E8M0 `.scale` [N, K/32]: routed experts ffn.experts.{e}.{w1,w2,w3}.weight
  F32: hc_* , attn_sink, ape, ffn.gate.bias;  I64: ffn.gate.tid2eid;  BF16: everything else (embed, head, norms,
      compressor wkv/wgate, indexer weights_proj, gate.weight)
With quantize=False every floating tensor is written F32 (lossless).
"""

from __future__ import annotations

import json
import os
import re

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from .. import quant
from . import names as N
from .safetensors_io import INDEX_NAME, SINGLE_NAME

_FP8_RE = re.compile(
    r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123])\.weight$")


def tensor_format(name: str, quantize: bool = True) -> str:
    """'fp8' | 'fp4' | 'bf16' | 'f32' | 'i64' for a canonical tensor name."""
    if name.endswith("tid2eid"):
        return "i64"
    if N.is_stacked_expert(name):
        return "fp4" if quantize else "f32"
    if _FP8_RE.match(name):
        return "fp8" if quantize else "f32"
    last = name.rsplit(".", 1)[-1]
    if last.startswith("hc_") or last in ("attn_sink", "ape") or name.endswith("ffn.gate.bias"):
        return "f32"
    return "bf16" if quantize else "f32"


def _encode(name: str, x: np.ndarray, fmt: str):
    """-> (list of (key, array to write), dequantized float32/int value)."""
    if fmt == "i64":
        v = np.asarray(x).astype(np.int64)
        return [(name, v)], v
    x = np.asarray(x, np.float32)
    if fmt == "f32":
        return [(name, x)], x
    if fmt == "bf16":
        b = x.astype(ml_dtypes.bfloat16)
        return [(name, b)], b.astype(np.float32)
    if fmt == "fp8":
        q, s = quant.quant_fp8_block(x)
        deq = quant.dequant_fp8_block(q, s)
        base = name[: -len(".weight")]
        return [(name, q.view(ml_dtypes.float8_e4m3fn)), (base + ".scale", s.view(ml_dtypes.float8_e8m0fnu))], deq
    if fmt == "fp4":  # stacked [E, N, K]
        out, deqs = [], []
        for e in range(x.shape[0]):
            p, s = quant.quant_fp4(x[e])
            deqs.append(quant.dequant_fp4(p, s))
            key = N.expert_key(name, e)
            out += [(key, p), (key[: -len(".weight")] + ".scale", s.view(ml_dtypes.float8_e8m0fnu))]
        return out, np.stack(deqs)
    raise ValueError(fmt)


def _fp4_experts(state: dict, quantize: bool) -> dict[str, tuple[list, np.ndarray]]:
    """Pops the FP4 expert stacks of a model with expert_weights "fp4" (`names.fp4_stacks`: [E, out, in/2] bytes and
    [E, out, in/32] e8m0 scales, canonical orientation) from `state` -> {stack name: (tensors to write, dequantized
    f32 [E, out, in])}: the bytes as they are with quantize, the dequantized values (F32, lossless) without."""
    out = {}
    for name in [n for n in state if N.is_stacked_expert(n) and n.endswith("_fp4")]:
        base = name[: -len("_fp4")]
        packed, scales = np.asarray(state.pop(name)), np.asarray(state.pop(N.fp4_stacks(base)[1]))
        deq = np.stack([quant.dequant_fp4(packed[e].view(np.int8), scales[e]) for e in range(packed.shape[0])])
        if not quantize:
            out[base] = (_stacked_f32(base, deq), deq)
            continue
        tensors = []
        for e in range(packed.shape[0]):
            key = N.expert_key(base, e)
            tensors += [(key, packed[e].view(np.int8)),
                        (key[: -len(".weight")] + ".scale", scales[e].view(ml_dtypes.float8_e8m0fnu))]
        out[base] = (tensors, deq)
    return out


def _stacked_f32(name, x):
    out = []
    for e in range(x.shape[0]):
        out.append((N.expert_key(name, e), np.ascontiguousarray(x[e])))
    return out


def _layer_sort_key(name: str):
    m = re.match(r"^layers\.(\d+)\.(.*)$", name)
    return (1, int(m.group(1)), m.group(2)) if m else (0 if not name.startswith("head") else 2, 0, name)


def save_deepseek_checkpoint(state, config, path, quantize: bool = True, max_shard_bytes: int = 4 << 30,
                             progress: bool = False) -> dict[str, np.ndarray]:
    """Writes `state` (canonical name -> array, stacked experts; or an NNX model) as a DeepSeek-layout checkpoint.

    Writes `config.json` (DeepSeek's dialect) and `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards
    plus `model.safetensors.index.json` when the total exceeds `max_shard_bytes`. Returns canonical name -> the
    values a float32 load of the written files produces (dequantized FP8/FP4, bf16-rounded), so an oracle can hold
    exactly those.
    """
    if not isinstance(state, dict):
        from .loader import canonical_state_dict

        state = canonical_state_dict(state)
    state = dict(state)
    fp4 = _fp4_experts(state, quantize)   # a model holding the checkpoint's FP4 experts: written as they are
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_deepseek_dict(), f, indent=2)

    deq: dict[str, np.ndarray] = {}
    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    from tqdm.auto import tqdm

    for name in tqdm(sorted(list(state) + list(fp4), key=_layer_sort_key), desc="writing checkpoint",
                     disable=not progress):
        if name in fp4:
            tensors, deq[name] = fp4[name]
        elif N.is_stacked_expert(name) and tensor_format(name, quantize) == "f32":
            x = np.asarray(state[name], np.float32)
            tensors, deq[name] = _stacked_f32(name, x), x
        else:
            tensors, deq[name] = _encode(name, np.asarray(state[name]), tensor_format(name, quantize))
        nbytes = sum(t.nbytes for _, t in tensors)
        if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        for k, t in tensors:
            shards[-1][k] = np.ascontiguousarray(t)
        sizes[-1] += nbytes

    for f in os.listdir(path):  # stale files from an earlier write
        if f.endswith(".safetensors") or f == INDEX_NAME:
            os.remove(os.path.join(path, f))
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE_NAME), metadata={"format": "pt"})
    else:
        n = len(shards)
        weight_map = {}
        for i, sh in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file(sh, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in sh})
        with open(os.path.join(path, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": int(sum(sizes))}, "weight_map": weight_map}, f, indent=2)
    return deq
