"""DeepSeek-V4 configuration: both `config.json` dialects, presets, validation.

Two dialects exist (spec §2.1, §2.3, §8.3):

* DeepSeek's own: `compress_ratios` (one int per layer, plus a trailing entry for the MTP layer),
  `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling` (YaRN) — as shipped in the HF repos' root config.
* transformers': `layer_types` (`sliding_attention` / `compressed_sparse_attention` /
  `heavily_compressed_attention`), `compress_rates` (per layer type), `mlp_layer_types`
  (`hash_moe` / `moe`), `rope_parameters` (`main` / `compress` sub-dicts).

Both are folded into one :class:`DeepseekV4Config` whose per-layer schedule is explicit:
`layer_types[i]` in {"sliding", "csa", "hca"} and `compress_ratios[i]` (0 for sliding layers).
A CSA layer has an overlapping compressor (two series per token) and a Lightning Indexer; an HCA layer has a
non-overlapping compressor and attends to every causally complete entry. The released checkpoints use ratio 4
for CSA and 128 for HCA; any ratio >= 2 works for HCA (tests use small ones so short sequences cross windows).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

SLIDING, CSA, HCA = "sliding", "csa", "hca"
LAYER_TYPES = (SLIDING, CSA, HCA)

_HF_LAYER_TYPE = {
    "sliding_attention": SLIDING,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
_HF_LAYER_TYPE_INV = {v: k for k, v in _HF_LAYER_TYPE.items()}


class ConfigError(ValueError):
    """Raised for an invalid or inconsistent DeepSeek-V4 configuration."""


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN parameters of the compress RoPE table (spec §3.5). No mscale is applied (attention factor 1)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    # Per backbone layer: "sliding" | "csa" | "hca", and its compression ratio (0 for sliding).
    layer_types: tuple[str, ...] = ()
    compress_ratios: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = YarnScaling()
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    routed_scaling_factor: float = 1.5
    num_hash_layers: int = 3
    scoring_func: str = "sqrtsoftplus"
    swiglu_limit: float = 10.0
    num_nextn_predict_layers: int = 1
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1

    def __post_init__(self):
        if not self.layer_types and self.num_hidden_layers:
            raise ConfigError("layer_types / compress_ratios must be given (one entry per backbone layer)")
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def mlp_layer_types(self) -> tuple[str, ...]:
        return tuple("hash_moe" if i < self.num_hash_layers else "moe" for i in range(self.num_hidden_layers))

    def is_hash_layer(self, i: int) -> bool:
        return i < self.num_hash_layers

    def layer_type(self, i: int) -> str:
        return self.layer_types[i]

    def compress_ratio(self, i: int) -> int:
        return self.compress_ratios[i]

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        errs: list[str] = []
        n = self.num_hidden_layers
        if len(self.layer_types) != n:
            errs.append(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {n}")
        if len(self.compress_ratios) != n:
            errs.append(f"compress_ratios has {len(self.compress_ratios)} entries, num_hidden_layers is {n}")
        for i, (t, r) in enumerate(zip(self.layer_types, self.compress_ratios)):
            if t not in LAYER_TYPES:
                errs.append(f"layer {i}: unknown layer type {t!r} (expected one of {LAYER_TYPES})")
            elif t == SLIDING and r not in (0, 1):
                errs.append(f"layer {i}: sliding layer must have compress ratio 0, got {r}")
            elif t in (CSA, HCA) and (not isinstance(r, int) or r < 2):
                errs.append(f"layer {i}: {t} layer needs an integer compress ratio >= 2, got {r!r}")
        if self.num_attention_heads <= 0 or self.head_dim <= 0:
            errs.append("num_attention_heads and head_dim must be positive")
        if self.o_groups <= 0 or self.num_attention_heads % self.o_groups:
            errs.append(f"num_attention_heads ({self.num_attention_heads}) must be divisible by o_groups ({self.o_groups})")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.head_dim:
            errs.append(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and in (0, head_dim={self.head_dim}]")
        if self.index_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim and CSA in self.layer_types:
            errs.append(f"index_head_dim ({self.index_head_dim}) must be even and >= qk_rope_head_dim ({self.qk_rope_head_dim})")
        if self.sliding_window < 1:
            errs.append(f"sliding_window must be >= 1, got {self.sliding_window}")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            errs.append(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, n_routed_experts={self.n_routed_experts}]")
        if self.n_shared_experts not in (0, 1):
            errs.append(f"n_shared_experts must be 0 or 1, got {self.n_shared_experts}")
        if self.scoring_func != "sqrtsoftplus":
            errs.append(f"scoring_func {self.scoring_func!r} is not supported (DeepSeek-V4 uses 'sqrtsoftplus')")
        if not 0 <= self.num_hash_layers <= n:
            errs.append(f"num_hash_layers ({self.num_hash_layers}) must be in [0, {n}]")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            errs.append("hc_mult and hc_sinkhorn_iters must be >= 1")
        if CSA in self.layer_types and self.index_topk < 1:
            errs.append("index_topk must be >= 1")
        for name in ("vocab_size", "hidden_size", "q_lora_rank", "o_lora_rank", "moe_intermediate_size"):
            if getattr(self, name) <= 0:
                errs.append(f"{name} must be positive")
        if errs:
            raise ConfigError("invalid DeepseekV4Config:\n  - " + "\n  - ".join(errs))

    # ------------------------------------------------------------------ io
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeepseekV4Config":
        """Builds a config from either config.json dialect (DeepSeek's or transformers')."""
        d = dict(d)
        n = int(d["num_hidden_layers"])
        kw: dict[str, Any] = {}
        simple = [f.name for f in dataclasses.fields(cls)
                  if f.name not in ("layer_types", "compress_ratios", "rope_scaling", "num_hash_layers",
                                    "qk_rope_head_dim", "eos_token_id")]
        for k in simple:
            if k in d and d[k] is not None:
                kw[k] = d[k]
        eos = d.get("eos_token_id", 1)
        kw["eos_token_id"] = eos[0] if isinstance(eos, (list, tuple)) else eos
        head_dim = int(d.get("head_dim", 512))
        # --- RoPE dims
        if "qk_rope_head_dim" in d:
            kw["qk_rope_head_dim"] = int(d["qk_rope_head_dim"])
        elif d.get("partial_rotary_factor") is not None:
            kw["qk_rope_head_dim"] = int(round(head_dim * float(d["partial_rotary_factor"])))
        # --- layer schedule
        if d.get("layer_types") is not None:
            rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
            rates.update(d.get("compress_rates") or {})
            if "compress_rate_csa" in d:
                rates["compressed_sparse_attention"] = d["compress_rate_csa"]
            if "compress_rate_hca" in d:
                rates["heavily_compressed_attention"] = d["compress_rate_hca"]
            types, ratios = [], []
            for i, t in enumerate(list(d["layer_types"])[:n]):
                if t not in _HF_LAYER_TYPE:
                    raise ConfigError(f"layer {i}: unknown layer type {t!r} (expected one of {tuple(_HF_LAYER_TYPE)})")
                types.append(_HF_LAYER_TYPE[t])
                ratios.append(0 if t == "sliding_attention" else int(rates[t]))
        elif d.get("compress_ratios") is not None:
            types, ratios = [], []
            for i, r in enumerate(list(d["compress_ratios"])[:n]):
                if not isinstance(r, int) or r < 0:
                    raise ConfigError(f"layer {i}: unknown compress ratio {r!r} (expected 0, 4 or an integer >= 2)")
                types.append(SLIDING if r in (0, 1) else CSA if r == 4 else HCA)
                ratios.append(0 if r in (0, 1) else r)
        else:
            raise ConfigError("config.json has neither `compress_ratios` nor `layer_types`")
        kw["layer_types"], kw["compress_ratios"] = tuple(types), tuple(ratios)
        # --- hash layers
        if d.get("mlp_layer_types") is not None:
            mlt = list(d["mlp_layer_types"])[:n]
            bad = [t for t in mlt if t not in ("hash_moe", "moe")]
            if bad:
                raise ConfigError(f"unknown mlp_layer_types entries {bad}")
            nh = sum(t == "hash_moe" for t in mlt)
            if mlt != ["hash_moe"] * nh + ["moe"] * (len(mlt) - nh):
                raise ConfigError("hash_moe layers must come first in mlp_layer_types")
            kw["num_hash_layers"] = nh
        else:
            kw["num_hash_layers"] = int(d.get("num_hash_layers", 3))
        # --- RoPE / YaRN
        rp = d.get("rope_parameters")
        if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
            main, comp = rp.get("main", {}), rp["compress"]
            kw["rope_theta"] = float(main.get("rope_theta", d.get("rope_theta", 10000.0)))
            kw["compress_rope_theta"] = float(comp.get("rope_theta", d.get("compress_rope_theta", 160000.0)))
            yarn = comp if comp.get("rope_type", comp.get("type")) == "yarn" else None
        else:
            rs = d.get("rope_scaling") or (rp if isinstance(rp, dict) else None)
            yarn = rs if rs and rs.get("type", rs.get("rope_type")) == "yarn" else None
        if yarn is not None:
            if float(yarn.get("attention_factor", 1.0) or 1.0) != 1.0:
                raise ConfigError("DeepSeek-V4 applies no YaRN attention factor (mscale); got attention_factor != 1")
            kw["rope_scaling"] = YarnScaling(
                factor=float(yarn.get("factor", 16.0)),
                original_max_position_embeddings=int(yarn.get("original_max_position_embeddings", 65536)),
                beta_fast=float(yarn.get("beta_fast", 32.0)),
                beta_slow=float(yarn.get("beta_slow", 1.0)),
            )
        else:
            kw["rope_scaling"] = None
        return cls(**kw)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "DeepseekV4Config":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_deepseek_dict(self) -> dict[str, Any]:
        """DeepSeek's dialect (what the original checkpoints ship); `compress_ratios` gets the MTP entry (0)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("layer_types", "compress_ratios", "rope_scaling")}
        ratios = []
        for t, r in zip(self.layer_types, self.compress_ratios):
            if t == CSA and r != 4:
                raise ConfigError("DeepSeek's dialect cannot express a CSA layer with ratio != 4; use to_hf_dict()")
            if t == HCA and r == 4:
                raise ConfigError("DeepSeek's dialect cannot express an HCA layer with ratio 4; use to_hf_dict()")
            ratios.append(r)
        d["compress_ratios"] = ratios + [0] * self.num_nextn_predict_layers
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.rope_scaling)}
        d["model_type"] = "deepseek_v4"
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        d["num_key_value_heads"] = 1
        return d

    def to_hf_dict(self) -> dict[str, Any]:
        """transformers' dialect (`layer_types`, `compress_rates`, `mlp_layer_types`, `rope_parameters`)."""
        rates = {}
        for t, r in zip(self.layer_types, self.compress_ratios):
            if t == SLIDING:
                continue
            key = _HF_LAYER_TYPE_INV[t]
            if rates.setdefault(key, r) != r:
                raise ConfigError(f"transformers' dialect needs one ratio per layer type; {t} layers use several")
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("layer_types", "compress_ratios", "rope_scaling", "num_hash_layers", "qk_rope_head_dim")}
        d["layer_types"] = [_HF_LAYER_TYPE_INV[t] for t in self.layer_types]
        d["compress_rates"] = {"compressed_sparse_attention": rates.get("compressed_sparse_attention", 4),
                               "heavily_compressed_attention": rates.get("heavily_compressed_attention", 128)}
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        d["partial_rotary_factor"] = self.qk_rope_head_dim / self.head_dim
        main = {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": d["partial_rotary_factor"]}
        comp = {"rope_type": "default", "rope_theta": self.compress_rope_theta,
                "partial_rotary_factor": d["partial_rotary_factor"]}
        if self.rope_scaling is not None:
            comp.update(rope_type="yarn", attention_factor=1.0, **dataclasses.asdict(self.rope_scaling))
        d["rope_parameters"] = {"main": main, "compress": comp}
        d["num_key_value_heads"] = 1
        d["model_type"] = "deepseek_v4"
        return d

    def replace(self, **changes) -> "DeepseekV4Config":
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        counts = {t: self.layer_types.count(t) for t in LAYER_TYPES}
        return (f"DeepSeek-V4: {self.num_hidden_layers} layers ({counts[SLIDING]} sliding, {counts[CSA]} CSA, "
                f"{counts[HCA]} HCA), hidden {self.hidden_size}, {self.num_attention_heads} heads x {self.head_dim} "
                f"(rope {self.qk_rope_head_dim}), window {self.sliding_window}, ratios "
                f"{sorted(set(r for r in self.compress_ratios if r))}, indexer {self.index_n_heads}x"
                f"{self.index_head_dim} top-{self.index_topk}, {self.n_routed_experts} experts top-"
                f"{self.num_experts_per_tok} ({self.num_hash_layers} hash layers), hc_mult {self.hc_mult}, "
                f"vocab {self.vocab_size}")


def _schedule(ratios: Sequence[int]) -> dict[str, tuple]:
    types = tuple(SLIDING if r in (0, 1) else CSA if r == 4 else HCA for r in ratios)
    return {"layer_types": types, "compress_ratios": tuple(0 if r in (0, 1) else r for r in ratios)}


def v4_flash() -> DeepseekV4Config:
    """DeepSeek-V4-Flash dimensions (spec §2.1): 43 layers = 2 sliding, then CSA/HCA alternating."""
    return DeepseekV4Config(**_schedule([0, 0] + [4, 128] * 20 + [4]))


def v4_pro() -> DeepseekV4Config:
    """DeepSeek-V4-Pro dimensions (spec §2.1): 61 layers = 2 HCA, then CSA/HCA alternating."""
    return DeepseekV4Config(
        hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
        index_topk=1024, n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5,
        **_schedule([128, 128] + [4, 128] * 29 + [4]))


def tiny(**overrides) -> DeepseekV4Config:
    """A few-MB config with all three layer types, for tests and the embedded default model.

    head_dim 64 (48 nope + 16 rope), window 8, CSA ratio 4 (indexer 16 heads x 32, top-4), HCA ratio 8, so a
    sequence of a few dozen tokens crosses windows and compression boundaries of every kind.
    """
    base = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=1024, beta_fast=32.0, beta_slow=1.0),
        max_position_embeddings=4096, index_n_heads=16, index_head_dim=32, index_topk=4, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1, hc_mult=4, hc_sinkhorn_iters=20,
        routed_scaling_factor=1.5,
    )
    ratios = overrides.pop("ratios", [0, 4, 8])
    base.update(_schedule(ratios))
    base["num_hidden_layers"] = len(ratios)
    base.update(overrides)
    return DeepseekV4Config(**base)


PRESETS = {"v4-flash": v4_flash, "v4-pro": v4_pro, "tiny": tiny}
