"""Bad model configs, Hugging Face config.json values and corpora too small to train on, as a table: each ends in
one line `error: <what> — <fix>`, a non-zero exit and no traceback, before any work is done (the house pattern of
test_bad_inputs.py, for the values a model is built from)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.hf_models import hf_folder
from helpers.one_line import assert_one_line, run_main

from meshformer.checkpointing.hf_folder import import_hf

pytest.importorskip("transformers")

# config.json edits of a tiny random transformers model: (folder name, architecture, keys replaced)
HF_EDITS = [
    ("olmo3-mamba", "olmo3", {"layer_types": ["mamba", "full_attention"]}),
    ("glm4-partial-2", "glm4_moe", {"partial_rotary_factor": 2.0}),
    ("mistral-partial-half", "mistral", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                              "partial_rotary_factor": 0.5}}),
    ("llama-factor-eight", "llama", {"rope_parameters": {"rope_type": "linear", "factor": "eight",
                                                         "rope_theta": 1e4}}),
    ("llama-scaling-eight", "llama", {"rope_scaling": {"rope_type": "linear", "factor": "eight"}}),
    ("llama-float7", "llama", {"torch_dtype": "float7"}),
    ("llama-theta-negative", "llama", {"rope_theta": -1.0}),
    ("qwen3-next-experts-text", "qwen3_next", {"num_experts": "8"}),
    ("llama-wide", "llama", {"hidden_size": 2 ** 20}),
]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad_model_inputs")
    bases: dict[str, Path] = {}
    for name, arch, values in HF_EDITS:
        if arch not in bases:
            bases[arch] = hf_folder(arch, root / f"base-{arch}")[1]
        folder = shutil.copytree(bases[arch], root / name)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **values}))
    (root / "small.jsonl").write_text('{"text": "In the beginning"}\n')
    (root / "target").mkdir()
    (root / "outlink").symlink_to(root / "target")
    return root


def _train(config: str, *overrides: str) -> list[str]:
    return ["train", config, "--set", "logging.run_dir={tmp}/runs/t", "data.cache_dir={tmp}/cache", *overrides]


def _import(folder: str) -> list[str]:
    return ["convert", "import-hf", f"{{tmp}}/{folder}", f"{{tmp}}/out-{folder}"]


CASES = [
    # multi-token prediction: module k predicts the token k + 1 ahead (labels shifted by k)
    ("mtp-depth-negative", _train("tiny-deepseek", "model.mtp.depth=-1"),
     ["model.mtp.depth=-1 is negative", "use 0 (no multi-token prediction)"]),
    ("mtp-depth-past-the-sequence", _train("tiny-deepseek", "model.mtp.depth=1000", "data.seq_len=32"),
     ["model.mtp.depth=1000", "with data.seq_len=32", "use model.mtp.depth < data.seq_len (at most 31"]),
    ("plan-mtp-depth-huge", ["plan", "tiny-deepseek", "--world", "1", "--set", "model.mtp.depth=1000000"],
     ["model.mtp.depth=1000000", "model.mtp.depth < data.seq_len"]),
    ("plan-mtp-modules-count-as-layers", ["plan", "deepseek-v3", "--world", "8", "--set", "model.mtp.depth=2000"],
     ["the model has 2061 layers", "at most 1024", "model.mtp.depth"]),
    ("mtp-encoder-family", _train("tiny-bert", "model.mtp.depth=1"),
     ["multi-token prediction follows a decoder-only stack", "model.family='encoder'", "model.mtp.depth=0"]),
    ("mtp-loss-weight-negative", _train("tiny-deepseek", "model.mtp.loss_weight=-0.5"),
     ["model.mtp.loss_weight=-0.5 is negative", "the default 0.3"]),
    # multi-head latent attention: options it never computes, widths beyond the residual stream
    ("mla-output-gate", _train("tiny-deepseek", "model.attention.output_gate=true"),
     ["model.attention.output_gate is set, but mla blocks do not use it", "drop model.attention.output_gate"]),
    ("mla-qkv-bias", _train("tiny-deepseek", "model.attention.qkv_bias=true"),
     ["model.attention.qkv_bias is set, but mla blocks do not use it", "model.bias"]),
    ("mla-partial-rope", _train("tiny-deepseek", "model.rope.partial_factor=0.5"),
     ["model.rope.partial_factor=0.5 is set, but mla blocks rotate", "model.mla.qk_rope_head_dim"]),
    ("mla-q-lora-rank", _train("tiny-deepseek", "model.d_model=32", "model.mla.q_lora_rank=100000"),
     ["model.mla.q_lora_rank=100000 is wider than model.d_model=32", "<= d_model"]),
    ("mla-head-width", _train("tiny-deepseek", "model.mla.v_head_dim=4096"),
     ["model.mla.v_head_dim=4096 is wider than model.d_model=128", "per-head width <= d_model"]),
    ("attention-head-dim-wide", _train("tiny-gpt", "model.attention.head_dim=100000"),
     ["model.attention.head_dim=100000 is wider than model.d_model=128", "head_dim <= d_model"]),
    ("linear-attention-head-wide", _train("tiny-qwen3-next", "model.linear_attention.key_head_dim=100000"),
     ["model.linear_attention.key_head_dim=100000 is wider than model.d_model", "head widths <= d_model"]),
    # Hugging Face config.json values, read the way transformers reads them
    ("hf-layer-types-unknown", _import("olmo3-mamba"),
     ["layer_types[0]='mamba' (transformers reads it as 'linear_attention')", "olmo3",
      "'full_attention' / 'sliding_attention'"]),
    ("hf-partial-rotary-above-one", _import("glm4-partial-2"),
     ["partial_rotary_factor=2.0 is not a fraction in (0, 1]", "fix that value in config.json"]),
    ("hf-partial-rotary-default-rope", _import("mistral-partial-half"),
     ["rope_parameters.partial_rotary_factor=0.5 changes default rotary frequencies", "cannot express"]),
    ("hf-rope-factor-text", _import("llama-factor-eight"),
     ["rope_parameters.factor='eight' is not a number >= 1", "fix that value in config.json"]),
    ("hf-rope-scaling-factor-text", _import("llama-scaling-eight"),
     ["rope_scaling.factor='eight' is not a number >= 1", "fix that value in config.json"]),
    ("hf-torch-dtype", _import("llama-float7"),
     ["torch_dtype='float7' is not a torch floating-point dtype", "fix that value in config.json"]),
    ("hf-rope-theta-negative", _import("llama-theta-negative"),
     ["rope_theta=-1.0 is not a positive number", "fix that value in config.json"]),
    ("hf-num-experts-text", _import("qwen3-next-experts-text"),
     ["num_experts='8' is not a whole number >= 0", "fix that value in config.json"]),
    ("init-from-config-wider-than-tensors", ["train", "--init-from", "{tmp}/llama-wide", "--set",
                                             "logging.run_dir={tmp}/runs/wide", "data.seq_len=32"],
     ["cannot import", "llama-wide", "the shape (4096, 32), expected (4096, 1048576)"]),
    # corpora and output folders
    ("prepare-corpus-too-small", ["data", "prepare", "{tmp}/small.jsonl", "--out", "{tmp}/p-small", "--tokenizer",
                                  "bundled:kjv-bpe-4k"],
     ["the train split gets no 129-token record", "document(s)", "needs at least 258 tokens", "--seq-len"]),
    ("prepare-out-is-a-link", ["data", "prepare", "{tmp}/small.jsonl", "--out", "{tmp}/outlink", "--tokenizer",
                               "bundled:kjv-bpe-4k"],
     ["outlink is a symbolic link", "never renames or removes a link"]),
]


@pytest.mark.parametrize("argv, words", [pytest.param(argv, words, id=name) for name, argv, words in CASES])
def test_bad_model_input_is_one_clear_line(argv, words, tmp, capsys, one_thread):
    assert_one_line(run_main([arg.format(tmp=tmp) for arg in argv], capsys), words)
    assert (tmp / "outlink").is_symlink() and not (tmp / "outlink.replaced").exists()  # the user's link, untouched
    assert not (tmp / "p-small").exists() and not (tmp / "p-small.work").exists()  # nothing half-written
    assert not (tmp / "runs").exists() or not any((tmp / "runs").rglob("*.safetensors"))


def test_a_rope_value_given_twice_is_the_one_transformers_uses_and_a_note_says_so(tmp, capsys):
    """transformers 5 keeps rope_parameters' own partial_rotary_factor over a top-level one: so does the import."""
    folder = shutil.copytree(tmp / "base-glm4_moe", tmp / "glm4-partial-twice")
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    (folder / "config.json").write_text(json.dumps({**config, "partial_rotary_factor": 0.25}))
    cfg, _ = import_hf(folder)
    assert cfg.rope.partial_factor == 0.5
    assert capsys.readouterr().err.count("note: config.json gives partial_rotary_factor=0.25 at its top level and "
                                         "0.5 in rope_parameters; transformers uses the one in rope_parameters") == 1
