"""The architecture benchmarks (bench/mla_vs_gqa.py, mtp_cost.py, hybrid_vs_attention.py, gated_delta.py) build
tables the benchmark pages accept from their results, and bench/planner_tables.py rewrites only its own section of
the planner-tables page."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.common import ROOT, load_script

MACHINE = "a test machine"


@pytest.fixture(scope="module")
def render_tables():
    return load_script("bench/render_tables.py")


def _written(tmp_path: Path, render_tables, script, columns, rows, **optional) -> dict:
    """The table as write_table stores it, read back through render_tables.load_tables."""
    path = tmp_path / "architectures-01-test.json"
    script.write_table(path, machine=MACHINE, page="architectures", title="t", command="c", columns=columns,
                       rows=rows, **optional)
    (table,) = render_tables.load_tables(tmp_path)
    assert "## t" in render_tables.render_table(table)
    return table


def test_mla_vs_gqa_table_and_flops_match(tmp_path, render_tables):
    bench = load_script("bench/mla_vs_gqa.py")
    mla = bench.model_config(bench.MLA_SMALL)
    for seq in (512, 2048):
        gqa = bench.matched_gqa(mla, seq)
        ratio = bench.forward_flops(gqa, seq) / bench.forward_flops(mla, seq)
        assert abs(ratio - 1) < 0.03, (seq, gqa.attention.head_dim, ratio)
    results = [{"bench": "mla_vs_gqa_time", "seq": 512, "gqa_head_dim": 84, "mla_gflops": 1.6, "gqa_gflops": 1.58,
                "mla_ms": 50.0, "gqa_ms": 40.0, "mla_over_gqa": 1.25},
               {"bench": "mla_vs_gqa_cache", "bytes_per_token_layer": 1152.0, "declared_bf16_bytes": 1152,
                "model_61_layers_kib_per_token": 68.6},
               {"bench": "mla_vs_gqa_cache", "bytes_per_token_layer": 4096.0, "declared_bf16_bytes": 4096,
                "model_61_layers_kib_per_token": 244.0}]
    columns, rows = bench.table(results)
    table = _written(tmp_path, render_tables, bench, columns, rows)
    assert len(table["rows"]) == 4
    assert table["rows"][0][-1] == "1.25" and table["rows"][1][-1] == "0.281"


def test_mla_cache_is_measured_from_the_generation_cache():
    bench = load_script("bench/mla_vs_gqa.py")
    cfg = bench.model_config(["model.d_model=64", "model.attention.n_heads=2", "model.mla.q_lora_rank=16",
                              "model.mla.kv_lora_rank=24", "model.mla.qk_nope_head_dim=8",
                              "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=8", *bench.CACHE_SMALL])
    assert bench.cache_bytes_per_token(cfg, prompt=3, steps=2) == 2 * (24 + 8)  # bf16 latent + rotary key


def test_mtp_cost_table(tmp_path, render_tables):
    bench = load_script("bench/mtp_cost.py")
    tokens = bench.TOKENS_PER_STEP
    records = [{"step": 25, "train/loss": 6.0, "mtp/loss_1": 6.2, "eval/loss": 6.1},
               {"step": 50, "train/loss": 5.5, "eval/loss": 5.6}]
    plain = [{"step": 25, "train/loss": 6.1, "eval/loss": 6.2}, {"step": 50, "train/loss": 5.4, "eval/loss": 5.5}]
    result = {"mtp": bench.curves(records), "no_mtp": bench.curves(plain), "phase1": 40,
              "step_time": {"mtp": 0.6, "no_mtp": 0.4}, "report_tokens": [25 * tokens, 50 * tokens]}
    assert result["mtp"]["mtp/loss_1"] == {25 * tokens: 6.2}
    columns, rows = bench.table(result)
    table = _written(tmp_path, render_tables, bench, columns, rows)
    assert table["rows"][0][2:6] == ["0.3", "6.000", "6.100", "-0.100"]
    assert table["rows"][1][2] == "0.1" and table["rows"][1][6] == "—"
    assert table["rows"][-1][5] == "× 1.50"


def test_hybrid_table_crossover_and_slope(tmp_path, render_tables):
    bench = load_script("bench/hybrid_vs_attention.py")
    results = [{"seq": seq, "hybrid_s": h, "attention_s": a, "hybrid_tok_s": round(seq / h),
                "attention_tok_s": round(seq / a), "hybrid_over_attention": h / a,
                "hybrid_saved_bytes_per_token": 100_000, "hybrid_planned_bytes_per_token": 90_000,
                "attention_saved_bytes_per_token": 80_000, "attention_planned_bytes_per_token": 70_000}
               for seq, h, a in ((2048, 2.0, 1.0), (8192, 8.0, 16.0))]
    assert bench.crossover(results) == "about 4,096"  # ratios 2 and 0.5: 1 halfway in log T
    slope = bench.slopes(results)
    assert slope["hybrid"] == pytest.approx(2.0) and slope["attention"] == pytest.approx(4.0)
    columns, rows, notes = bench.table(results)
    table = _written(tmp_path, render_tables, bench, columns, rows, notes=notes)
    assert table["rows"][1][3] == "0.50" and "about 4,096" in table["notes"]


@pytest.mark.parametrize("hybrid", ["qwen3-next", "kimi-linear", "olmo-hybrid", "nemotron-h"])
def test_hybrid_stacks_differ_only_in_token_mixers(hybrid):
    """Each hybrid's two stacks: 3 linear-time blocks then its attention block against that attention block 4
    times, the same widths, depth and dense feed-forward; its table is the file its --hybrid run writes."""
    bench = load_script("bench/hybrid_vs_attention.py")
    mixed, attention = (bench.config(stack, 2048, hybrid).model for stack in ("hybrid", "attention"))
    kinds = [mixed.layer_type(i) for i in range(4)]
    linear, attend = kinds[0], kinds[3]
    assert kinds == [linear] * 3 + [attend] and linear != attend
    assert [attention.layer_type(i) for i in range(4)] == [attend] * 4
    for m in (mixed, attention):
        assert (m.n_layers, m.d_model, m.ffn.d_ff, m.ffn.activation) == (4, 128, 512, "swiglu")
        assert [m.mlp_type(i) for i in range(4)] == ["dense"] * 4
    assert mixed.attention == attention.attention
    table = json.loads((ROOT / "docs" / "benchmarks" / "data" / bench.HYBRIDS[hybrid].table).read_text())
    assert (f"--hybrid {hybrid} " in table["command"]) == (hybrid != "qwen3-next")
    assert table["title"] == bench.HYBRIDS[hybrid].title


def test_hybrid_table_says_where_the_planner_has_no_bytes():
    bench = load_script("bench/hybrid_vs_attention.py")
    results = [{"seq": 2048, "hybrid_s": 1.0, "attention_s": 2.0, "hybrid_tok_s": 2048, "attention_tok_s": 1024,
                "hybrid_over_attention": 0.5, "hybrid_saved_bytes_per_token": 2048,
                "hybrid_planned_bytes_per_token": None, "attention_saved_bytes_per_token": 1024,
                "attention_planned_bytes_per_token": 1536}]
    _, (row,), _ = bench.table(results)
    assert row[4] == "2.0 (planner: no bytes for its kinds)" and row[5] == "1.0 (1.5)"


def test_gated_delta_table(tmp_path, render_tables):
    bench = load_script("bench/gated_delta.py")
    results = [{"batch": 2, "heads": 4, "head_dim": 64, "seq": 512, "dtype": "fp32", "transformers_ms": 30.0,
                "ours_ms": 20.0, "speedup": 1.5, "out_max_diff": 3e-8, "dq_max_diff": 5e-8}]
    columns, rows = bench.table(results)
    table = _written(tmp_path, render_tables, bench, columns, rows)
    assert table["rows"] == [["2, 4, 64, 512", "fp32", "30.0", "20.0", "1.50", "3.0e-08", "5.0e-08"]]


def test_planner_tables_rewrite_only_their_section():
    bench = load_script("bench/planner_tables.py")
    case = bench.Case("deepseek-v3", 256)
    rows = [bench.Row(case, ["deepseek-v3", "256", "pp 1 × tp 1 × FSDP 256, ep 8", "full", "60.2", "none", "yes", "1"],
                      "a note")]
    section = bench.markdown(rows, "h100-80gb")
    page = "# Planner tables\n\nhand-written text\n"
    once = bench.render(page, section)
    assert once.startswith(page) and "| deepseek-v3 | 256 |" in once and "- a note" in once
    rows[0].cells[4] = "61.0"
    twice = bench.render(once, bench.markdown(rows, "h100-80gb"))
    assert twice.count(bench.BEGIN) == 1 and "61.0" in twice and "60.2" not in twice
    assert twice.startswith(page)


def test_planner_tables_page_section_is_current():
    """The page's generated section holds the rows the script's cases give (the cheapest recomputed)."""
    bench = load_script("bench/planner_tables.py")
    page = bench.PAGE.read_text()
    assert bench.BEGIN in page and bench.END in page
    (row,) = bench.plan_rows(bench.Case("qwen3-next-80b-a3b", 64), "h100-80gb")
    line = "| " + " | ".join(row.cells[:-1]) + " |"
    assert line in page, json.dumps(row.cells)
