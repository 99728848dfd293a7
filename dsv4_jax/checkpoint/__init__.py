"""Checkpoint I/O: safetensors loading (DeepSeek original FP8/FP4 layout and transformers layouts), the DeepSeek-layout
writer, and an orbax round trip."""

from .loader import (CheckpointMismatchError, canonical_state_dict, load_config, load_pretrained,
                     read_into_targets)
from .names import canonicalize
from .orbax_io import load_orbax, save_orbax
from .writer import save_deepseek_checkpoint, tensor_format

__all__ = ["load_pretrained", "save_orbax", "load_orbax", "save_deepseek_checkpoint", "CheckpointMismatchError",
           "canonical_state_dict", "canonicalize", "load_config", "read_into_targets", "tensor_format"]
