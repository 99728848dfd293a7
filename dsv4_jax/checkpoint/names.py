"""Tensor-name mapping: every checkpoint layout we read -> canonical (DeepSeek original) names.

Canonical names are the flat paths of the NNX model (contract): DeepSeek's original checkpoint names, except that
routed experts are stacked (`layers.{i}.ffn.experts.w1` [E, I, D] <- `layers.{i}.ffn.experts.{e}.w1.weight`).
Canonical tensors keep the checkpoints' orientation ([.., out, in]); the model alone holds its routed-expert stacks
the other way round, [E, in, out] (`model_layout` / `canonical_layout` / `canonical_shape` convert, at load, save
and in `loader.canonical_state_dict`): that is `lax.ragged_dot`'s [group, contracting, out], which XLA's GPU grouped
matmul reads as it is, where [E, out, in] cost a transpose of the whole stack at every call (session 45, H100:
routed experts 386.7 -> 192.9 us at B = 16, `benchmarks/moe_layout.py`).

Layouts recognised, per key (they may even be mixed):

(a) DeepSeek original: no prefix, `layers.{i}.attn.wkv.weight`, `ffn.experts.{e}.w1.weight` (+ `.scale`).
(b) what transformers' `save_pretrained` writes for DeepseekV4ForCausalLM (it reverses its conversion mapping):
    original names with a `model.` prefix on the backbone, but `model.embed_tokens.weight`,
    `model.hc_head.{hc_fn,hc_base,hc_scale}`, `head.weight`, and the main attention KV norm as `attn.norm.weight`.
(c) transformers' in-memory names (`save_pretrained(..., save_original_format=False)`):
    `model.layers.{i}.self_attn.q_a_proj.weight`, `mlp.experts.gate_up_proj` [E, 2I, D] (w1 rows then w3 rows),
    `mlp.experts.down_proj` [E, D, I], `attn_hc.fn`, `input_layernorm`, `compressor.indexer.*`, `lm_head.weight` ...
"""

from __future__ import annotations

import dataclasses
import re

# Per-layer canonical suffixes and their transformers in-memory equivalents (layout c).
_LAYER_HF_TO_CANON = {
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}
# Layout (b) quirk: transformers' reverse rename `.kv_norm.` -> `.norm.` also hits the main attention's KV norm.
_LAYER_SAVED_TO_CANON = {"attn.norm.weight": "attn.kv_norm.weight"}
_TOP_TO_CANON = {
    "embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^(?:ffn|mlp)\.experts\.(\d+)\.(w[123])\.weight$")

# kinds of targets
PLAIN = "plain"              # one checkpoint tensor -> one canonical tensor
EXPERT = "expert"            # one expert slice -> slot `index` of a stacked canonical tensor
GATE_UP = "gate_up"          # transformers' merged [E, 2I, D] -> stacked w1 (rows :I) and w3 (rows I:)
STACKED = "stacked"          # an already stacked [E, ...] tensor (transformers' down_proj) -> stacked canonical


@dataclasses.dataclass(frozen=True)
class Target:
    kind: str
    name: str                # canonical name (for GATE_UP: the w1 name; w3 derived)
    index: int | None = None

    @property
    def names(self) -> tuple[str, ...]:
        if self.kind == GATE_UP:
            return (self.name, self.name[:-2] + "w3")
        return (self.name,)


def is_mtp(key: str) -> bool:
    return key.startswith("mtp.") or key.startswith("model.mtp.")


def canonicalize(key: str) -> Target | None:
    """Maps one checkpoint (weight) key of any supported layout to its canonical target; None if unknown."""
    k = key[len("model."):] if key.startswith("model.") else key
    if k in _TOP_TO_CANON:
        return Target(PLAIN, _TOP_TO_CANON[k])
    m = _LAYER_RE.match(k)
    if not m:
        return Target(PLAIN, k)
    i, rest = m.group(1), m.group(2)
    pre = f"layers.{i}."
    em = _EXPERT_RE.match(rest)
    if em:
        return Target(EXPERT, f"{pre}ffn.experts.{em.group(2)}", int(em.group(1)))
    if rest == "mlp.experts.gate_up_proj":
        return Target(GATE_UP, f"{pre}ffn.experts.w1")
    if rest == "mlp.experts.down_proj":
        return Target(STACKED, f"{pre}ffn.experts.w2")
    rest = _LAYER_HF_TO_CANON.get(rest, _LAYER_SAVED_TO_CANON.get(rest, rest))
    return Target(PLAIN, pre + rest)


def expert_key(stacked_name: str, e: int) -> str:
    """`layers.3.ffn.experts.w1`, 5 -> `layers.3.ffn.experts.5.w1.weight` (DeepSeek's per-expert name); the FP4
    stacks `...w1_fp4` / `...w1_fp4_scale` -> `...5.w1.weight` / `...5.w1.scale`."""
    head, w = stacked_name.rsplit(".", 1)
    suffix = "scale" if w.endswith("_fp4_scale") else "weight"
    return f"{head}.{e}.{w[:2]}.{suffix}"


# The model's routed-expert stacks: w1 / w3 / w2 [E, in, out] in the model dtype (the canonical [E, out, in] swapped),
# or with expert_weights "fp4" (`layers.moe.EXPERT_WEIGHTS`) the checkpoint's FP4 bytes w{1,3,2}_fp4 [E, out, in/2]
# and their e8m0 scales w{1,3,2}_fp4_scale [E, out, in/32]: the canonical orientation, no swap.
_STACKED_RE = re.compile(r"layers\.\d+\.ffn\.experts\.w[123](_fp4(_scale)?)?")


def is_stacked_expert(name: str) -> bool:
    return _STACKED_RE.fullmatch(name) is not None


def _swapped(name: str) -> bool:
    """Whether the model holds `name` with its last two axes swapped from the canonical tensor's."""
    return is_stacked_expert(name) and not name.endswith(("_fp4", "_fp4_scale"))


def fp4_stacks(name: str) -> tuple[str, str]:
    """A routed-expert stack's canonical name (`layers.3.ffn.experts.w1`) -> the names of its FP4 bytes and scales
    in a model with expert_weights "fp4"."""
    return name + "_fp4", name + "_fp4_scale"


def canonical_shape(name: str, model_shape) -> tuple:
    """The shape the canonical (checkpoint-oriented) tensor `name` has, from the model parameter's shape."""
    shape = tuple(model_shape)
    return shape[:-2] + shape[:-3:-1] if _swapped(name) else shape


def canonical_layout(name: str, x):
    """A model parameter's value -> the canonical tensor (routed-expert stacks [E, in, out] -> [E, out, in]; the FP4
    stacks are canonical already)."""
    return x.swapaxes(-1, -2) if _swapped(name) else x


def model_layout(name: str, x):
    """A canonical tensor (or one expert's slice of it) -> the model's orientation: the inverse of
    `canonical_layout`, which is its own inverse (a swap of the last two axes)."""
    return canonical_layout(name, x)


SCALE_SUFFIXES = (".scale", ".weight_scale_inv")


def scale_owner(key: str, keys) -> str | None:
    """If `key` is the quantization scale of a `X.weight` present in `keys`, return that weight key."""
    for suf in SCALE_SUFFIXES:
        if key.endswith(suf):
            w = key[: -len(suf)] + ".weight"
            if w in keys:
                return w
    return None
