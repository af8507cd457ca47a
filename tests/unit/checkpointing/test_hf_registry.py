"""One folder per Hugging Face architecture (meshformer/models/<model_type>/): the registry finds every folder
without a list to edit, each folder registers the adapter of its own name, and the generic conversion code names no
architecture."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.common import ROOT

import meshformer.models
from meshformer.checkpointing import hf_adapter
from meshformer.checkpointing.formats import hf_archs

GENERIC = ["checkpointing/hf.py", "checkpointing/hf_adapter.py", "checkpointing/hf_folder.py",
           "checkpointing/init_from.py", "checkpointing/cli.py", "checkpointing/mapping.py", "checkpointing/formats.py"]


def test_every_folder_registers_the_adapter_of_its_name():
    folders = sorted(p.parent.name for p in (ROOT / "meshformer" / "models").glob("*/__init__.py"))
    assert list(hf_archs()) == folders and list(hf_adapter.adapters()) == folders
    assert all(adapter.model_type == name for name, adapter in hf_adapter.adapters().items())
    assert {"llama", "olmo2", "olmo3", "gemma3_text", "t5"} <= set(folders)


@pytest.mark.parametrize("path", GENERIC)
def test_the_generic_conversion_code_names_no_architecture(path):
    source = (ROOT / "meshformer" / path).read_text()
    named = [arch for arch in hf_adapter.adapters() if re.search(rf"[\"']{arch}[\"']", source)]
    assert named == [], f"{path} names {named}: that belongs in meshformer/models/<model_type>/"


def _package(root: Path, name: str, registers: str) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(
        "import dataclasses\n"
        "from meshformer.checkpointing.hf_adapter import register\n"
        "from meshformer.models.llama.hf import ADAPTER\n"
        f"register(dataclasses.replace(ADAPTER, model_type={registers!r}, model_class='ToyForCausalLM'))\n")


@pytest.fixture
def fresh_registry(monkeypatch, tmp_path):
    """meshformer.models with tmp_path as a second folder, and a registry that has not looked there yet (holding
    the shipped adapters, whose packages are imported once)."""
    shipped = hf_adapter.adapters()
    search = meshformer.models.__path__
    search.append(str(tmp_path))  # the package's own search list: pkgutil and find_spec both read it
    monkeypatch.setattr(hf_adapter, "_REGISTRY", dict(shipped))
    monkeypatch.setattr(hf_adapter, "_discovered", False)
    yield tmp_path
    search.remove(str(tmp_path))


def test_a_new_folder_is_found_with_no_list_to_edit(fresh_registry):
    _package(fresh_registry, "toy_arch", "toy_arch")
    assert "toy_arch" in hf_archs()
    assert hf_adapter.get_adapter("toy_arch").model_class == "ToyForCausalLM"
    assert "llama" in hf_adapter.adapters()  # the shipped folders are found as before


def test_a_folder_registering_another_name_is_refused(fresh_registry):
    _package(fresh_registry, "toy_misnamed", "toy_other")
    with pytest.raises(RuntimeError, match=r"\['toy_misnamed'\] register no adapter of that model_type"):
        hf_adapter.adapters()
