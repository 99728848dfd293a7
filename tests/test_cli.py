"""`dsv4-jax` CLI: info (presets, embedded default, checkpoint dir) and generate (embedded default checkpoint)."""

import os
import re
import subprocess
import sys

import pytest

from dsv4_jax import cli
from tiers import full_tier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out = capsys.readouterr().out
    assert rc == 0
    return out


def test_info_flash_reports_spec_numbers(capsys):
    out = run(capsys, "info", "--preset", "v4-flash")
    assert "43 layers (2 sliding, 21 CSA, 20 HCA)" in out
    assert "context 1,048,576 tokens" in out
    assert "kv fp8  indexer fp8 : 3,850.2500 B/token" in out
    assert "kv fp8  indexer fp4 : 3,514.2500 B/token" in out
    assert re.search(r"dense MLA\s+43\s+43\.00 GiB\s+44,032\.00\s+24\.52 GiB\s+25,112\.00", out)
    for t in ("sliding", "csa", "hca", "total"):
        assert re.search(rf"^\s+{t}\s+\d+", out, re.M), t


def test_info_pro_and_context(capsys):
    out = run(capsys, "info", "--preset", "v4-pro", "--context", "65536")
    assert "61 layers (0 sliding, 30 CSA, 31 HCA)" in out
    assert "5,511.4375 B/token" in out and "5,031.4375 B/token" in out
    assert "context 65,536 tokens" in out


def test_info_embedded_default_and_checkpoint_dir(capsys):
    from dsv4_jax.assets import embedded_checkpoint_path

    out = run(capsys, "info")
    assert "embedded default" in out
    assert "1 sliding, 1 CSA, 1 HCA" in out
    out2 = run(capsys, "info", "--checkpoint", embedded_checkpoint_path(), "--context", "4096")
    assert "layer schedule (S=sliding, C=CSA, H=HCA): S C H" in out2


def test_info_errors(capsys):
    with pytest.raises(SystemExit):
        cli.main(["info", "--preset", "tiny", "--checkpoint", ROOT])
    with pytest.raises(SystemExit):
        cli.main(["info", "--checkpoint", "/nonexistent/dir"])
    with pytest.raises(SystemExit):
        cli.main(["info", "--preset", "nope"])


def test_generate_embedded_default(capsys):
    import jax.numpy as jnp

    from dsv4_jax.assets import embedded_checkpoint_path
    from dsv4_jax.checkpoint import load_pretrained
    from dsv4_jax.engine import generate

    out = run(capsys, "generate", "--prompt", "1 2 3 4 5", "--prompt", "9,8", "--max-new-tokens", "12")
    lines = re.findall(r"^\[(\d)\] new tokens \((\d+)\): (.*)$", out, re.M)
    assert [(i, n) for i, n, _ in lines] == [("0", "12"), ("1", "12")]
    got = [[int(t) for t in toks.split()] for _, _, toks in lines]
    model = load_pretrained(embedded_checkpoint_path(), dtype=jnp.float32, progress=False)
    assert generate(model, [[1, 2, 3, 4, 5], [9, 8]], 12) == got
    assert re.search(r"decode: 11 steps x batch 2 in [\d.]+ ms = [\d.]+ ms/step, [\d,.]+ tokens/s", out)
    assert "compile:" in out and "excluded" in out
    assert re.search(r"cache: allocated [\d.]+ KiB", out)


@full_tier
def test_generate_cache_formats(capsys):
    out = run(capsys, "generate", "--prompt", "3 1 4 1 5", "--max-new-tokens", "6", "--indexer-dtype", "fp4",
              "--indexer-rotate", "--warmup", "0", "--temperature", "0.7", "--top-k", "20", "--seed", "5",
              "--indexer-picks", "set")
    assert re.search(r"^\[0\] new tokens \(6\): (\d+ ){5}\d+$", out, re.M)
    assert "indexer fp4, Hadamard" in out


def test_generate_errors(capsys):
    with pytest.raises(SystemExit):  # argparse: not token ids
        cli.main(["generate", "--prompt", "hello world"])
    with pytest.raises(SystemExit, match="outside"):
        cli.main(["generate", "--prompt", "1 999", "--max-new-tokens", "2"])
    with pytest.raises(SystemExit, match="temperature"):
        cli.main(["generate", "--prompt", "1", "--temperature", "-1"])


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "dsv4_jax.cli", "info", "--preset", "tiny", "--context", "128"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "dense MLA" in r.stdout
    pyproject = os.path.join(ROOT, "pyproject.toml")
    if os.path.exists(pyproject):
        with open(pyproject) as f:
            assert 'dsv4-jax = "dsv4_jax.cli:main"' in f.read()


