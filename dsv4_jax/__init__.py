"""dsv4-jax: DeepSeek-V4 in JAX / Flax NNX."""

from .checkpoint import load_orbax, load_pretrained, save_orbax
from .config import DeepseekV4Config
