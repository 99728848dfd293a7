"""Test fixtures: a fully randomized transformers DeepseekV4ForCausalLM oracle and its checkpoints (not a test module).

    hf = make_hf_model(config, seed)               # float32, eval, eager attention, every param/buffer random
    sd = hf_to_canonical(hf)                       # {canonical name: np.ndarray}, experts stacked
    write_hf_layout(hf, dir)                       # transformers' save_pretrained
    deq = write_deepseek_layout(hf, config, dir)   # DeepSeek original layout (FP8/FP4), oracle now holds `deq`
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dsv4_jax.checkpoint import names as N
from dsv4_jax.checkpoint.writer import save_deepseek_checkpoint
from dsv4_jax.config import DeepseekV4Config


def hf_config(config: DeepseekV4Config):
    from transformers import DeepseekV4Config as HFConfig

    hc = HFConfig(**config.to_hf_dict())
    hc._attn_implementation = "eager"
    return hc


def _randomize_(name: str, t: torch.Tensor, g: torch.Generator, config: DeepseekV4Config) -> None:
    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    last = name.rsplit(".", 1)[-1]
    if last == "tid2eid":
        v, k = t.shape
        ids = torch.rand(v, config.n_routed_experts, generator=g).argsort(dim=1)[:, :k]
        t.copy_(ids.to(t.dtype))
    elif last == "e_score_correction_bias":
        t.copy_(0.3 * randn(*t.shape))
    elif last == "sinks":
        t.copy_(0.5 * randn(*t.shape))
    elif last == "position_bias":
        t.copy_(0.5 * randn(*t.shape))
    elif last in ("base", "hc_base"):
        t.copy_(0.2 * randn(*t.shape))
    elif last in ("scale", "hc_scale"):
        t.copy_(1.0 + 0.1 * randn(*t.shape))
    elif last in ("fn", "hc_fn"):
        t.copy_(randn(*t.shape) / math.sqrt(t.shape[-1]))
    elif t.dim() == 1:  # every RMSNorm weight
        t.copy_(1.0 + 0.1 * randn(*t.shape))
    elif name.endswith("embed_tokens.weight"):
        t.copy_(randn(*t.shape))
    elif t.dim() in (2, 3):  # Linear [out, in], experts [E, out, in]
        t.copy_(randn(*t.shape) / math.sqrt(t.shape[-1]))
    else:
        raise AssertionError(f"unhandled tensor {name} {tuple(t.shape)}")


def make_hf_model(config: DeepseekV4Config, seed: int = 0):
    """transformers DeepseekV4ForCausalLM (float32, eval, eager) with every parameter and persistent buffer random."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(config)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():  # params + persistent buffers, storage shared with the model
            _randomize_(name, t, g, config)
    return model


def _hf_state(hf_model):
    return {k: v for k, v in hf_model.state_dict().items() if "rotary_emb" not in k}


def hf_to_canonical(hf_model) -> dict[str, np.ndarray]:
    """The oracle's tensors under our canonical names (experts stacked [E, ...], tid2eid int64)."""
    out = {}
    for k, v in _hf_state(hf_model).items():
        t = N.canonicalize(k)
        a = v.detach().cpu().numpy().copy()
        if t.kind == N.GATE_UP:
            half = a.shape[1] // 2
            out[t.names[0]], out[t.names[1]] = a[:, :half].copy(), a[:, half:].copy()
        else:
            out[t.name] = a
    return out


def load_canonical_into_hf(hf_model, state: dict[str, np.ndarray]) -> None:
    """Copies canonical-name values into the oracle (inverse of hf_to_canonical)."""
    with torch.no_grad():
        for k, t in _hf_state(hf_model).items():
            tg = N.canonicalize(k)
            if tg.kind == N.GATE_UP:
                a = np.concatenate([state[tg.names[0]], state[tg.names[1]]], axis=1)
            else:
                a = state[tg.name]
            assert tuple(a.shape) == tuple(t.shape), (k, a.shape, t.shape)
            t.copy_(torch.from_numpy(np.asarray(a)).to(t.dtype))


def write_hf_layout(hf_model, path, **kw) -> None:
    """transformers' own save_pretrained (safetensors)."""
    hf_model.save_pretrained(path, **kw)


def write_deepseek_layout(hf_model, config: DeepseekV4Config, path, quantize: bool = True, **kw) -> dict:
    """Writes the DeepSeek original layout via dsv4_jax's writer, then loads the dequantized values back into the
    oracle so it holds exactly what the checkpoint encodes. Returns canonical name -> dequantized value."""
    deq = save_deepseek_checkpoint(hf_to_canonical(hf_model), config, path, quantize=quantize, **kw)
    load_canonical_into_hf(hf_model, deq)
    return deq


def hf_logits(hf_model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.from_numpy(np.asarray(ids, np.int64))).logits.float().numpy()
