"""`load_pretrained`: stream a safetensors checkpoint (either layout, FP8/FP4 or plain) into an abstract NNX model."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import quant
from ..config import DeepseekV4Config
from . import names as N
from .safetensors_io import SafetensorsReader, TensorInfo

CONFIG_NAME = "config.json"


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model: lists every missing, unexpected and mis-shaped tensor at once."""

    def __init__(self, missing=(), unexpected=(), mismatched=(), path=None, max_list: int = 40):
        self.missing, self.unexpected, self.mismatched = list(missing), list(unexpected), list(mismatched)
        self.path = path

        def block(title, items):
            if not items:
                return ""
            shown = "\n    ".join(items[:max_list])
            more = f"\n    ... and {len(items) - max_list} more" if len(items) > max_list else ""
            return f"\n  {title} ({len(items)}):\n    {shown}{more}"

        msg = (f"checkpoint {path or ''} does not match the model:"
               + block("missing tensors", self.missing)
               + block("unexpected tensors", self.unexpected)
               + block("mis-shaped tensors", self.mismatched))
        super().__init__(msg)


# ------------------------------------------------------------------------------------------------ model state helpers
def _is_loadable(path, x) -> bool:
    return isinstance(x, nnx.Param) or (bool(path) and path[-1] == "tid2eid")


def _path_name(path) -> str:
    return ".".join(str(p) for p in path)


def _leaf_value(v):
    return v.get_value() if isinstance(v, nnx.Variable) else v


def canonical_state_dict(model) -> dict[str, np.ndarray]:
    """Canonical name -> numpy array of every loadable tensor (Params and the hash-routing tid2eid tables), in the
    checkpoints' orientation (`names.canonical_layout`: routed-expert stacks [E, out, in])."""
    _, loadable, _ = nnx.split(model, _is_loadable, ...)
    flat = ((_path_name(p), v) for p, v in nnx.to_flat_state(loadable))
    return {name: N.canonical_layout(name, np.asarray(_leaf_value(v))) for name, v in flat}


def _default_factory():
    from ..model import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM


def model_constructor(config, dtype=jnp.float32, attention_impl="auto", model_factory=None, **model_options):
    """model_options (e.g. indexer_picks) go to the factory as keyword arguments."""
    factory = model_factory or _default_factory()
    return lambda: factory(config, dtype=dtype, attention_impl=attention_impl, rngs=nnx.Rngs(0), **model_options)


def fill_abstract_model(ctor, values_fn):
    """Builds the model abstractly, fills loadable leaves from `values_fn(targets)` and materialises the rest.

    `targets` is {canonical name: ShapeDtypeStruct}; `values_fn` returns {canonical name: jax.Array}. Non-loadable
    state (e.g. RoPE frequency tables) is computed by running the constructor under jit keeping only that state, so
    XLA drops the random parameter initialisation.
    """
    abstract = nnx.eval_shape(ctor)
    graphdef, loadable, rest = nnx.split(abstract, _is_loadable, ...)
    flat = list(nnx.to_flat_state(loadable))
    targets = {_path_name(p): _leaf_value(v) for p, v in flat}
    values = values_fn(targets)
    new_flat = []
    for p, v in flat:
        arr = values[_path_name(p)]
        new_flat.append((p, v.replace(arr) if isinstance(v, nnx.Variable) else arr))
    loadable = nnx.from_flat_state(new_flat)
    if jax.tree_util.tree_leaves(rest):
        rest = jax.jit(lambda: nnx.split(ctor(), _is_loadable, ...)[2])()
    return nnx.merge(graphdef, loadable, rest)


# ------------------------------------------------------------------------------------------------ planning
@dataclasses.dataclass
class _Item:
    key: str
    target: N.Target
    info: TensorInfo
    scale: TensorInfo | None
    fmt: str  # "plain" | "fp8" | "fp4"
    keep_fp4: bool = False  # an FP4 expert kept as its bytes + scales (a model with expert_weights "fp4")


