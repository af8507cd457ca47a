"""The CPU-runnable step benchmarks still run: each at its tiniest setting exits 0 and prints well-formed JSON lines.

Benchmarks are only run by hand, so an API change elsewhere breaks them silently (vs_nanogpt once set a
read-only property). No timing is asserted here, only that they run and report what they are read for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, timeout: float = 240) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"bench/{script} failed:\n{done.stderr[-3000:]}"
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert records, f"bench/{script} printed no JSON line:\n{done.stdout[-2000:]}"
    return records


VS_NANOGPT_KEYS = {"shape", "dtype", "compile", "loss", "threads", "clock", "isolate", "load_1min",
                   "flops_per_token", "ours_tokens_per_s", "reference_tokens_per_s", "ours_rounds_tokens_per_s",
                   "reference_rounds_tokens_per_s", "ours_mfu", "ratio"}


@pytest.mark.parametrize("isolate", ["none", pytest.param("process", marks=pytest.mark.slow)])  # same script twice
def test_vs_nanogpt_tiny(isolate):
    (record,) = run_bench("vs_nanogpt.py", "--shape", "tiny", "--dtype", "fp32", "--steps", "1", "--rounds", "1",
                          "--warmup", "1", "--threads", "1", "--clock", "cpu", "--isolate", isolate)
    assert VS_NANOGPT_KEYS <= record.keys(), VS_NANOGPT_KEYS - record.keys()
    assert record["bench"] == "vs_nanogpt" and record["isolate"] == isolate and record["threads"] == 1
    assert record["ours_tokens_per_s"] > 0 and record["reference_tokens_per_s"] > 0
    assert record["ratio"] == pytest.approx(record["ours_tokens_per_s"] / record["reference_tokens_per_s"], rel=0.01)


@pytest.mark.slow  # ~1 min
def test_profile_step_tiny():
    records = run_bench("profile_step.py", "--shape", "tiny", "--dtype", "bf16", "--steps", "1", "--threads", "1")
    assert [r["side"] for r in records] == ["reference", "ours"]
    for record in records:
        phases = record["phase_ms_per_step"]
        # every phase of a step is marked on both sides, so their breakdowns line up
        assert {"forward", "head (+ fused loss)", "backward", "clip_grad", "optimizer", "zero_grad"} <= phases.keys()
        assert phases["total"] == pytest.approx(sum(v for k, v in phases.items() if k != "total"), abs=0.1)
        assert record["self_cpu_ms_per_step"]["matmul"] > 0 and record["top_ops_ms_per_step"]


def test_fused_loss_memory_tiny_cpu():
    records = run_bench("fused_loss_memory.py", "--shape", "tiny", "--device", "cpu")
    kinds = {r["kind"]: r for r in records}
    assert {"plain", "chunked", "autograd_checkpointed"} <= kinds.keys()
    assert kinds["chunked"]["loss_rel_err"] < 1e-5 and kinds["chunked"]["peak_vs_plain"] > 0
    assert kinds["autograd_checkpointed"]["grad_h_rel_err"] < 1e-5  # the reference the hand-derived backwards beat


def test_gemm_ceiling_cpu():
    (record,) = run_bench("gemm_ceiling.py", "--n", "128", "--seconds", "0.1", "--device", "cpu")
    assert record["bench"] == "gemm_ceiling" and record["bf16_tflops"] > 0


def test_cpu_attention_tiny():
    (record,) = run_bench("cpu_attention.py", "--shape", "tiny", "--dtype", "bf16", "--rounds", "1")
    assert record["bench"] == "cpu_attention" and record["sdpa_ms"] > 0 and record["blockwise_ms"] > 0
    assert record["blockwise_error"] < 2 * record["sdpa_error"]  # flash's accuracy (fp32 scores)


def test_attention_sinks_tiny():
    *rows, clip = run_bench("attention_sinks.py", "--device", "cpu", "--dtype", "fp32", "--shape", "tiny",
                            "--rounds", "1")
    assert [r["backend"] for r in rows] == ["sdpa", "flash", "efficient", "cudnn", "blockwise"]
    assert all(r["out_rel_err"] < 1e-5 and r["sink_grad_rel_err"] < 1e-5 for r in rows), rows
    assert clip["row"] == "qk_clip_kernel" and clip["recording_ms"] > 0 and clip["flash_ms"] > 0


@pytest.mark.parametrize(("rule", "reference"), [
    ("gated_delta", "qwen3_next"), pytest.param("kda", "kimi_linear", marks=pytest.mark.slow)])
def test_gated_delta_tiny(rule, reference):
    pytest.importorskip(f"transformers.models.{reference}.modeling_{reference}")  # the reference side
    (record,) = run_bench("gated_delta.py", "--rule", rule, "--shape", "1,2,16,80", "--rounds", "1", "--threads", "1")
    assert record["bench"] == rule and record["transformers_ms"] > 0 and record["ours_ms"] > 0
    assert record["out_max_diff"] < 1e-5 and record["dq_max_diff"] < 1e-5  # the same rule on both sides


@pytest.mark.slow
@pytest.mark.matrix  # the scan is checked against transformers in tests/unit/model/test_mamba2.py
def test_mamba2_tiny():
    pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")  # the reference side
    (record,) = run_bench("mamba2.py", "--shape", "1,2,16,8,1,80", "--rounds", "1", "--threads", "1")
    assert record["bench"] == "mamba2" and record["transformers_ms"] > 0 and record["ours_ms"] > 0
    assert record["out_max_diff"] < 1e-4 and record["dx_max_diff"] < 1e-4  # the same scan on both sides


@pytest.mark.slow
@pytest.mark.parametrize("hybrid", ["kimi-linear", *(pytest.param(h, marks=pytest.mark.matrix)
                                                     for h in ("qwen3-next", "olmo-hybrid", "nemotron-h"))])
def test_hybrid_vs_attention_tiny(tmp_path, hybrid):
    path = tmp_path / "architectures-03-test.json"
    *rows, summary = run_bench("hybrid_vs_attention.py", "--hybrid", hybrid, "--seq", "32", "64", "--rounds", "1",
                               "--table", str(path), "--machine", "a test machine")
    assert [r["seq"] for r in rows] == [32, 64] and summary["bench"] == "hybrid_vs_attention_summary"
    assert all(r["hybrid_s"] > 0 and r["attention_s"] > 0 and r["hybrid_saved_bytes_per_token"] > 0 for r in rows)
    table = loaded_table(tmp_path)
    assert len(table["rows"]) == 2 and ("--hybrid" in table["command"]) == (hybrid != "qwen3-next")


def loaded_table(folder: Path) -> dict:
    """The one table in `folder`, as the docs' renderer loads it (which checks its keys, date and row widths)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from render_tables import load_tables

    (table,) = load_tables(folder)
    return table


