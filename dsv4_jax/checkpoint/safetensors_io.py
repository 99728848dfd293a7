"""Streaming safetensors access: list tensors (name, dtype, shape, file) without reading data, read one at a time.

`safetensors.safe_open(framework="np")` cannot materialise F8_E4M3 / F8_E8M0 (numpy has no such dtypes), so those
are read directly from the file at the offsets the header gives (still one tensor at a time).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import ml_dtypes
import numpy as np
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_RAW_DTYPES = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: str              # safetensors dtype string: "BF16", "F32", "F8_E4M3", "F8_E8M0", "I8", "I64", ...
    shape: tuple[int, ...]


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files of a checkpoint directory (index.json order, else model.safetensors, else all)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    idx = os.path.join(path, INDEX_NAME)
    if os.path.exists(idx):
        with open(idx) as f:
            wm = json.load(f)["weight_map"]
        files = list(dict.fromkeys(wm.values()))
        return [os.path.join(path, f) for f in files]
    single = os.path.join(path, SINGLE_NAME)
    if os.path.exists(single):
        return [single]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {path}")
    return [os.path.join(path, f) for f in files]


def _read_header(file: str) -> tuple[int, dict]:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n, header


class SafetensorsReader:
    """Lists and reads the tensors of one checkpoint, one tensor at a time (context manager)."""

    def __init__(self, path: str | os.PathLike):
        self.files = checkpoint_files(path)
        self._handles: dict[str, object] = {}
        self._headers: dict[str, tuple[int, dict]] = {}
        self.infos: dict[str, TensorInfo] = {}
        dups = []
        for file in self.files:
            start, header = self._header(file)
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                if name in self.infos:
                    dups.append(name)
                self.infos[name] = TensorInfo(name, file, meta["dtype"], tuple(meta["shape"]))
        if dups:
            raise ValueError(f"tensors stored more than once in {path}: {dups[:20]}")

    def _header(self, file):
        if file not in self._headers:
            self._headers[file] = _read_header(file)
        return self._headers[file]

    def read(self, name: str) -> np.ndarray:
        info = self.infos[name]
        if info.dtype in _RAW_DTYPES:
            start, header = self._header(info.file)
            b0, b1 = header[name]["data_offsets"]
            dt = _RAW_DTYPES[info.dtype]
            with open(info.file, "rb") as f:
                f.seek(start + b0)
                buf = f.read(b1 - b0)
            return np.frombuffer(buf, dtype=dt).reshape(info.shape)
        h = self._handles.get(info.file)
        if h is None:
            h = self._handles[info.file] = safe_open(info.file, framework="np")
        return h.get_tensor(name)

    def close(self):
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
