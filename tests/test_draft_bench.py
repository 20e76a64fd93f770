"""The training-step benchmark runs (tiny shapes on CPU), writes its JSON report, imports nothing heavy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_train_step.py"


def test_bench_train_step_tiny_smoke(tmp_path):
    out = tmp_path / "train_step.json"
    argv = ["bench", "--tiny", "--steps", "1", "--warmup", "1", "--lengths", "48", "--precision", "amp", "bf16",
            "--out", str(out)]
    # run it as __main__, then check it needed nothing beyond torch / transformers / dspark_core.draft
    script = (f"import runpy, sys\nsys.argv = {argv!r}\nrunpy.run_path({str(BENCH)!r}, run_name='__main__')\n"
              "bad = [m for m in ('zarr', 'dvclive', 'matplotlib', 'dspark_core.cache') if m in sys.modules]\n"
              "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["precision"] for r in report["results"]] == ["amp", "bf16"]
    for row in report["results"]:
        assert row["L"] == 48 and row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["valid_slots"] > 0
        # on the CPU, queueing a step onto the idle device is computing it: the same time as a timed step, to noise
        assert 0.2 * row["step_s"] < row["host_s"] < 5 * row["step_s"]
        assert row["launch"] == "eager"
        assert row["loss"] == row["loss"]  # finite, not NaN
    assert "step_s" in proc.stdout and "host_s" in proc.stdout and "tokens/s" in proc.stdout


def test_bench_train_step_two_processes(tmp_path):
    """``torchrun --nproc_per_node 2`` (gloo on CPU): DDP steps, one report from rank 0 with world_size 2,
    tokens/s over both ranks, and scaling_efficiency against a one-process baseline of the same settings."""
    common = ["--tiny", "--steps", "2", "--warmup", "1", "--lengths", "48", "--precision", "amp", "--no-compile-layers"]
    one = tmp_path / "one.json"
    proc = subprocess.run([sys.executable, str(BENCH), *common, "--out", str(one)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    two = tmp_path / "two.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(BENCH), *common, "--out", str(two), "--baseline", str(one)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(two.read_text())
    row = report["results"][0]
    assert report["world_size"] == row["world_size"] == 2
    base = json.loads(one.read_text())["results"][0]
    assert row["tokens_per_s"] == 2 * 48 / row["step_s"]
    assert row["scaling_efficiency"] == base["step_s"] / row["step_s"] > 0
    bad = subprocess.run([sys.executable, str(BENCH), *common, "--out", str(tmp_path / "x.json"), "--baseline",
                          str(two)], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "not a one-process run" in bad.stderr


def test_bench_train_step_mixed_lengths_padded_and_packed(tmp_path):
    """``--mixed 4``: four samples a step (40, 32, 12, 39 tokens), one a row or (``--packed``) packed into rows of
    L = 64 (three rows); the same loss. ``--anchor-slots compact``: packed rows narrower than ``fixed`` (16 anchors
    a sample, 10 of them valid in the 12-token sample: rows of 26 slots, not 32), the same slots and loss."""
    rows = {}
    for extra in (["--anchor-slots", "fixed"], ["--packed", "--anchor-slots", "fixed"], ["--packed"]):
        out = tmp_path / f"mix{len(extra)}.json"  # a process each: a pass's loss follows the steps before it
        proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--steps", "1", "--warmup", "1", "--lengths", "64",
                               "--precision", "amp", "--mixed", "4", *extra, "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        for row in json.loads(out.read_text())["results"]:
            rows[row["packed"], row["anchor_slots"]] = row
    padded, packed, compact = rows[False, "fixed"], rows[True, "fixed"], rows[True, "compact"]
    assert padded["rows"] == 4 and packed["rows"] == compact["rows"] == 3
    assert padded["anchor_width"] == 16 and packed["anchor_width"] == 32 > compact["anchor_width"]
    assert compact["valid_slots"] == packed["valid_slots"] == padded["valid_slots"] > 0
    for row in (packed, compact):
        assert abs(row["loss"] - padded["loss"]) <= 1e-4 * abs(padded["loss"])


def test_bench_train_step_teacher_vocab_and_profile_file(tmp_path):
    """``--teacher-vocab draft`` is recorded in the rows and costs fewer teacher FLOPs at a reduced vocabulary;
    ``--profile`` writes its tables beside the JSON, the chunked loss named in them."""
    out = tmp_path / "td.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--steps", "1", "--warmup", "1", "--lengths", "48",
                           "--precision", "bf16", "--vocab-size", "100", "--teacher-vocab", "draft", "--profile",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(out.read_text())["results"][0]
    assert row["teacher_vocab"] == "draft" and row["draft_vocab_size"] == 100
    bench = _bench_module()
    tc = bench.target_config(True)
    draft = SimpleNamespace(cfg=SimpleNamespace(vocab_size=100, block_size=7, num_draft_layers=5, markov_head="none",
                                                markov_rank=16),
                            hidden_size=64, aux_layer_ids=(1, 9, 17, 25, 33), layers=[_tiny_layer()])
    full, td = (bench.step_tflop(tc, draft, 48, 16, t) for t in ("full", "draft"))
    assert full - td == pytest.approx(2 * (tc.vocab_size - 100) * 64 * 16 * 7 / 1e12)  # the teacher GEMM's rows
    assert row["model_tflop"] > 0
    text = (tmp_path / "td.profile_bf16.txt").read_text()
    assert "teacher draft" in text and "dspark.chunked_distill" in text and "profiled step wall" in text


def test_bench_train_step_online_rows(tmp_path):
    """``--hidden-states cache online``: a cache row and an online row at each length, side by side (the script's
    loop; then the trainer's, whose prepare_step runs the target); the online rows time the target's forward alone
    and give its share of the step and its matrix work (a 36-layer forward of L tokens, by hand)."""
    rows = []
    for extra in ([], ["--trainer", "--trainer-workers", "0"]):
        out = tmp_path / f"online{len(extra)}.json"
        proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--steps", "1", "--warmup", "1", "--lengths", "40",
                               "--precision", "amp", "--no-compile-layers", "--hidden-states", "cache", "online",
                               *extra, "--out", str(out)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert " online " in proc.stdout and " cache " in proc.stdout
        rows += json.loads(out.read_text())["results"]
    assert [(r.get("loop", "script"), r["hidden_states"]) for r in rows] == [
        ("script", "cache"), ("script", "online"), ("trainer", "cache"), ("trainer", "online")]
    tc = _bench_module().target_config(True)
    layer = 2 * 64 * 4 * 16 + 2 * 64 * 2 * 16 + 3 * 64 * 128  # q, o, k, v, gate / up / down of the tiny target
    for row in rows:
        assert row["step_s"] > 0 and row["loss"] == row["loss"] and row["L"] == 40
        if row["hidden_states"] == "online":
            assert row["target_tflop"] == pytest.approx(36 * (2 * 40 * layer + 2 * 40 * 40 * 4 * 16) / 1e12)
            assert tc.num_hidden_layers == 36
    script = rows[1]
    assert 0 < script["target_forward_s"] and script["target_share"] == script["target_forward_s"] / script["step_s"]
    assert "target_forward_s" not in rows[0]


def test_bench_train_step_numerics_and_speculators_peer(tmp_path):
    """The default numerics beside speculators' (CPU, tiny shapes, full and reduced draft vocabulary): rows for the
    trainer's default (amp: fp32 weights) and the master mode (bf16_master, MasterAdamW), then speculators' own DSpark
    model and loss on the same samples in the same process (fp32 weights and AdamW), its trainable parameters those
    of dspark's draft (the same architecture), the same matrix work counted for both, and each dspark row's ratios to
    it."""
    pytest.importorskip("speculators")
    for vocab in ([], ["--vocab-size", "100", "--teacher-vocab", "draft"]):
        out = tmp_path / f"peers{len(vocab)}.json"
        proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--steps", "1", "--warmup", "1", "--lengths", "48",
                               "--peers", *vocab, "--out", str(out)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(out.read_text())
        ours, peer = report["results"][:2], report["results"][2]
        assert [(r["precision"], r["optimizer"]) for r in ours] == [("amp", "torch"), ("bf16_master", "torch")]
        assert (peer["loop"], peer["precision"], peer["L"]) == ("speculators", "amp", 48)
        assert peer["teacher_vocab"] == ("draft" if vocab else "full") and peer["draft_vocab_size"] == (100 if vocab
                                                                                                     else None)
        assert peer["trainable_params"] == report["trainable_params"] > 0
        assert peer["model_tflop"] == ours[0]["model_tflop"] > 0 and peer["loss"] == peer["loss"] and peer["step_s"] > 0
        for r in ours:
            assert r["speedup_vs_speculators_run"] == peer["step_s"] / r["step_s"]
        assert "speculators" in proc.stdout and "bf16_master" in proc.stdout
    bad = subprocess.run([sys.executable, str(BENCH), "--tiny", "--trainer", "--precision", "bf16", "--out",
                          str(tmp_path / "x.json")], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "refuses pure-bf16 training" in bad.stderr


def test_reference_runs_read_the_peers_default_numerics_and_the_deepspec_harness(tmp_path):
    """``--reference`` files: the peers' pure-bf16 runs, a peer's ``default_numerics`` block (key ``<peer>_default``)
    and the DeepSpec harness's list of runs (``deepspec_default`` for its fp32-master optimiser, errors skipped); the
    rows' ratios name each."""
    bench = _bench_module()
    peers = tmp_path / "peers.json"
    peers.write_text(json.dumps({"speculators": {"runs": [{"seq_len": 2048, "step_s": 0.05, "peak_gib": 10.0}],
                                                 "default_numerics": {"runs": [{"seq_len": 2048, "step_s": 0.08,
                                                                                "peak_gib": 16.0}]}}}))
    harness = tmp_path / "deepspec_c_bf16opt.json"
    harness.write_text(json.dumps([{"seq_len": 2048, "optimizer": "bf16opt", "step_s": 0.12, "peak_gib": 30.0},
                                   {"seq_len": 4096, "optimizer": "bf16opt", "error": "OOM"}]))
    runs = bench.reference_runs([peers, harness, tmp_path / "missing.json"], 2048, None)
    assert {k: v["step_s"] for k, v in runs.items()} == {"speculators": 0.05, "speculators_default": 0.08,
                                                         "deepspec_default": 0.12}
    assert bench.reference_runs([harness], 4096, None) == {}
    row = {"L": 2048, "draft_vocab_size": None, "step_s": 0.04, "peak_gib": 8.0}
    bench.add_reference(row, [peers, harness])
    assert row["speedup_vs_speculators_default"] == pytest.approx(2.0)
    assert row["peak_ratio_vs_deepspec_default"] == pytest.approx(8.0 / 30.0)
    assert row["meets_speculators_target"] is False  # the goal stays against the pure-bf16 runs (1.25x)


def test_device_time_shares_attributes_kernels_to_the_loss_range():
    bench = _bench_module()

    def ev(name, kernels=(), children=()):
        e = SimpleNamespace(name=name, kernels=[SimpleNamespace(name=k, duration=us) for k, us in kernels],
                            cpu_children=list(children), cpu_parent=None)
        for c in e.cpu_children:
            c.cpu_parent = e
        return e

    loss = ev("dspark.chunked_distill", children=[ev("aten::mm", [("sm90_xmma_gemm_bf16", 600.0)]),
                                                 ev("_stats", [("_stats", 100.0)])])
    step = ev("step", children=[loss, ev("aten::mm", [("nvjet_hsh_gemm", 200.0)]),
                                ev("flex", [("triton_tem_fused_flex_attention", 80.0)]),
                                ev("aten::add_", [("vectorized_elementwise_kernel", 20.0)])])
    events = [step, *step.cpu_children, *loss.cpu_children]  # every event; only roots are walked
    text = bench.device_time_shares(events, 1000.0)
    lines = {ln.split()[0]: ln.split() for ln in text.splitlines()[2:]}
    assert lines["gemm"][1:5] == ["0.60", "60.0%", "0.20", "20.0%"]
    assert lines["loss"][1:] == ["math", "0.10", "10.0%", "0.00", "0.0%"]
    assert lines["attention"][3:5] == ["0.08", "8.0%"] and lines["other"][4:6] == ["0.02", "2.0%"]
    assert lines["all"][1:5] == ["0.70", "70.0%", "0.30", "30.0%"]
    assert "1.00 ms in 5 kernels" in text
    assert bench.kernel_kind("void at::native::vectorized_elementwise_kernel") == "other elementwise"


def _tiny_layer():
    attn = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16)
    return SimpleNamespace(self_attn=attn, mlp=SimpleNamespace(gate_proj=SimpleNamespace(out_features=128)))


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_train_step", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_train_step_shapes():
    """``--shape``: the target (and so the draft's widths) at Qwen3-4B's or Qwen3-8B's shapes."""
    bench = _bench_module()
    four, eight = bench.target_config(False, "qwen3-4b"), bench.target_config(False, "qwen3-8b")
    assert (four.hidden_size, four.intermediate_size, four.tie_word_embeddings) == (2560, 9728, True)
    assert (eight.hidden_size, eight.intermediate_size, eight.tie_word_embeddings) == (4096, 12288, False)
    assert eight.num_hidden_layers == four.num_hidden_layers == 36