def test_moe_layer_tiny(tmp_path):
    records = run_bench("moe_layer.py", "--shape", "tiny", "--rounds", "1", "--threads", "1", "--table",
                        str(tmp_path / "moe-01-layer-cpu.json"), "--machine", "this machine")
    assert [r["routing"] for r in records] == ["balanced", "skewed"]
    for record in records:
        assert record["bench"] == "moe_layer" and record["dense_d_ff"] == 2 * record["moe_d_ff"]  # same active FLOPs
        ran = record["backends"]
        assert {"loop", "padded"} <= ran.keys() and ran.keys() | record["skipped"].keys() == {"loop", "padded",
                                                                                          "grouped_mm"}
        for side in ran.values():
            assert side["ratio"] == pytest.approx(record["dense_ms"] / side["layer_ms"], rel=0.01, abs=2e-3)
            assert 0 <= side["permute_share"] < 1
        assert record["best_ratio"] == max(side["ratio"] for side in ran.values())
    assert records[1]["max_over_mean_load"] >= 1.8  # the skew bias did skew the load (target 2)
    table = loaded_table(tmp_path)  # --table wrote the MoE page's table from these records, a row each
    assert table["machine"] == "this machine" and [row[1].split()[0] for row in table["rows"]] == ["balanced", "skewed"]
    assert table["rows"][0][4] == f"{records[0]['dense_tokens_per_s']:,.0f}"


