"""The config.json that `convert export-hf` writes is complete for serving tools: the model class, the weights' dtype,
and (for weights that came from a Hugging Face folder, by import-hf or checkpoint.init_from) the source folder's
special-token ids and the keys meshformer does not model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.hf_models import hf_folder

from meshformer.checkpointing.init_from import SOURCE_FILE, record_source, source_config
from meshformer.checkpointing.weights import write_weights
from meshformer.cli import main
from meshformer.config import AttentionConfig, FfnConfig, ModelConfig, NormConfig, load_config
from meshformer.model import Transformer

transformers = pytest.importorskip("transformers")


def _source_folder(tmp_path: Path) -> Path:
    """A random Llama folder whose config.json holds what a published one may: a list of EOS ids, a key no
    transformers class knows, serving settings (use_cache, the torch_dtype name of transformers 4)."""
    _, folder = hf_folder("llama", tmp_path / "hf")
    raw = json.loads((folder / "config.json").read_text())
    raw.update(eos_token_id=[2, 5], bos_token_id=1, pad_token_id=0, custom_serving_key={"kept": True},
               use_cache=False)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_export_names_the_model_class_and_dtype(tmp_path):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, position="rope", bias=False, tie_embeddings=False,
                      max_seq_len=16, attention=AttentionConfig(n_heads=4), ffn=FfnConfig(d_ff=64, activation="swiglu"),
                      norm=NormConfig(kind="rmsnorm"))
    write_weights(Transformer(cfg).to(torch.bfloat16).state_dict(), cfg, tmp_path / "ours")
    main(["convert", "export-hf", str(tmp_path / "ours"), str(tmp_path / "out")])
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"]
    assert written["torch_dtype"] == written["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert type(model) is transformers.LlamaForCausalLM and model.dtype == torch.bfloat16


def test_import_then_export_keeps_the_source_folders_keys(tmp_path):
    folder = _source_folder(tmp_path)
    main(["convert", "import-hf", str(folder), str(tmp_path / "ours")])
    assert source_config(tmp_path / "ours") == json.loads((folder / "config.json").read_text())
    main(["convert", "export-hf", str(tmp_path / "ours"), str(tmp_path / "out")])
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (1, [2, 5], 0)
    assert written["custom_serving_key"] == {"kept": True} and written["use_cache"] is False
    assert written["architectures"] == ["LlamaForCausalLM"] and written["torch_dtype"] == "float32"
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 5]
    config = transformers.AutoConfig.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert config.eos_token_id == [2, 5]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    original = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    ids = torch.randint(0, 4096, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=0, atol=0)


def test_a_source_value_that_changes_the_function_is_the_exports_own(tmp_path):
    """The exported model is the one trained: a source key meshformer models keeps the trained value."""
    folder = _source_folder(tmp_path)
    main(["convert", "import-hf", str(folder), str(tmp_path / "ours")])
    note = json.loads((tmp_path / "ours" / SOURCE_FILE).read_text())
    # not what the weights folder holds, and a value transformers refuses
    note["config"].update(rms_norm_eps=0.5, tie_word_embeddings=True, vocab_size="many")
    (tmp_path / "ours" / SOURCE_FILE).write_text(json.dumps(note))
    main(["convert", "export-hf", str(tmp_path / "ours"), str(tmp_path / "out")])
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["rms_norm_eps"], written["tie_word_embeddings"], written["vocab_size"]) == (1e-6, False, 4096)
    assert written["eos_token_id"] == [2, 5]


def test_another_architecture_keeps_only_the_special_token_ids(tmp_path):
    """A Mistral folder without a window exported as Llama keeps the folder's special-token ids, and none of the
    folder's other keys (they are Mistral's, not Llama's)."""
    _, folder = hf_folder("mistral", tmp_path / "hf")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "eos_token_id": [2, 5], "custom_serving_key": 1}))
    main(["convert", "import-hf", str(folder), str(tmp_path / "ours")])
    main(["convert", "export-hf", str(tmp_path / "ours"), str(tmp_path / "out"), "--arch", "llama"])
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"] and written["eos_token_id"] == [2, 5]
    assert "custom_serving_key" not in written and "sliding_window" not in written


def test_a_run_from_init_from_notes_the_folders_config(tmp_path):
    folder = _source_folder(tmp_path)
    cfg = load_config(None, [f'checkpoint.init_from="hf:{folder}"'])
    record_source(tmp_path, cfg, "llama")
    assert source_config(tmp_path) == json.loads((folder / "config.json").read_text())


def test_bundled_tiny_moe_exports_as_mixtral(tmp_path):
    """The bundled tiny MoE (random init) exports as MixtralForCausalLM, which computes its logits."""
    cfg = load_config("tiny-moe").model
    torch.manual_seed(0)
    ours = Transformer(cfg).eval()
    with torch.no_grad():  # every router and norm away from its init, so a swapped tensor would show
        for param in ours.parameters():
            param.add_(0.1 * torch.randn_like(param))
    write_weights(ours.state_dict(), cfg, tmp_path / "ours")
    main(["convert", "export-hf", str(tmp_path / "ours"), str(tmp_path / "out")])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    ids = torch.randint(0, cfg.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 16:] = 0  # right padding
    with torch.no_grad():
        expected, got = theirs(input_ids=ids, attention_mask=mask).logits, ours(ids, mask.bool())
    real = mask.bool()
    torch.testing.assert_close(expected[real], got[real], rtol=0, atol=1e-4)
    assert expected.std() > 0.1