@full_tier
def test_decode_breakdown_script_runs(tmp_path):
    """benchmarks/decode_breakdown.py (the GPU's per-component decode profile) runs end to end on a tiny model, so
    it does not rot between GPU sessions: every component row and the sum are written (the routed experts on the
    grouped-matmul kernel, interpreted, `--experts-gmm pallas`)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "breakdown.txt"
    subprocess.run([sys.executable, "benchmarks/decode_breakdown.py", "--preset", "tiny", "--layers", "3",
                    "--batch", "2", "--context", "64", "--steps", "2", "--repeats", "1", "--parts",
                    "--indexer-dtype", "fp8", "--experts-gmm", "pallas", "--out", str(out)],
                   cwd=root, env={**os.environ, "PYTHONPATH": root}, check=True, capture_output=True)
    text = out.read_text()
    for row in ("full decode step", "L1 csa     attention", "L1 csa       indexer select", "L2 hca       compressor",
                "L2 hca       sparse attention op", "LM head", "sum (mHC counted twice)"):
        assert row in text, text


@full_tier
def test_indexer_benchmark_lower_only(tmp_path):
    """benchmarks/indexer.py --lower-only (the GPU command's dry run on the CPU): every variant of the case lowers
    for CUDA -- the in-kernel selection with its session-41 options, the one-kernel q preparation, the model's q
    paths -- and a variant that cannot lower makes it exit 1."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    cmd = [sys.executable, "benchmarks/indexer.py", "--lower-only", "--skip-topk-only", "--variants",
           "pallas_auto_set,model_q_raw", "--cases", "64x1x131072xfp4", "--out", str(tmp_path), "--set-configs",
           "topk=segment_set,sel.prune=2048,sel.final=last,mosaic.q_prep=triton"]
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("lowers ") == 4, run.stdout
    run = subprocess.run(cmd[:-1] + ["topk=segment_set,sel.prune=100"], cwd=root, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 1 and "FAILS" in run.stdout and "prune" in run.stdout, run.stdout + run.stderr


@full_tier
def test_moe_layout_benchmark_runs(tmp_path):
    """benchmarks/moe_layout.py (the routed experts by weight layout) on tiny shapes on the CPU: both layouts and
    the grouped-matmul kernel (interpreted) run, are timed and agree with the dense per-expert reference, and so do
    the FP4-weight variants (the kernel reading the bytes, the reference dequantizing them); an unknown variant is
    refused."""
    import json

    import numpy as np

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    out = tmp_path / "moe.json"
    cmd = [sys.executable, "benchmarks/moe_layout.py", "--experts", "4", "--top-k", "2", "--hidden", "64",
           "--intermediate", "32", "--batches", "3,5", "--steps", "2", "--out", str(out), "--gmm-configs",
           "block_n=32,block_k=32", "--fp4-configs", "block_k=32"]
    subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [r["B"] for r in rows] == [3, 5]
    for r in rows:
        for v in ("out_in", "in_out", "in_out_pallas", "in_out_pallas[block_n=32,block_k=32]", "fp4", "fp4_pallas",
                  "fp4_pallas[block_k=32]"):
            # net-of-dispatch differences of microsecond CPU calls can come out negative: only presence is checked
            assert np.isfinite(r[f"{v}_us"]) and r[f"{v}_rel_err"] < 1e-3, r
    run = subprocess.run(cmd + ["--variants", "in_out,dense"], cwd=root, env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "unknown variants" in run.stderr, run.stderr


@full_tier
def test_topk_and_indexer_benchmark_scripts_run(tmp_path):
    """benchmarks/topk_stages.py (Triton kernels in the interpreter on CPU, with --fused-configs and
    --select-configs) and benchmarks/indexer.py --tiny (with --fused-config and --set-configs) run end to end, so the option sets a
    GPU session passes them do not rot: every requested row is timed (no NaN) and written."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    subprocess.run([sys.executable, "benchmarks/topk_stages.py", "--cases", "4x1500", "--stages",
                    "fused_set,hist_set,full_set,hist_prefix,tour_set,tour_fused", "--fused-configs", "num_warps=16,early_exit=1",
                    "--select-configs", "select_matrix=1", "--hist-configs", "chunk=512", "--tour-configs",
                    "seg_len=512,seg_slack=0,final_max=512", "--out", str(tmp_path)], cwd=root, env=env, check=True,
                   capture_output=True)
    rows = json.loads((tmp_path / "topk_stages.json").read_text())
    timed = {k: v for r in rows for k, v in r.items() if k.startswith(("fused_set", "full_set", "select", "hist",
                                                                       "tour"))}
    assert {"fused_set", "fused_set[num_warps=16,early_exit=1]", "full_set[select_matrix=1]", "hist_set",
            "hist_set[chunk=512]", "hist_prefix[chunk=512]", "tour_set", "tour_fused",
            "tour_set[seg_len=512,seg_slack=0,final_max=512]"} <= set(timed), timed
    assert "tour_prefix[seg_len=512,seg_slack=0,final_max=512]" not in timed   # --stages restricts the sweeps too
    assert all(v == v for v in timed.values()), rows                      # no stage failed (NaN)
    subprocess.run([sys.executable, "benchmarks/indexer.py", "--tiny", "--skip-topk-only", "--variants",
                    "pallas_threshold_set,pallas_fused_set", "--fused-config", "num_warps=4",
                    "--set-configs", "topk=threshold_regions_set;topk=hist_set,hist.chunk=1024;"
                    "topk=tour_set,tour.seg_len=1024,tour.final_max=1024;topk=tour_set,tour.fuse_final=1", "--out",
                    str(tmp_path)],
                   cwd=root, env=env, check=True, capture_output=True)
    row = json.loads((tmp_path / "indexer_bench.json").read_text())["rows"][0]
    assert row["pallas_fused_set_us"] == row["pallas_fused_set_us"], row
    assert row["set[topk=threshold_regions_set]_us"] == row["set[topk=threshold_regions_set]_us"], row
    assert row["set[topk=hist_set,hist.chunk=1024]_us"] == row["set[topk=hist_set,hist.chunk=1024]_us"], row
    tour = row["set[topk=tour_set,tour.seg_len=1024,tour.final_max=1024]_us"]
    assert tour == tour, row
    assert row["set[topk=tour_set,tour.fuse_final=1]_us"] == row["set[topk=tour_set,tour.fuse_final=1]_us"], row
    # net timing (the default): the harness is timed, and every variant also less it
    assert row["timing"] == "net" and row["harness_us"] == row["harness_us"], row
    assert row["pallas_fused_set_own_us"] == row["pallas_fused_set_us"] - row["harness_us"], row


def test_indexer_benchmark_config_scope():
    """benchmarks/indexer.py's option sets: a 'gpu.NAME=value' item sets pallas_kernels.indexer.gpu's constant while
    the variant traces (a bool from '0' / '1', not bool('0')) and restores it after, even when the call raises; an
    unknown constant is refused."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.indexer import config_scope

    from pallas_kernels.indexer import gpu

    before = (gpu.AUTO_SEGMENT, gpu.AUTO_SEGMENT_ROWS)
    opts, scoped = config_scope({"gpu.AUTO_SEGMENT": 0, "gpu.AUTO_SEGMENT_ROWS": 300, "topk": "auto_set"}, "cfg")
    assert opts == {"topk": "auto_set"}
    assert scoped(lambda: (gpu.AUTO_SEGMENT, gpu.AUTO_SEGMENT_ROWS))() == (False, 300)
    assert (gpu.AUTO_SEGMENT, gpu.AUTO_SEGMENT_ROWS) == before

    def fails():
        raise RuntimeError("traced")

    with pytest.raises(RuntimeError):
        scoped(fails)()
    assert (gpu.AUTO_SEGMENT, gpu.AUTO_SEGMENT_ROWS) == before
    with pytest.raises(ValueError, match="no constant 'NOPE'"):
        config_scope({"gpu.NOPE": 1}, "gpu.NOPE=1")


def test_fp8_conversion_bank_model():
    """benchmarks/fp8_conversion_banks.py, the shared-memory model behind fp8_chunk_order: the diagonal order is a
    bijection onto every conversion path's chunk grid and serves each bf16 store phase in one wavefront, where
    row-major conflicts (3.7-way in the tile ring's 64 B swizzle, 2-way in the consumers' 128 B)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.fp8_conversion_banks import table

    got = {(name, order): (load, store) for name, order, load, store in table()}
    assert got[("tile ring (producer / converter), bk 32", "rows")][1] > 3.5
    assert got[("consumer 0's half (split_d), bk 64", "rows")][1] == 2.0
    for (name, order), (load, store) in got.items():
        if order == "diagonal":
            assert store == 1.0 and load <= 1.6, (name, load, store)


def test_sparse_attention_benchmark_knows_its_groups():
    """benchmarks/sparse_attention.py's GROUPS (what --groups accepts; anything else is refused, so a typo does not
    run nothing on a device call) lists exactly the groups main() runs."""
    import ast
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "benchmarks", "sparse_attention.py")).read()
    used = set(re.findall(r'"([a-z0-9_]+)" in groups', text))
    listed = ast.literal_eval(re.search(r"^GROUPS = (\(.*?\))\n", text, re.M | re.S).group(1))
    assert used == set(listed) and len(listed) == len(set(listed))


def test_decode_step_floor_bytes():
    """benchmarks/decode.py's read floor (`step_floor_bytes`) on the tiny config, by hand: every parameter but the
    routed experts and the embedding / hash-table rows once, E (1 - (1 - k / E)^B) experts per MoE layer, and the
    cache rows one step reads (window, CSA top-k, HCA entries, CSA indexer keys); `--floor-only` prints it without
    building weights."""
    import math

    import jax
    import jax.numpy as jnp
    from flax import nnx

    sys.path.insert(0, ROOT)
    from benchmarks.decode import step_floor_bytes
    from dsv4_jax.config import PRESETS
    from dsv4_jax.model import DeepseekV4ForCausalLM

    cfg = PRESETS["tiny"]()
    _, state = nnx.split(nnx.eval_shape(lambda: DeepseekV4ForCausalLM(cfg, rngs=nnx.Rngs(0))))
    B, L = 3, 200
    got = step_floor_bytes(state, cfg, B, L, kv_dtype="fp8", indexer_dtype="fp4")
    E, k, D, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    active = E * (1 - (1 - k / E) ** B)
    assert math.isclose(got["experts"], cfg.num_hidden_layers * active * 3 * D * I * 4)
    total = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(state))
    experts_all = cfg.num_hidden_layers * E * 3 * D * I * 4
    embed_rows = cfg.vocab_size * D * 4 * (1 - B / cfg.vocab_size)
    hash_rows = cfg.num_hash_layers * cfg.vocab_size * k * 4 * (1 - B / cfg.vocab_size)
    assert math.isclose(got["params"], total - experts_all - embed_rows - hash_rows)
    W = cfg.sliding_window
    kv_row = (cfg.head_dim - cfg.qk_rope_head_dim) + 2 * cfg.qk_rope_head_dim + 8   # 584-B layout, scaled down
    idx_row = cfg.index_head_dim // 2 + cfg.index_head_dim // 32
    r_csa, r_hca = cfg.compress_ratios[1], cfg.compress_ratios[2]
    rows = 3 * W + min(cfg.index_topk, L // r_csa) + L // r_hca
    assert got["cache"] == B * (rows * kv_row + (L // r_csa) * idx_row)
    r = subprocess.run([sys.executable, "benchmarks/decode.py", "--preset", "tiny", "--batch", str(B), "--contexts",
                        str(L), "--kv-dtype", "fp8", "--indexer-dtype", "fp4", "--floor-only", "--copy-gbps", "1"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, check=True, capture_output=True, text=True)
    assert f"{got['total'] / 1e3:.1f}" in r.stdout.splitlines()[-1], r.stdout


def test_indexer_fp4_resources_script_needs_its_dump_variables():
    """benchmarks/indexer_fp4_resources.py (GPU only: ptxas resources of the fp4 indexer kernel) imports and parses
    its arguments on the CPU, and without Mosaic GPU's dump variables it says which to set instead of compiling."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOSAIC_GPU_DUMP")}
    env["PYTHONPATH"] = "."
    r = subprocess.run([sys.executable, "benchmarks/indexer_fp4_resources.py"], capture_output=True, text=True,
                       env=env, cwd=ROOT)
    assert r.returncode != 0 and "MOSAIC_GPU_DUMP_PTXAS=1" in r.stderr, r.stderr[-2000:]


def test_generate_checkpoint_dir_shows_loading_progress(tmp_path, capsys):
    """A checkpoint given by --checkpoint loads with tqdm's progress bar on stderr (real checkpoints take minutes);
    the embedded default loads silently."""
    import shutil

    from dsv4_jax.assets import embedded_checkpoint_path

    ckpt = shutil.copytree(embedded_checkpoint_path(), tmp_path / "ckpt")
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", "1 2", "--max-new-tokens", "1",
                     "--warmup", "0"]) == 0
    captured = capsys.readouterr()
    assert "loading checkpoint" in captured.err and f"checkpoint: {ckpt}" in captured.out
    assert cli.main(["generate", "--prompt", "1 2", "--max-new-tokens", "1", "--warmup", "0"]) == 0
    assert "loading checkpoint" not in capsys.readouterr().err