def test_gated_delta_fla_says_why_it_skips():
    """Without CUDA or fla the GPU check writes one line saying which is missing
    (tests/unit/model/test_gated_delta_fla.py runs its measurement on CPU with a stand-in fla)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the bench measures")
    (record,) = run_bench("gated_delta_fla.py", "--shape", "1,2,4,8,16", "--rounds", "1")
    assert record == {"bench": "gated_delta_fla", "status": "skipped", "reason": "CUDA is not available"}


@pytest.mark.slow  # two trainings through the CLI: ~1 min each on a busy 2-core box
def test_moe_vs_dense_tiny(tmp_path):
    records = run_bench("moe_vs_dense.py", "--steps", "2", "--eval-interval", "1", "--threads", "1", "--concurrent",
                        "--set", "data.batch_size=2", "train.eval_batches=1", "--png", str(tmp_path / "curves.png"),
                        "--work", str(tmp_path), timeout=600)
    runs = {r["config"]: r for r in records if r["bench"] == "moe_vs_dense"}
    assert runs.keys() == {"tiny-gpt", "tiny-moe"}
    assert abs(runs["tiny-moe"]["active_params"] / runs["tiny-gpt"]["active_params"] - 1) < 0.01  # equal active
    assert runs["tiny-moe"]["total_params"] > 2 * runs["tiny-moe"]["active_params"]
    for run in runs.values():
        assert [s for s, _ in run["eval"]] == [1, 2] and [s for s, _ in run["train"]] == [1, 2]
        assert run["tokens_per_step"] == 2 * 128
    (summary,) = [r for r in records if r["bench"] == "moe_vs_dense_summary"]
    assert summary["tokens"] == 2 * 2 * 128
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_muon_benches_tiny():
    (record,) = run_bench("muon_vs_adamw.py", "--skip-training", "--small", "--rounds", "1", "--batch", "2")
    assert record["bench"] == "muon_step_time" and record["muon_over_adamw"] > 0
    assert 0 < record["muon_share_of_training_step"] < 1 and 0 < record["ns_flops_share_at_0.5M_tokens"] < 1
    records = run_bench("muon_distributed.py", "--worlds", "1", "2", "--rounds", "1", "--d-model", "32")
    assert [(r["world"], r["layout"]) for r in records] == [(1, "single"), (2, "fsdp"), (2, "tp")]
    assert all(r["muon_over_adamw"] > 0 and r["owners_over_every_rank"] > 0 for r in records)


@pytest.mark.slow  # the GPU script's CPU dry run: an environment line, then the MoE layer items on tiny shapes
def test_gpu_moe_smoke(tmp_path):
    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("SUITE_BUDGET_S", None)
    done = subprocess.run(["bash", "bench/gpu_moe.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert lines[0]["bench"] == "environment"
    assert {r["item"]: r["status"] for r in lines if "item" in r} == {"moe_mixtral": "ok", "moe_qwen3": "ok",
                                                                       "moe_mixtral_queued": "ok"}
    layers = [r for r in lines if r.get("bench") == "moe_layer"]
    assert len(layers) == 4  # balanced + skewed, then skewed, then balanced compiled
    assert layers[-1]["queue"] == 2 and layers[-1]["compiled_graphs"] == 2  # one graph a side: no break in the layer
    (tmp_path / "results.jsonl").unlink()  # the run leaves the MoE page's table of its eager rows in $OUT
    table = loaded_table(tmp_path)
    assert table["machine"].startswith("a CPU dry run") and [row[:2] for row in table["rows"]] == [
        ["tiny", "balanced"], ["tiny", "skewed"]]


@pytest.mark.slow  # two 2-process trainings
def test_moe_expert_parallel_tiny():
    """The exchange's share is measured where there is one (ep 2) and nowhere else (ep 1: no all-to-all)."""
    records = run_bench("moe_expert_parallel.py", "--world", "2", "--steps", "1", "--ep", "1", "2", timeout=600)
    assert [r["ep"] for r in records] == [1, 2]
    assert records[0]["exchange_share"] == 0 and 0 < records[1]["exchange_share"] < 1
    assert records[0]["ratio_to_ep1"] == 1.0 and records[1]["tokens_per_s"] > 0
