"""Every benchmark script writes its table of the docs' benchmark pages: a small synthetic result goes through the
script's row-building function and bench/tables.py into a folder, render_tables.load_tables accepts what comes out,
and the rows carry the numbers given. Every table under docs/benchmarks/data names a script that takes --table."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from types import ModuleType

import pytest
from helpers.common import ROOT, load_script

MACHINE = "a test machine"
DATA = ROOT / "docs" / "benchmarks" / "data"


def script(name: str) -> ModuleType:
    return load_script(f"bench/{name}.py")


def tables_module() -> ModuleType:
    return script("tables")


def summary_table(folder: Path, name: str, page: str) -> Path:
    """An empty summary table (one row per script, dated per row), as training-01/parallel-01 are."""
    path = folder / name
    path.write_text(json.dumps({"page": page, "title": "summary", "machine": MACHINE,
                                "columns": ["benchmark", "what it compares", "result", "measured"], "rows": []}))
    return path


def loaded_cells(folder: Path) -> str:
    """Every cell and text of the tables in `folder`, once render_tables.load_tables has accepted them."""
    tables = script("render_tables").load_tables(folder)
    assert tables, f"no table written in {folder}"
    return "\n".join(str(v) for t in tables for v in [t["title"], t.get("setup"), t.get("notes"), *t["columns"],
                                                      *(cell for row in t["rows"] for cell in row)])


def check(folder: Path, *shown: str) -> None:
    cells = loaded_cells(folder)
    missing = [text for text in shown if text not in cells]
    assert not missing, f"{missing} not in the table:\n{cells}"


def write_summary_row(tmp_path: Path, module: ModuleType, result: object, page: str = "training") -> None:
    path = summary_table(tmp_path, f"{page}-01-cpu.json", page)
    row = module.table_row(result)
    tables_module().write_row(path, machine=MACHINE, row=row)
    assert json.loads(path.read_text())["rows"][0][0] == module.SUMMARY[0]


def test_first_hour(tmp_path):
    steps = [{"milestone": "installed", "command": "pip install x", "seconds": 133.0, "first_loss_s": None},
             {"milestone": "trained", "command": "meshformer train", "seconds": 52.0, "first_loss_s": 13.0}]
    script("first_hour").write(tmp_path / "training-03-first-hour.json", steps, MACHINE)
    check(tmp_path, "133 s", "146 s", "185 s")


def test_train_throughput(tmp_path):
    records = [{"dtype": "fp32", "overhead_ratio": 1.005, "trainer_mfu": 0.4812},
               {"dtype": "bf16", "overhead_ratio": 0.987, "trainer_mfu": 0.2203}]
    write_summary_row(tmp_path, script("train_throughput"), records)
    check(tmp_path, "fp32 1.005×", "bf16 0.987×", "48% (fp32)", "22% (bf16)")


def test_vs_nanogpt(tmp_path):
    base = {"dtype": "fp32", "compile": "off", "loss": "auto", "threads": 2}
    records = [{**base, "shape": "S", "ratio": 1.134}, {**base, "shape": "M", "ratio": 1.281},
               {**base, "dtype": "bf16", "shape": "S", "ratio": 1.44}]
    write_summary_row(tmp_path, script("vs_nanogpt"), records)
    check(tmp_path, "2 threads", "fp32 S 1.13×, M 1.28×", "bf16 S 1.44×")


def test_data_throughput(tmp_path):
    write_summary_row(tmp_path, script("data_throughput"), {"loader_over_tiny": 412.4})
    check(tmp_path, "412×")


def test_cpu_attention(tmp_path):
    base = {"threads": 2, "sdpa_error": 5.6e-3, "blockwise_error": 4.3e-3}
    records = [{**base, "dtype": "bf16", "shape": "S", "speedup": 1.16},
               {**base, "dtype": "fp32", "shape": "M", "speedup": 1.33, "sdpa_error": 1e-6, "blockwise_error": 9e-7}]
    write_summary_row(tmp_path, script("cpu_attention"), records)
    check(tmp_path, "bf16 S 1.16×", "fp32 M 1.33×", "4.3e-03 (ours) vs 5.6e-03 (SDPA)")


def test_checkpoint_io(tmp_path):
    results = {"save_fraction_of_disk": 0.81, "load_fraction_of_disk": 0.64, "async_blocked_s": 0.16,
               "blocking_blocked_s": 1.34}
    write_summary_row(tmp_path, script("checkpoint_io"), results)
    check(tmp_path, "save 81% of disk write", "load 64% of disk read", "0.16 s (async) vs 1.34 s (blocking)")


def test_parallel_memory(tmp_path):
    records = [{"ratio_to_1_rank": r} for r in (1.0, 0.5013, 0.2507)]
    write_summary_row(tmp_path, script("parallel_memory"), records, "parallel")
    check(tmp_path, "1.00 / 0.50 / 0.25")


def test_parallel_recompute(tmp_path):
    records = [{"recompute": mode, "peak_ratio": ratio}
               for mode, ratio in (("full", 0.64), ("none", 1.0), ("every_k", 0.78), ("selective", 0.84))]
    write_summary_row(tmp_path, script("parallel_recompute"), records, "parallel")
    check(tmp_path, "1.00 / 0.84 / 0.78 / 0.64")


def test_parallel_bubble(tmp_path):
    def record(schedule: str, m: int, idle: float, textbook: float) -> dict:
        return {"schedule": schedule, "p": 2, "m": m, "measured_idle": idle, "textbook_(p-1)/(v*m+p-1)": textbook}
    records = [record("1f1b", 4, 0.3, 0.2), record("1f1b", 8, 0.17, 0.11), record("zbv", 8, 0.06, 0.06)]
    write_summary_row(tmp_path, script("parallel_bubble"), records, "parallel")
    check(tmp_path, "m=8", "1F1B 0.17 (0.11)", "ZBV 0.06 (0.06)")


def test_parallel_throughput(tmp_path):
    records = [{"layout": "single", "processes": 1, "per_core_ratio": 1.0},
               {"layout": "fsdp2", "processes": 2, "per_core_ratio": 0.86},
               {"layout": "pp2_dp2_tp2", "processes": 8, "per_core_ratio": 0.33}]
    write_summary_row(tmp_path, script("parallel_throughput"), records, "parallel")
    check(tmp_path, "0.33–0.86", "fsdp2 0.86")


def test_pp_head_loss_memory(tmp_path):
    records = [{"schedule": "gpipe", "last_stage_vs_plain": {"plain": 1.0, "chunked": 0.65, "chunked_recompute": 0.5}}]
    write_summary_row(tmp_path, script("pp_head_loss_memory"), records, "parallel")
    check(tmp_path, "GPipe 0.65 / 0.50")


def test_muon_distributed(tmp_path):
    module = script("muon_distributed")
    summary_table(tmp_path, module.SUMMARY_TABLE, "parallel")
    records = [{"world": 1, "layout": "single", "owners_over_every_rank": 0.58},
               {"world": 2, "layout": "fsdp", "owners_over_every_rank": 0.64},
               {"world": 4, "layout": "tp", "owners_over_every_rank": 0.561}]
    module.write_tables(tmp_path, MACHINE, records)
    check(tmp_path, "2, FSDP", "0.64", "4, TP", "0.56", "read 0.58", "0.64 (FSDP 2)")


def test_fault_tolerance(tmp_path):
    module = script("fault_tolerance")
    row = {"config": "tiny-moe", "groups": 3, "ranks": 2, "join_timeout_s": 10.0, "plain_step_s": 2.0,
           "ft_step_s": 2.06, "ft_next_step_s": 3.4, "ft_rejoin_s": 17.0, "restart_first_step_s": 31.0,
           "restart_next_step_s": 41.0, "restart_steps_retrained": 12.0}
    args = argparse.Namespace(backend="gloo", configs=["tiny-moe"], groups=[3], ranks=2, kill_at=12,
                              heartbeat_timeout_s=1.0, join_timeout_s=10.0, checkpoint_every=50, machine=MACHINE,
                              goodput_minutes=10.0, goodput_reference_minutes=3.0, goodput_config="tiny-gpt",
                              goodput_groups=2, goodput_ranks=1)
    module.write_rows(tmp_path / module.ROWS_TABLE.format(backend="gloo"), [row], args)
    run = {"tokens_per_step": 4096.0}  # 16 sequences of 128 tokens on each of 2 ranks
    goodput = {"ft-no-kill": {"steps": 100.0, "seconds": 180.0, "kills": 0.0, **run},
               "ft-kills": {"steps": 300.0, "seconds": 600.0, "kills": 10.0, **run},
               "restart-no-kill": {"steps": 90.0, "seconds": 180.0, "kills": 0.0, **run},
               "restart-kills": {"steps": 30.0, "seconds": 600.0, "kills": 10.0, **run}}
    module.write_goodput(tmp_path / module.GOODPUT_TABLE.format(backend="gloo"), goodput, args)
    # 100 steps of 4096 tokens in 180 s: 2,276 tokens/s
    check(tmp_path, "tiny-moe", "3 × 2", "2.060 / 2.000", "+3.0%", "3.4 (1.3 beyond a step)", "17.0", "31.0",
          "41.0", "12", "2,276", "2,048", "0.90", "2,048", "205", "0.10", "every 50 steps")
    page = tmp_path / "page.md"
    page.write_text(f"before\n{module.DOCS_BEGIN}\nold figures\n{module.DOCS_END}\nafter\n")
    module.write_docs(page, tmp_path, "gloo")
    text = page.read_text()
    assert "old figures" not in text and text.startswith("before\n") and text.endswith("after\n")
    assert "| tiny-moe | 3 × 2 | 10 | 2.060 / 2.000 | +3.0% |" in text
    assert "replica groups (heal from a live peer) 0.90" in text


def test_moe_layer(tmp_path):
    module = script("moe_layer")
    backend = {"tokens_per_s": 31793.0, "ratio": 0.794, "compute_ratio": 0.88}
    record = {"shape": "small", "routing": "balanced", "device": "cpu", "dtype": "float32", "threads": 1,
              "rounds": 9, "compiled": False, "d_model": 128, "n_experts": 8, "experts_per_token": 2, "moe_d_ff": 256,
              "n_shared_experts": 0, "tokens": 2048, "max_over_mean_load": 1.061, "dense_tokens_per_s": 40044.0,
              "backends": {"loop": {"tokens_per_s": 23503.0, "ratio": 0.587, "compute_ratio": 0.64},
                           "grouped_mm": backend}}
    module.write(tmp_path / "moe-01-layer-cpu.json", MACHINE, [record, {**record, "routing": "skewed"}], "cmd")
    check(tmp_path, "small: d 128, 8 × 256 GELU top-2, 2,048 tok", "balanced (1.06)", "grouped_mm / loop",
          "31,793 / 23,503", "40,044", "**0.79** / 0.59", "0.88 / 0.64", "median of 9 rounds")


def test_moe_vs_dense(tmp_path):
    module = script("moe_vs_dense")
    dense = {"config": "tiny-gpt", "eval": [(100, 5.074), (200, 4.489)], "total": 1.33e6, "active": 1.33e6,
             "seconds": 25.0}
    moe = {"config": "tiny-moe", "eval": [(100, 5.159), (200, 4.481)], "total": 2.91e6, "active": 1.34e6,
           "seconds": 51.0}
    args = argparse.Namespace(png=Path("moe_vs_dense.png"), steps=200)
    module.write(tmp_path / "moe-03-vs-dense.json", MACHINE, [dense, moe], 2048, args)
    check(tmp_path, "204,800", "**5.074**", "5.159", "409,600", "**4.481**", "1.34M active / 2.91M total",
          "first below tiny-gpt at 409,600 tokens", "0.008 nats lower")


def test_house_overhead(tmp_path):
    module = script("house_overhead")
    args = argparse.Namespace(table=tmp_path / "training-05-house-overhead.json", machine=MACHINE,
                              reference="9abc769", steps=30, warmup=5, repeats=6)
    medians = {"reference": {"cpu_ms": 400.0, "wall_ms": 900.0}, "ours": {"cpu_ms": 408.0, "wall_ms": 882.0}}
    module.write_overhead_table(args, medians, {"reference": "9abc769", "ours": "abc1234"})
    check(tmp_path, "reference (9abc769)", "this tree (abc1234)", "408.0", "1.020", "0.980", "6 runs each")


def test_moe_balance(tmp_path):
    module = script("moe_balance")
    records = [{"balancing": "none", "load_max_over_mean": 3.12, "worst_layer": 3.63, "final_loss": 4.754},
               {"balancing": "aux_loss", "load_max_over_mean": 1.41, "worst_layer": 1.92, "final_loss": 4.8031}]
    tables_module().write_table(tmp_path / "moe-04-balance.json", machine=MACHINE, page="moe", title="t",
                                command="c", columns=["balancing", "load", "loss"], rows=module.table_rows(records))
    check(tmp_path, "3.12 (3.63)", "**1.41** (1.92)", "4.803", "aux loss 0.01")


def test_moe_expert_parallel(tmp_path):
    module = script("moe_expert_parallel")
    run = [{"ep": 1, "ratio_to_ep1": 1.0, "exchange_share": 0.0}, {"ep": 2, "ratio_to_ep1": 1.21,
                                                                      "exchange_share": 0.071}]
    rows = module.table_rows([run, [run[0], {**run[1], "ratio_to_ep1": 1.04, "exchange_share": 0.082}]])
    tables_module().write_table(tmp_path / "moe-05-expert-parallel.json", machine=MACHINE, page="moe", title="t",
                                command="c", columns=["", "ep 1", "ep 2"], rows=rows)
    check(tmp_path, "1.21× / 1.04×", "7.1% / 8.2%")


def test_muon_vs_adamw(tmp_path):
    module = script("muon_vs_adamw")
    def runs(adamw: float, muon: float) -> dict:
        curve = {"train": [(s, adamw + 1 / s) for s in (24, 48, 72, 96, 100)], "eval": [(50, 5.5), (100, adamw)],
                 "tokens_per_step": 2048}
        return {"adamw": curve, "muon": {**curve, "train": [(s, muon + 1 / s) for s in (24, 48, 72, 96, 100)],
                                         "eval": [(50, 5.2), (100, muon)]}}
    curves = {"tiny-gpt": runs(4.827, 4.577), "tiny-moe": runs(4.879, 4.573)}
    summaries = {"tiny-gpt": {"muon_step_reaching_adamw_final": 66, "muon_tokens_ratio": 0.66},
                 "tiny-moe": {"muon_step_reaching_adamw_final": None, "muon_tokens_ratio": None}}
    steps = [{"config": "tiny-gpt", "overrides": [], "muon_over_adamw": 10.7, "muon_step_ms": 125.0,
              "adamw_step_ms": 11.7, "params": 1.33e6, "muon_share_of_training_step": 0.11, "tokens_per_step": 2048}]
    args = argparse.Namespace(steps=100, batch=16, lr=3e-3, muon_lr=3e-3)
    module.write_tables(tmp_path, MACHINE, curves, summaries, steps, args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["muon-01-eval.json", "muon-02-tiny-gpt.json",
                                                         "muon-03-tiny-moe.json"]
    check(tmp_path, "50 (102k)", "100 (205k)", "tiny-gpt, Muon", "4.577", "4.879", "0.66× the tokens",
          "not within the run (tiny-moe)", "10.7× on tiny-gpt (125 vs 12 ms", "4.848", "4.598")


def test_plan_vs_measured(tmp_path):
    module = script("plan_vs_measured")
    mib = 2**20
    rows = [{"world": 1, "layout": {"single": "process"}, "predicted": 48.78 * mib, "measured": 48.06 * mib,
             "error": 0.015, "moe_imbalance": 1.0, "predicted_default": 48.78 * mib},
            {"world": 2, "layout": {"ep": 2, "model": {}}, "predicted": 54.89 * mib, "measured": 53.54 * mib,
             "error": -0.034, "moe_imbalance": 1.045, "predicted_default": 64.01 * mib}]
    module.write(tmp_path / "parallel-02-plan-vs-measured.json", MACHINE, rows)
    check(tmp_path, "single process", "48.78", "48.06", "+1.5%", "MoE, ep=2", "−3.4%", "1.045×", "+19.6%")


def test_plan_vs_measured_gpu(tmp_path):
    rows = script("plan_vs_measured_gpu").table_rows([{"recompute": "none", "error": 0.041},
                                                      {"recompute": "every_k", "error": -0.025}])
    tables_module().write_table(tmp_path / "parallel-03.json", machine=MACHINE, page="parallel", title="t",
                                command="c", columns=["recompute", "error"], rows=rows)
    check(tmp_path, "+4.1%", "every 2nd block", "−2.5%")


def test_scale_memory(tmp_path):
    records = [{"layout": "fsdp x8", "ratio": 0.751, "phase_ratio": {
        "startup": 0.12, "forward_backward": 0.75, "optimizer_step": 0.3, "final_save": 0.49, "between": 0.1}}]
    rows = script("scale_memory").table_rows(records)
    tables_module().write_table(tmp_path / "parallel-04.json", machine=MACHINE, page="parallel", title="t",
                                command="c", columns=["layout", "ratio", "peak in"], rows=rows)
    check(tmp_path, "FSDP-8", "0.75", "forward/backward (start-up 0.12, optimizer step 0.30, save 0.49)")


def test_data_prepare(tmp_path):
    module = script("data_prepare")
    result = {"throughput": {"jsonl": {"ratio": 0.951}, "parquet": {"ratio": 0.96},
                             "megatron": {"vs_jsonl_prepare": 9.2}, "flat": {"vs_jsonl_prepare": 10.4}},
              "rss": {"jsonl": {"ratio": 1.02}}}
    tables_module().write_table(tmp_path / "training-02.json", machine=MACHINE, page="training", title="t",
                                command="c", notes=module.rss_note(result), columns=["format", "speed"],
                                rows=module.table_rows(result))
    check(tmp_path, "JSONL", "0.95×", "Parquet", "0.96×", "9–10× faster", "JSONL 1.02×")


def test_lm_eval_speed(tmp_path):
    module = script("lm_eval_speed")
    records = [{"output_type": "loglikelihood", "task": "bundled:kjv_lastword", "requests": 40, "ours_rps": 812.4,
                "hf_rps": 402.1, "ratio": 2.0204}]
    tables_module().write_table(tmp_path / "training-04.json", machine=MACHINE, page="training", title="t",
                                command="python bench/lm_eval_speed.py", columns=module.COLUMNS,
                                rows=module.table_rows(records))
    check(tmp_path, "loglikelihood", "812.4", "402.1", "2.02×")


def test_eval_share(tmp_path):
    module = script("eval_share")
    records = [{"tasks": "multiple choice (kjv_cloze, kjv_next)", "evaluations": 3, "fit_s": 412.6,
                "downstream_s": 9.84, "share": 0.02385}]
    tables_module().write_table(tmp_path / "training-05.json", machine=MACHINE, page="training", title="t",
                                command="python bench/eval_share.py", columns=module.COLUMNS,
                                rows=module.table_rows(records))
    check(tmp_path, "kjv_cloze, kjv_next", "413", "9.8", "2.4%")


def test_gpu_tables(tmp_path):
    module = script("gpu_tables")
    records = [
        {"bench": "environment", "torch": "2.11.0", "cuda": True, "gpu": "NVIDIA H200"},
        {"bench": "gemm_ceiling", "n": 8192, "bf16_tflops": 682.4, "fp8_tflops": 1273.0},
        {"bench": "speed_sweep", "shape": "gpt2-xl", "variant": "reference", "compile": "model", "tokens_per_s": 41907},
        {"bench": "speed_sweep", "shape": "gpt2-xl", "variant": "blocks+plain", "tokens_per_s": 41950.0,
         "ratio_vs_reference": 1.001, "mfu": 0.4},
        {"bench": "speed_sweep", "shape": "llama-1b", "variant": "blocks+plain", "tokens_per_s": 1.0, "mfu": 0.5,
         "peak_flops": 989e12},
        {"bench": "fp8_layers", "shape": "llama8b-layers", "recipe": "off", "steps": 200, "tokens_per_s": 100.0,
         "loss_last10": 4.4},
        {"bench": "fp8_layers", "shape": "llama8b-layers", "recipe": "tensorwise", "steps": 200, "tokens_per_s": 130.0,
         "loss_last10": 4.356},
        {"bench": "profile_step", "side": "ours", "shape": "llama-1b", "variant": "blocks", "step_ms": 141.9,
         "gpu_busy_ms_per_step": 140.2, "gpu_ms_per_step": {"gemm": 82.3, "attention": 14.2}},
        {"bench": "moe_layer", "shape": "qwen3-moe", "routing": "skewed", "queue": 1, "compiled": False, "rounds": 5,
         "dense_tokens_per_s": 2629324.0, "backends": {"grouped_mm": {"tokens_per_s": 1011208.0, "ratio": 0.385,
                                                                      "compute_ratio": 0.67}}},
        {"bench": "moe_layer", "shape": "qwen3-moe", "routing": "skewed", "queue": 1, "compiled": "default",
         "dense_tokens_per_s": 2613142.0, "backends": {"grouped_mm": {"tokens_per_s": 1273884.0, "ratio": 0.49,
                                                                      "compute_ratio": 0.9}}},
    ]
    assert module.machine_of(records) == "one NVIDIA H200 (torch 2.11.0)"
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    for kind, name in (("sweep", "gpu-01-h200.json"), ("moe", "moe-02-layer-h200.json")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("sys.argv", ["gpu_tables.py", kind, "--results", str(results), "--table",
                                       str(tmp_path / name)])
            module.main()
    results.unlink()
    check(tmp_path, "bf16 682 TFLOP/s, FP8 1,273", "41,907 tok/s", "blocks+plain 41,950 (1.001×)", "50.0% MFU",
          "tensorwise 1.30× bf16 tokens/s, loss −1.0%", "gemm 82.3", "GPU busy 140.2", "989 TFLOP/s",
          "Qwen3-MoE-like", "1,011,208 / 2,629,324", "0.39 (0.67)", "1,273,884 / 2,613,142", "0.49", "One NVIDIA H200")


def scripts_named(table: dict) -> list[str]:
    """The bench/ scripts a table's command names, and for a summary table each row's first cell."""
    texts = [table.get("command") or ""]
    if table["columns"][-1] == "measured":
        texts += [row[0] for row in table["rows"]]
    return sorted({name for text in texts for name in re.findall(r"bench/[\w.]+\.(?:py|sh)", text)})


@pytest.mark.parametrize("path", sorted(DATA.glob("*.json")), ids=lambda p: p.name)
def test_every_table_names_a_script_that_writes_it(path):
    table = json.loads(path.read_text())
    named = scripts_named(table)
    assert named, f"{path.name}: its command names no bench/ script"
    for name in named:
        source = ROOT / name
        assert source.is_file(), f"{path.name} names {name}, which does not exist"
        text = source.read_text()
        writes = "add_table_arguments" in text if name.endswith(".py") else "--table" in text
        assert writes, f"{name} (named by {path.name}) takes no --table: it cannot write its table"
