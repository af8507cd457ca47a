"""Every kind of folder `meshformer eval` reads, with no export step (meshformer/eval/model_folder.py): a run folder
(its final/, else its newest committed checkpoint), a checkpoints folder, a step folder, a weights folder and a
Hugging Face folder give the same model, logits bitwise equal, and the same tokenizer; anything else is one line."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers.convert import same_size_other_tokenizer
from helpers.hf_models import hf_model

from meshformer.checkpointing.checkpoint_errors import ConversionError


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from meshformer.checkpointing.hf import from_hf_model
    from meshformer.checkpointing.hf_folder import export_hf
    from meshformer.checkpointing.safetensors_io import write_weights_checkpoint
    from meshformer.checkpointing.weights import write_weights
    from meshformer.data import load_tokenizer

    root = tmp_path_factory.mktemp("folders")
    tokenizer = load_tokenizer("bundled:kjv-bpe-4k")
    model = from_hf_model(hf_model("llama")).eval()
    write_weights(model.state_dict(), model.cfg, root / "finished" / "final", tokenizer=tokenizer)
    write_weights_checkpoint(model.state_dict(), model.cfg, root / "running" / "checkpoints", tokenizer)
    export_hf(model.state_dict(), model.cfg, root / "hf", tokenizer=tokenizer)
    return root, model, tokenizer


KINDS = [("finished", "weights", "finished/final"), ("finished/final", "weights", "finished/final"),
         ("running", "checkpoint", "running/checkpoints/step-00000000"),
         ("running/checkpoints", "checkpoint", "running/checkpoints/step-00000000"),
         ("running/checkpoints/step-00000000", "checkpoint", "running/checkpoints/step-00000000"),
         ("hf", "hf", "hf")]


@pytest.mark.parametrize(("given", "kind", "read"), KINDS, ids=[k[0].replace("/", "-") for k in KINDS])
def test_every_folder_kind_gives_the_same_model_and_tokenizer(folders, given, kind, read):
    from meshformer.eval.model_folder import load_model_folder, resolve_folder

    root, reference, tokenizer = folders
    assert resolve_folder(root / given) == (kind, root / read)
    model, loaded_tokenizer = load_model_folder(root / given)
    ids = torch.randint(0, reference.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))
    assert not model.training
    assert loaded_tokenizer.fingerprint == tokenizer.fingerprint


def test_a_run_folder_prefers_its_final_weights(folders, tmp_path):
    from meshformer.eval.model_folder import resolve_folder

    root, _, _ = folders
    shutil.copytree(root / "running" / "checkpoints", tmp_path / "checkpoints")
    shutil.copytree(root / "finished" / "final", tmp_path / "final")
    assert resolve_folder(tmp_path) == ("weights", tmp_path / "final")


def test_the_tensors_of_a_checkpoint_fill_a_model_built_on_meta(folders):
    """What a layout's ranks read their shards from (`load_into`, tied output included where a model ties it)."""
    from meshformer.checkpointing.weights import load_into
    from meshformer.eval.model_folder import open_model_folder
    from meshformer.model import Transformer
    from meshformer.parallel.materialize import materialize

    root, reference, _ = folders
    opened = open_model_folder(root / "running")
    assert opened.kind == "checkpoint" and opened.cfg == reference.cfg
    with torch.device("meta"):
        model = Transformer(opened.cfg)
    materialize([model], torch.device("cpu"), init=False)
    load_into([model], opened.tensors)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_folder_of_no_kind_is_one_line(tmp_path):
    from meshformer.eval.model_folder import resolve_folder

    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ConversionError) as err:
        resolve_folder(tmp_path)
    assert "is neither a run folder" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConversionError, match="is not a folder"):
        resolve_folder(tmp_path / "missing")


@pytest.mark.parametrize("given", ["finished", "running", "hf"])
def test_meshformer_load_reads_every_folder_kind(folders, given, tmp_path):
    """The Python way in (`meshformer.load`) reads what `meshformer eval` reads, and refuses another tokenizer."""
    import meshformer

    root, reference, tokenizer = folders
    model, loaded_tokenizer = meshformer.load(root / given)
    ids = torch.randint(0, reference.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))
    assert loaded_tokenizer.fingerprint == tokenizer.fingerprint
    from meshformer.data.tokenizer import TokenizerError

    with pytest.raises(TokenizerError, match="is not the tokenizer"):
        meshformer.load(root / given, tokenizer=str(same_size_other_tokenizer(tmp_path / "other.json")))
