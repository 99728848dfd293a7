"""DeepseekV4Config: both config.json dialects, presets, validation messages, logical axis names."""

import json

import pytest
from flax import nnx

from dsv4_jax.config import ConfigError, DeepseekV4Config, tiny, v4_flash, v4_pro
from dsv4_jax.model import DeepseekV4ForCausalLM

FLASH_DEEPSEEK_JSON = {  # the keys of DeepSeek-V4-Flash's root config.json (spec §2.1)
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "norm_topk_prob": True, "topk_method": "noaux_tc",
    "num_hash_layers": 3, "swiglu_limit": 10.0, "num_nextn_predict_layers": 1, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "quantization_config": {"quant_method": "fp8"}, "expert_dtype": "fp4",
}


def test_deepseek_dialect_gives_the_flash_preset():
    cfg = DeepseekV4Config.from_dict(FLASH_DEEPSEEK_JSON)
    assert cfg == v4_flash()
    assert cfg.layer_types[:4] == ("sliding", "sliding", "csa", "hca") and cfg.compress_ratios[2:4] == (4, 128)
    assert cfg.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)


@pytest.mark.parametrize("make", [v4_flash, v4_pro, tiny, lambda: tiny(ratios=[8, 4, 0], rope_scaling=None)])
def test_both_dialects_round_trip(make, tmp_path):
    cfg = make()
    assert DeepseekV4Config.from_dict(cfg.to_hf_dict()) == cfg
    if 4 not in [r for t, r in zip(cfg.layer_types, cfg.compress_ratios) if t == "hca"]:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(cfg.to_deepseek_dict()))
        assert DeepseekV4Config.from_json_file(path) == cfg


def test_transformers_config_object_dialect():
    import transformers
    hf = transformers.DeepseekV4Config(**tiny().to_hf_dict())
    assert DeepseekV4Config.from_dict(hf.to_dict()) == tiny()


@pytest.mark.parametrize("change, message", [
    (dict(compress_ratios=[0, -4, 8]), "unknown compress ratio"),
    (dict(layer_types=["sliding", "dense", "hca"]), "unknown layer type"),
    (dict(num_attention_heads=6, o_groups=4), "divisible by o_groups"),
    (dict(qk_rope_head_dim=96, head_dim=64), "qk_rope_head_dim"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(mlp_layer_types=["moe", "hash_moe", "moe"]), "hash_moe layers must come first"),
])
def test_validation_errors_are_clear(change, message):
    d = tiny().to_hf_dict()
    if "compress_ratios" in change:
        d.pop("layer_types")
    d.update(change)
    with pytest.raises(ConfigError, match=message):
        DeepseekV4Config.from_dict(d)


def test_missing_schedule_is_an_error():
    d = tiny().to_hf_dict()
    d.pop("layer_types")
    with pytest.raises(ConfigError, match="neither"):
        DeepseekV4Config.from_dict(d)


def test_parameters_carry_logical_axis_names():
    model = nnx.eval_shape(lambda: DeepseekV4ForCausalLM(tiny(), rngs=nnx.Rngs(0)))
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    assert tuple(specs["embed"]["weight"].value) == ("vocab", "embed")
    assert tuple(specs["layers"][0]["attn"]["wq_b"]["weight"].value) == ("heads", None)
    assert tuple(specs["layers"][1]["ffn"]["experts"]["w1"].value) == ("experts", "embed", "mlp")