def _ceil_div(a, b):
    return -(-a // b)


def _logical_shape(info: TensorInfo, scale: TensorInfo | None):
    """(fmt, logical shape, error or None)."""
    shape = info.shape
    if scale is None:
        return "plain", shape, None
    if info.dtype == "I8" and len(shape) == 2:
        n, k = shape[0], shape[1] * 2
        want = (n, _ceil_div(k, quant.FP4_BLOCK))
        err = None if scale.shape == want else f"{scale.name}: shape {list(scale.shape)}, expected {list(want)} (fp4 scale)"
        return "fp4", (n, k), err
    if info.dtype in ("F8_E4M3",) and len(shape) == 2:
        n, k = shape
        want = (_ceil_div(n, quant.FP8_BLOCK), _ceil_div(k, quant.FP8_BLOCK))
        err = None if scale.shape == want else f"{scale.name}: shape {list(scale.shape)}, expected {list(want)} (fp8 block scale)"
        return "fp8", shape, err
    return "plain", shape, f"{scale.name}: quantization scale on a {info.dtype} tensor {info.name} is not supported"


def plan_load(infos: dict[str, TensorInfo], targets: dict[str, jax.ShapeDtypeStruct], path=None):
    """Matches checkpoint tensors to canonical targets (the model's shapes; checked in the checkpoint's orientation,
    `names.canonical_shape`). Returns (items, mtp_names) or raises CheckpointMismatchError."""
    keys = set(infos)
    scale_of = {}
    for k in infos:
        w = N.scale_owner(k, keys)
        if w is not None:
            scale_of[w] = infos[k]
    scale_keys = {s.name for s in scale_of.values()}
    items, mtp, unexpected, mismatched = [], [], [], []
    filled: dict[str, set] = {}
    for k, info in infos.items():
        if k in scale_keys:
            continue
        if N.is_mtp(k):
            mtp.append(k)
            if k in scale_of:
                mtp.append(scale_of[k].name)
            continue
        t = N.canonicalize(k)
        keep_fp4 = t is not None and t.name not in targets and N.fp4_stacks(t.name)[0] in targets
        if keep_fp4 and t.kind != N.EXPERT:   # transformers' merged / stacked experts: dequantized already
            mismatched.append(f"{k}: expert_weights='fp4' keeps DeepSeek's per-expert FP4 tensors as they are; this "
                              f"checkpoint holds the experts as {info.dtype}{list(info.shape)} (load it with "
                              f"expert_weights='dequantized')")
            for n in N.fp4_stacks(t.name):
                filled.setdefault(n, set()).update(range(targets[n].shape[0]))
            continue
        if t is None or (not keep_fp4 and any(n not in targets for n in t.names)):
            unexpected.append(f"{k} {info.dtype}{list(info.shape)}")
            continue
        scale = scale_of.get(k)
        fmt, shape, err = _logical_shape(info, scale)
        if keep_fp4:
            packed_name = N.fp4_stacks(t.name)[0]
            pshape = N.canonical_shape(packed_name, targets[packed_name].shape)     # [E, out, in/2]
            if fmt != "fp4" and not err:
                err = (f"{k}: expert_weights='fp4' keeps the checkpoint's FP4 experts as they are; this one is "
                       f"{info.dtype}{list(info.shape)} (load with expert_weights='dequantized')")
            tshape = (pshape[0], pshape[1], 2 * pshape[2])
        else:
            tshape = N.canonical_shape(t.name, targets[t.name].shape)
        if t.kind == N.PLAIN:
            want = tshape
        elif t.kind == N.EXPERT:
            want = tshape[1:]
            if t.index >= tshape[0]:
                unexpected.append(f"{k} (expert {t.index} >= n_routed_experts {tshape[0]})")
                continue
        elif t.kind == N.GATE_UP:
            want = (tshape[0], 2 * tshape[1], tshape[2])
        else:  # STACKED
            want = tshape
        if t.kind == N.EXPERT:
            slots = [(n, t.index) for n in (N.fp4_stacks(t.name) if keep_fp4 else (t.name,))]
        elif t.kind in (N.GATE_UP, N.STACKED):
            slots = [(n, e) for n in t.names for e in range(tshape[0])]
        else:
            slots = [(t.name, None)]
        dup = [s for s in slots if s[1] in filled.get(s[0], ())]
        if dup:
            unexpected.append(f"{k} (duplicate: {dup[0][0]} already given by another tensor)")
            continue
        for n, e in slots:  # present (even if mis-shaped): not reported as missing
            filled.setdefault(n, set()).add(e)
        if err:
            mismatched.append(err)
            continue
        if tuple(shape) != want:
            mismatched.append(f"{k}: shape {list(shape)}, expected {list(want)}")
            continue
        items.append(_Item(k, t, info, scale, fmt, keep_fp4))
    missing = []
    for name, sds in targets.items():
        got = filled.get(name, set())
        if N.is_stacked_expert(name):
            missing.extend(N.expert_key(name, e) for e in range(sds.shape[0]) if e not in got)
        elif None not in got:
            missing.append(name)
    if missing or unexpected or mismatched:
        raise CheckpointMismatchError(missing, unexpected, mismatched, path=path)
    return items, mtp


# ------------------------------------------------------------------------------------------------ reading
def _dequant(reader: SafetensorsReader, item: _Item) -> np.ndarray:
    x = reader.read(item.info.name)
    if item.fmt == "fp8":
        return quant.dequant_fp8_block(x, reader.read(item.scale.name))
    if item.fmt == "fp4":
        return quant.dequant_fp4(x, reader.read(item.scale.name))
    return x  # bf16 / f32 / int (or unscaled f8, which _cast widens through f32)


def _cast(x: np.ndarray, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    if x.dtype == dt:
        return x
    if dt.kind in "iu" and x.dtype.kind in "iu":
        return x.astype(dt)
    if x.dtype.kind not in "fiu" and x.dtype != dt:  # bfloat16 / f8 -> go through f32
        x = x.astype(np.float32)
    return x.astype(dt)


def read_into_targets(path, targets, progress=True, strict=True):
    """Streams checkpoint `path` into {canonical name: jax.Array} shaped/typed like `targets`. Returns (values, mtp)."""
    from tqdm.auto import tqdm

    with SafetensorsReader(path) as reader:
        items, mtp = plan_load(reader.infos, targets, path=os.fspath(path))
        values: dict[str, jax.Array] = {}
        buffers: dict[str, list] = {}  # stacked name -> [numpy buffer, remaining count]

        def put(name, arr):  # arr: in the model's orientation (names.model_layout)
            sds = targets[name]
            sh = getattr(sds, "sharding", None)
            values[name] = jax.device_put(arr, sh) if sh is not None else jax.device_put(arr)

        def put_expert(name, index, arr):   # one expert's slice into its stack; the stack goes out when complete
            sds = targets[name]
            if name not in buffers:
                buffers[name] = [np.empty(sds.shape, np.dtype(sds.dtype)), sds.shape[0]]
            buf = buffers[name]
            buf[0][index] = arr
            buf[1] -= 1
            if buf[1] == 0:
                put(name, buffers.pop(name)[0])

        for item in tqdm(items, desc="loading checkpoint", unit="tensor", disable=not progress):
            t = item.target
            if item.keep_fp4:   # the FP4 bytes and e8m0 scales as they are, [out, in/2] and [out, in/32]
                packed_name, scale_name = N.fp4_stacks(t.name)
                raw = np.asarray(reader.read(item.info.name)).view(np.uint8)
                put_expert(packed_name, t.index, N.model_layout(packed_name, raw))
                put_expert(scale_name, t.index, N.model_layout(scale_name, np.asarray(reader.read(
                    item.scale.name)).view(np.uint8)))
                continue
            x = _dequant(reader, item)
            if t.kind == N.PLAIN:
                put(t.name, _cast(x, targets[t.name].dtype))
            elif t.kind == N.EXPERT:   # [out, in] -> its [in, out] slot
                put_expert(t.name, t.index, N.model_layout(t.name, _cast(x, targets[t.name].dtype)))
            elif t.kind == N.GATE_UP:
                n1, n3 = t.names
                half = x.shape[1] // 2
                put(n1, _cast(np.ascontiguousarray(N.model_layout(n1, x[:, :half])), targets[n1].dtype))
                put(n3, _cast(np.ascontiguousarray(N.model_layout(n3, x[:, half:])), targets[n3].dtype))
            else:  # STACKED
                put(t.name, _cast(np.ascontiguousarray(N.model_layout(t.name, x)), targets[t.name].dtype))
            del x
    return values, mtp


# ------------------------------------------------------------------------------------------------ public API
def load_config(path) -> DeepseekV4Config:
    path = os.fspath(path)
    cfg = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), CONFIG_NAME)
    return DeepseekV4Config.from_json_file(cfg)


