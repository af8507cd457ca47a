"""What `meshformer plan` says besides the numbers: what it assumes, why listed layouts tie, and that the bundled MoE
configs' own layouts fit at the world sizes their files and the README show."""

from __future__ import annotations

import json

import pytest
from helpers.common import CONFIGS

from meshformer.cli import main


def test_plan_prints_what_it_assumes(capsys):
    main(["plan", str(CONFIGS / "olmoe-1b-7b.toml"), "--world", "8", "--no-search", "--set", "train.grad_accum=4"])
    out = capsys.readouterr().out
    assumes = next(line for line in out.splitlines() if line.startswith("assumes: "))
    for said in ("seq_len 4096", "micro-batch 1 sequence per data-parallel rank", "grad_accum 4",
                 "params fp32 (gathered in bf16)", "grads fp32 (reduced in fp32)", "AdamW moments 2 x fp32",
                 "compute bf16", "recompute=selective"):
        assert said in assumes, (said, assumes)
    main(["plan", "tiny-gpt", "--world", "4", "--no-search", "--set", "parallel.pp=2", "data.batch_size=8", "--json"])
    a = json.loads(capsys.readouterr().out)["assumptions"]
    assert (a["seq_len"], a["micro_batch"], a["pipeline_microbatches"]) == (128, 4, 2)


def test_plan_says_on_what_listed_layouts_tie(capsys):
    main(["plan", "tiny-moe", "--world", "4", "--json"])
    result = json.loads(capsys.readouterr().out)
    peaks = [round(f["peak_gib"], 2) for f in result["fitting_layouts"]]
    assert len(set(peaks)) < len(peaks)  # the case at hand: expert-parallel layouts of equal estimated memory
    assert result["ties"] and all("tie on estimated peak memory" in line for line in result["ties"])
    main(["plan", "tiny-moe", "--world", "4"])
    out = capsys.readouterr().out
    assert "order: least model and sequence parallelism" in out
    tie = next(line for line in out.splitlines() if line.startswith("tie: "))
    assert "pp1 tp1 dp4 ep2 none, pp1 tp1 dp4 ep4 none" in tie and "recompute=none" in tie
    assert "ordered by fewer expert-parallel ranks" in tie


def test_plan_labels_the_configs_own_layout_configured(capsys):
    main(["plan", "llama-8b", "--world", "8", "--gpu", "h100-80gb", "--json"])
    result = json.loads(capsys.readouterr().out)
    labelled = [(f["name"], f["recompute"]) for f in result["fitting_layouts"] if f["configured"]]
    assert labelled == [(result["layout"]["name"], result["layout"]["recompute"])] == [("pp1 tp1 dp8", "selective")]
    main(["plan", "llama-8b", "--world", "8", "--gpu", "h100-80gb"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.endswith("configured")]
    assert len(rows) == 1 and rows[0].split()[:4] == ["pp1", "tp1", "dp8", "selective"], rows
    main(["plan", "llama-8b", "--world", "8", "--gpu", "h100-80gb", "--set", "parallel.tp=2", "--json"])
    assert not any(f["configured"] for f in json.loads(capsys.readouterr().out)["fitting_layouts"])  # not listed


# (config, ranks, device): the world sizes each bundled MoE config's file and the README's MoE plan table show
DOCUMENTED = [("tiny-moe", 1, "cpu"), ("olmoe-1b-7b", 8, "h100-80gb"), ("olmoe-1b-7b", 64, "h100-80gb"),
              ("olmoe-1b-7b", 512, "h100-80gb"), ("qwen3-30b-a3b", 8, "h100-80gb"), ("qwen3-30b-a3b", 64, "h100-80gb"),
              ("qwen3-30b-a3b", 512, "h100-80gb"), ("mixtral-8x7b", 64, "h100-80gb"),
              ("mixtral-8x7b", 512, "h100-80gb"), ("gpt-oss-20b", 8, "h100-80gb"),
              ("gpt-oss-20b", 64, "h100-80gb"), ("gpt-oss-20b", 512, "h100-80gb"), ("gpt-oss-120b", 64, "h100-80gb"),
              ("gpt-oss-120b", 512, "h100-80gb")]


@pytest.mark.parametrize(("config", "world", "device"), DOCUMENTED)
def test_bundled_moe_configs_fit_at_their_documented_world_sizes(capsys, config, world, device):
    main(["plan", config, "--world", str(world), "--gpu", device, "--no-search", "--json"])
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert layout["fits"], f"{config} at {world} ranks: {layout['name']} needs {layout['peak_gib']:.1f} GiB"
    if config != "tiny-moe":  # a one-process CPU run; the others' files say where their layout fits
        said = [line for line in (CONFIGS / f"{config}.toml").read_text().splitlines() if line.startswith("# Fits")]
        assert said and str(world) in said[0]
