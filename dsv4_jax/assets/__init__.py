"""Package data: the embedded default checkpoint (a tiny random-weight DeepSeek-V4-architecture model).

`tiny-v4/` holds `config.json` + `model.safetensors` in DeepSeek's ORIGINAL layout (FP8 e4m3 weights with ue8m0 block
scales, FP4 e2m1 routed experts), written by `scripts/build_embedded_model.py`. It is what `dsv4-jax generate` and
`dsv4-jax info` use when no `--checkpoint` is given. The weights are random (seeded): the model exercises every code
path (sliding / CSA / HCA layers, indexer, hash + learned MoE, mHC) but its text is meaningless.
"""

from __future__ import annotations

import os
from pathlib import Path

EMBEDDED_NAME = "tiny-v4"


def embedded_checkpoint_path() -> str:
    """Directory of the embedded default checkpoint (config.json + safetensors)."""
    path = Path(__file__).resolve().parent / EMBEDDED_NAME
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"embedded checkpoint not found at {path}; rebuild it with `python scripts/build_embedded_model.py`")
    return os.fspath(path)


__all__ = ["embedded_checkpoint_path", "EMBEDDED_NAME"]