def load_pretrained(path, dtype=jnp.float32, attention_impl: str = "auto", progress: bool = True, *,
                    config: DeepseekV4Config | None = None, model_factory=None, **model_options):
    """Loads a DeepSeek-V4 checkpoint directory into `DeepseekV4ForCausalLM`.

    `path` holds `config.json` (DeepSeek's or transformers' dialect) and either `model.safetensors` or shards with
    `model.safetensors.index.json`. Accepted tensor layouts: DeepSeek's original (FP8 e4m3 + e8m0 `.scale`, FP4
    experts packed in I8 + per-32 `.scale`, BF16/F32/I64), transformers' `save_pretrained` output, and transformers'
    in-memory names; `.weight_scale_inv` is accepted as a scale name. Tensors are read and dequantized one at a
    time and cast to the parameter dtype (`dtype` for matmul weights; norms, mHC, sinks, ape, gate bias stay f32).
    `mtp.*` tensors are not loaded; their names are kept in `model.mtp_tensor_names`.
    Raises CheckpointMismatchError (a ValueError) listing every missing / unexpected / mis-shaped tensor.
    `model_options` go to the model's constructor (`DeepseekV4ForCausalLM`: indexer_picks="auto" | "sorted" | "set").
    """
    config = config or load_config(path)
    ctor = model_constructor(config, dtype, attention_impl, model_factory, **model_options)
    mtp_box = []

    def values_fn(targets):
        values, mtp = read_into_targets(path, targets, progress=progress)
        mtp_box.extend(mtp)
        return values

    model = fill_abstract_model(ctor, values_fn)
    model.mtp_tensor_names = tuple(mtp_box)
    return model
