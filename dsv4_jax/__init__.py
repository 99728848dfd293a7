"""dsv4-jax: DeepSeek-V4 in JAX / Flax NNX / Pallas."""

from .accounting import cache_bytes, per_token_bytes
from .assets import embedded_checkpoint_path
from .checkpoint import load_orbax, load_pretrained, save_orbax
from .config import DeepseekV4Config
from .engine import generate, generate_with_stats
from .inspect_attention import AttentionTrace, trace_attention
from .model import DeepseekV4ForCausalLM, forward_chunk

__all__ = [
    "DeepseekV4Config", "DeepseekV4ForCausalLM", "forward_chunk", "load_pretrained", "save_orbax", "load_orbax",
    "generate", "generate_with_stats", "cache_bytes", "per_token_bytes", "embedded_checkpoint_path",
    "trace_attention", "AttentionTrace",
]
