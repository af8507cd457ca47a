"""A Hugging Face folder holding a NaN or inf tensor is refused the same way by `convert import-hf` and by
`checkpoint.init_from`, naming the tensor, for every registered architecture (a new one cannot miss the check: it
sits in the shared read path)."""

from __future__ import annotations

import pytest
from helpers.hf_models import ARCHS, arch_for, hf_folder
from safetensors.torch import load_file, save_file

from meshformer.checkpointing import ConversionError
from meshformer.checkpointing.hf_adapter import adapters
from meshformer.checkpointing.init_from import load_init_weights, resolve_init_from
from meshformer.cli import main
from meshformer.config import CheckpointConfig, Config, DataConfig
from meshformer.model import Transformer

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def _poisoned(names: list[str], model_type: str) -> str:
    """The tensor to poison: gpt-oss's attention sinks; else an expert tensor (stacked or split on import) where
    the architecture has one, else the last one (a plain rename, read by slices under init_from)."""
    if model_type == "gpt_oss":
        return next(name for name in names if name.endswith("sinks"))
    return sorted(name for name in names if "experts" in name)[-1:][0] if any("experts" in n for n in names) \
        else sorted(names)[-1]


def test_every_registered_architecture_has_a_tiny_model():
    assert all(arch_for(model_type) in ARCHS for model_type in adapters())


@pytest.mark.parametrize("model_type", list(adapters()))
def test_a_nan_tensor_is_refused_by_import_and_init_from_alike(model_type, tmp_path, capsys):
    _, folder = hf_folder(arch_for(model_type), tmp_path / "hf")
    tensors = load_file(folder / "model.safetensors")
    name = _poisoned(list(tensors), model_type)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[tensors[name].numel() // 2] = float("inf" if "sinks" in name else "nan")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    with pytest.raises(SystemExit) as info:
        main(["convert", "import-hf", str(folder), str(tmp_path / "out")])
    line = str(info.value.code)
    assert line.startswith(f"error: the tensor {name!r} of {folder} (meshformer's ") and "\n" not in line, line
    assert "holds NaN or inf values" in line and " — restore or re-download" in line, line
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.*"))  # nothing left behind

    cfg = resolve_init_from(Config(data=DataConfig(seq_len=32), checkpoint=CheckpointConfig(init_from=f"hf:{folder}")))
    with pytest.raises(ConversionError) as refused:
        load_init_weights([Transformer(cfg.model)], cfg)
    assert refused.value.one_line() == f"checkpoint.init_from: {line.removeprefix('error: ')}"
