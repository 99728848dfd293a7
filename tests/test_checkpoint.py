"""Checkpoint loading: both layouts (DeepSeek FP8/FP4 original, transformers save_pretrained), sharding, dtypes,
error reporting, mtp handling, orbax round trip, and end-to-end logits against the transformers oracle."""

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import dsv4_jax
from dsv4_jax.checkpoint import (CheckpointMismatchError, canonical_state_dict, load_orbax, load_pretrained,
                                 save_deepseek_checkpoint, save_orbax, tensor_format)
from dsv4_jax.checkpoint.safetensors_io import SafetensorsReader
from dsv4_jax.config import tiny

try:
    from . import oracle as O
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    import oracle as O

CFG = tiny()


@pytest.fixture(scope="module")
def hf_plain():
    """Oracle with unquantized random weights, saved by transformers' save_pretrained."""
    return O.make_hf_model(CFG, seed=0)


@pytest.fixture(scope="module")
def hf_dir(hf_plain, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    O.write_hf_layout(hf_plain, d)
    return d


@pytest.fixture(scope="module")
def ds_quant(tmp_path_factory):
    """(oracle holding dequantized values, dir) for the DeepSeek FP8/FP4 layout in one file."""
    hf = O.make_hf_model(CFG, seed=1)
    d = tmp_path_factory.mktemp("ds")
    O.write_deepseek_layout(hf, CFG, d, quantize=True)
    return hf, d


@pytest.fixture(scope="module")
def ds_plain_dir(hf_plain, tmp_path_factory):
    d = tmp_path_factory.mktemp("ds_plain")
    O.write_deepseek_layout(hf_plain, CFG, d, quantize=False)  # lossless: oracle unchanged
    return d


def _assert_state_equal(model, hf):
    got, ref = canonical_state_dict(model), O.hf_to_canonical(hf)
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    for k in ref:
        np.testing.assert_array_equal(got[k].astype(ref[k].dtype), ref[k], err_msg=k)


def _read_all(d):
    with SafetensorsReader(d) as r:
        return {k: np.array(r.read(k)) for k in r.infos}, dict(r.infos)


def _rewrite_single(src, dst, tensors):
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = f.read()
    with open(os.path.join(dst, "config.json"), "w") as f:
        f.write(cfg)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"))


# ------------------------------------------------------------------------------------------------ layouts
def test_deepseek_fp8_fp4_layout_loads_exactly(ds_quant):
    hf, d = ds_quant
    _, infos = _read_all(d)
    # the written file follows DeepSeek's dtype policy
    assert infos["layers.0.attn.wq_a.weight"].dtype == "F8_E4M3"
    assert infos["layers.0.attn.wq_a.scale"].dtype == "F8_E8M0"
    assert infos["layers.1.attn.indexer.wq_b.weight"].dtype == "F8_E4M3"
    assert infos["layers.2.ffn.shared_experts.w2.weight"].dtype == "F8_E4M3"
    e = infos["layers.1.ffn.experts.3.w1.weight"]
    assert e.dtype == "I8" and e.shape == (CFG.moe_intermediate_size, CFG.hidden_size // 2)
    assert infos["layers.1.ffn.experts.3.w1.scale"].shape == (CFG.moe_intermediate_size, CFG.hidden_size // 32)
    assert infos["embed.weight"].dtype == "BF16" and infos["layers.1.attn.compressor.wkv.weight"].dtype == "BF16"
    assert infos["layers.0.hc_attn_fn"].dtype == "F32" and infos["layers.1.ffn.gate.bias"].dtype == "F32"
    assert infos["layers.0.ffn.gate.tid2eid"].dtype == "I64"
    assert infos["layers.0.attn.kv_norm.weight"].dtype == "BF16"
    with open(os.path.join(d, "config.json")) as f:
        assert "compress_ratios" in json.load(f)
    model = dsv4_jax.load_pretrained(d, progress=False)
    _assert_state_equal(model, hf)
    assert model.mtp_tensor_names == ()


def test_hf_save_pretrained_layout_loads_exactly(hf_plain, hf_dir):
    names = set(_read_all(hf_dir)[1])
    # what transformers actually writes (its conversion mapping reversed)
    assert {"model.embed_tokens.weight", "head.weight", "model.norm.weight", "model.hc_head.hc_fn",
            "model.layers.0.attn.norm.weight", "model.layers.1.ffn.experts.7.w2.weight",
            "model.layers.1.attn.indexer.compressor.ape"} <= names
    model = load_pretrained(hf_dir, progress=False)
    _assert_state_equal(model, hf_plain)


def test_hf_in_memory_names_layout(hf_plain, tmp_path):
    O.write_hf_layout(hf_plain, tmp_path, save_original_format=False)
    names = set(_read_all(tmp_path)[1])
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "lm_head.weight" in names
    _assert_state_equal(load_pretrained(tmp_path, progress=False), hf_plain)


def test_sharded_deepseek_layout(tmp_path):
    hf = O.make_hf_model(CFG, seed=2)
    O.write_deepseek_layout(hf, CFG, tmp_path, quantize=True, max_shard_bytes=60_000)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(files) > 2 and "model.safetensors" not in files
    with open(tmp_path / "model.safetensors.index.json") as f:
        wm = json.load(f)["weight_map"]
    assert set(wm.values()) == set(files) and "layers.2.ffn.experts.0.w2.scale" in wm
    _assert_state_equal(load_pretrained(tmp_path, progress=False), hf)


def test_weight_scale_inv_name_accepted(ds_quant, tmp_path):
    hf, d = ds_quant
    tensors, _ = _read_all(d)
    renamed = {(k[: -len(".scale")] + ".weight_scale_inv" if k.endswith("wq_b.scale") else k): v
               for k, v in tensors.items()}
    _rewrite_single(d, tmp_path, renamed)
    _assert_state_equal(load_pretrained(tmp_path, progress=False), hf)


def test_bf16_load(hf_plain, ds_plain_dir):
    model = load_pretrained(ds_plain_dir, dtype=jnp.bfloat16, progress=False)
    got, ref = canonical_state_dict(model), O.hf_to_canonical(hf_plain)
    assert got["layers.0.attn.wq_a.weight"].dtype == jnp.bfloat16
    assert got["layers.1.ffn.experts.w1"].dtype == jnp.bfloat16
    assert got["layers.0.attn_norm.weight"].dtype == np.float32
    assert got["layers.0.hc_attn_fn"].dtype == np.float32
    assert got["layers.0.ffn.gate.tid2eid"].dtype == np.int32
    for k in ref:
        want = ref[k].astype(got[k].dtype) if ref[k].dtype.kind == "f" else ref[k].astype(got[k].dtype)
        np.testing.assert_array_equal(got[k], want, err_msg=k)


def test_model_holds_routed_experts_in_out(hf_plain, ds_plain_dir):
    """The model's routed-expert stacks are [E, in, out] (ragged_dot's layout, no transpose per call), each expert
    the checkpoint's [out, in] matrix turned around; checked on the parameters themselves, not through
    canonical_state_dict (which turns them back)."""
    model = load_pretrained(ds_plain_dir, progress=False)
    ref = O.hf_to_canonical(hf_plain)
    E, D, I = CFG.n_routed_experts, CFG.hidden_size, CFG.moe_intermediate_size
    for i, layer in enumerate(model.layers):
        ex = layer.ffn.experts
        for w, shape in (("w1", (E, D, I)), ("w3", (E, D, I)), ("w2", (E, I, D))):
            got = np.asarray(getattr(ex, w)[...])
            assert got.shape == shape, (i, w, got.shape)
            np.testing.assert_array_equal(got, np.swapaxes(ref[f"layers.{i}.ffn.experts.{w}"], 1, 2), err_msg=w)


def test_tensor_format_policy():
    assert tensor_format("layers.3.attn.wo_a.weight") == "fp8"
    assert tensor_format("layers.3.ffn.experts.w2") == "fp4"
    assert tensor_format("layers.3.attn.compressor.wgate.weight") == "bf16"
    assert tensor_format("layers.3.attn.indexer.compressor.ape") == "f32"
    assert tensor_format("hc_head_scale") == "f32"
    assert tensor_format("layers.3.attn.wo_a.weight", quantize=False) == "f32"


# ------------------------------------------------------------------------------------------------ errors
@pytest.fixture(scope="module")
def plain_tensors(ds_plain_dir):
    return _read_all(ds_plain_dir)[0]


def _expect_error(src, dst, tensors):
    _rewrite_single(src, dst, tensors)
    with pytest.raises(CheckpointMismatchError) as ei:
        load_pretrained(dst, progress=False)
    assert isinstance(ei.value, ValueError)
    return ei.value


def test_missing_tensor_error(ds_plain_dir, plain_tensors, tmp_path):
    t = dict(plain_tensors)
    del t["layers.1.attn.indexer.compressor.ape"], t["layers.2.ffn.experts.5.w3.weight"]
    err = _expect_error(ds_plain_dir, tmp_path, t)
    assert err.missing == ["layers.1.attn.indexer.compressor.ape", "layers.2.ffn.experts.5.w3.weight"]
    assert not err.unexpected and not err.mismatched
    assert "layers.1.attn.indexer.compressor.ape" in str(err) and "missing" in str(err)


def test_unexpected_tensor_error(ds_plain_dir, plain_tensors, tmp_path):
    t = dict(plain_tensors, **{"layers.0.attn.bogus.weight": np.zeros((2, 2), np.float32),
                               "layers.0.ffn.experts.8.w1.weight": np.zeros((32, 64), np.float32)})
    err = _expect_error(ds_plain_dir, tmp_path, t)
    assert len(err.unexpected) == 2 and not err.missing and not err.mismatched
    assert "layers.0.attn.bogus.weight" in str(err) and "layers.0.ffn.experts.8.w1.weight" in str(err)


def test_misshaped_tensor_error(ds_plain_dir, plain_tensors, tmp_path):
    t = dict(plain_tensors)
    t["layers.2.attn.wo_b.weight"] = np.zeros((64, 31), np.float32)
    err = _expect_error(ds_plain_dir, tmp_path, t)
    assert len(err.mismatched) == 1 and "layers.2.attn.wo_b.weight" in err.mismatched[0] and not err.missing


def test_all_problems_in_one_error(ds_quant, tmp_path):
    _, d = ds_quant
    t, _ = _read_all(d)
    del t["norm.weight"]
    t["extra.weight"] = np.zeros(3, np.float32)
    t["layers.0.attn.wq_a.scale"] = np.zeros((2, 2), np.uint8).view(ml_dtypes.float8_e8m0fnu)  # wrong scale shape
    t["layers.0.ffn.experts.2.w2.weight"] = np.zeros((64, 8), np.int8)  # fp4 packed, wrong K
    err = _expect_error(d, tmp_path, t)
    assert err.missing == ["norm.weight"]
    assert [u.split()[0] for u in err.unexpected] == ["extra.weight"]
    assert len(err.mismatched) == 2
    msg = str(err)
    for s in ("norm.weight", "extra.weight", "layers.0.attn.wq_a.scale", "layers.0.ffn.experts.2.w2.weight"):
        assert s in msg


def test_mtp_tensors_ignored(ds_quant, tmp_path):
    hf, d = ds_quant
    t, _ = _read_all(d)
    t["mtp.0.e_proj.weight"] = t["layers.0.attn.wkv.weight"]
    t["mtp.0.e_proj.scale"] = t["layers.0.attn.wkv.scale"]
    t["mtp.0.enorm.weight"] = t["norm.weight"]
    _rewrite_single(d, tmp_path, t)
    model = load_pretrained(tmp_path, progress=False)
    assert sorted(model.mtp_tensor_names) == ["mtp.0.e_proj.scale", "mtp.0.e_proj.weight", "mtp.0.enorm.weight"]
    _assert_state_equal(model, hf)


# ------------------------------------------------------------------------------------------------ orbax
def test_orbax_round_trip(hf_plain, ds_plain_dir, tmp_path):
    model = load_pretrained(ds_plain_dir, progress=False)
    save_orbax(model, tmp_path / "ob")
    assert os.path.exists(tmp_path / "ob" / "config.json")
    back = load_orbax(tmp_path / "ob")
    _assert_state_equal(back, hf_plain)
    half = load_orbax(tmp_path / "ob", dtype=jnp.bfloat16)
    assert canonical_state_dict(half)["embed.weight"].dtype == jnp.bfloat16


# ------------------------------------------------------------------------------------------------ end to end
def _rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("layout", ["deepseek_fp8", "hf"])
def test_logits_match_oracle(layout, ds_quant, hf_plain, hf_dir):
    hf, d = ds_quant if layout == "deepseek_fp8" else (hf_plain, hf_dir)
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 24)).astype(np.int32)
    model = load_pretrained(d, progress=False)
    got = np.asarray(model(jnp.asarray(ids)))
    ref = O.hf_logits(hf, ids)
    assert got.shape == ref.shape
    assert _rel(got, ref) < 1e-4, _rel(got, ref)


# ------------------------------------------------------------------------------------------------ FP4 experts kept
def test_fp4_expert_weights_keep_the_checkpoint_bytes(ds_quant, ds_plain_dir, hf_dir, tmp_path):
    """load_pretrained(expert_weights="fp4"): the routed experts stay the checkpoint's FP4 bytes and e8m0 scales
    (stacked as they are, [E, out, in/2] / [E, out, in/32]); its logits equal the dequantized model's (prefill and decode
    steps) and the oracle's; the DeepSeek writer and orbax round-trip it; checkpoints whose experts are not FP4
    (plain DeepSeek layout, transformers' layout) are refused naming expert_weights='dequantized'."""
    hf, d = ds_quant
    deq = load_pretrained(d, progress=False)
    fp4 = load_pretrained(d, progress=False, expert_weights="fp4")
    tensors, _ = _read_all(d)
    ex = fp4.layers[1].ffn.experts
    assert ex.w1_fp4[...].dtype == jnp.uint8 and not hasattr(ex, "w1")
    np.testing.assert_array_equal(np.asarray(ex.w1_fp4[...])[3],
                                  tensors["layers.1.ffn.experts.3.w1.weight"].view(np.uint8))
    np.testing.assert_array_equal(np.asarray(ex.w2_fp4_scale[...])[5],
                                  tensors["layers.1.ffn.experts.5.w2.scale"].view(np.uint8))
    ids = np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 20)).astype(np.int32)
    outs = []
    for m in (deq, fp4):
        cache = m.init_cache(2, 32)
        logits, cache = m.prefill(jnp.asarray(ids[:, :16]), cache)
        steps = [np.asarray(logits)]
        for t in range(16, 20):
            step, cache = m.decode(jnp.asarray(ids[:, t]), cache)
            steps.append(np.asarray(step))
        outs.append(steps)
    for a, b in zip(*outs):
        assert _rel(b, a) < 1e-5, _rel(b, a)
    assert _rel(np.asarray(fp4(jnp.asarray(ids))), O.hf_logits(hf, ids)) < 1e-4
    # written back: the same bytes in DeepSeek's layout; orbax: the same state
    save_deepseek_checkpoint(fp4, CFG, tmp_path / "w")
    again, _ = _read_all(tmp_path / "w")
    for k in ("layers.1.ffn.experts.3.w1.weight", "layers.2.ffn.experts.7.w3.scale"):
        np.testing.assert_array_equal(again[k].view(np.uint8), tensors[k].view(np.uint8), err_msg=k)
    save_orbax(fp4, tmp_path / "ob")
    back = load_orbax(tmp_path / "ob", expert_weights="fp4")
    a, b = canonical_state_dict(fp4), canonical_state_dict(back)
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    for src in (ds_plain_dir, hf_dir):
        with pytest.raises(CheckpointMismatchError, match="expert_weights='dequantized'"):
            load_pretrained(src, progress=False, expert_weights="fp4")
