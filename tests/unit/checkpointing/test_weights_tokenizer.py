"""Weights folders carry their tokenizer (#24): tools use it by default and refuse another one, whatever its
size; HF exports hold a complete tokenizer that AutoTokenizer loads; files follow the umask; a folder whose
write was cut short is refused by every reader, never half-loaded."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest
import torch
import transformers
from helpers.convert import same_size_other_tokenizer

from meshformer.checkpointing.safetensors_io import read_model_source
from meshformer.checkpointing.weights import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    load_weights,
    open_weights,
    read_weights,
    saved_names,
    weights_tokenizer,
    write_weights,
)
from meshformer.cli import main
from meshformer.config import AttentionConfig, FfnConfig, ModelConfig
from meshformer.data import load_tokenizer, train_bpe
from meshformer.data.tokenizer import TokenizerError
from meshformer.errors import MeshformerError
from meshformer.model import Transformer

CFG = ModelConfig(vocab_size=4096, d_model=32, n_layers=2, max_seq_len=64, attention=AttentionConfig(n_heads=4),
                  ffn=FfnConfig(d_ff=64))
TEXT = "In the beginning God created the heaven and the earth."


def _one_line(argv: list[str], capsys) -> str:
    """The error line of a command that fails (SystemExit carries the line Python would print)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    code = info.value.code
    lines = (capsys.readouterr().err + (code if isinstance(code, str) else "")).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok") / "final"
    torch.manual_seed(0)
    write_weights(Transformer(CFG).state_dict(), CFG, folder, tokenizer=load_tokenizer("bundled:kjv-bpe-4k"))
    return folder


def test_weights_carry_their_tokenizer_and_refuse_another_of_the_same_size(weights, tmp_path, capsys):
    own = weights_tokenizer(weights)
    assert (weights / TOKENIZER_FILE).is_file() and own.sha256 == load_tokenizer("bundled:kjv-bpe-4k").sha256
    assert weights_tokenizer(weights, "bundled:kjv-bpe-4k").sha256 == own.sha256  # the same one, named otherwise
    other = same_size_other_tokenizer(tmp_path / "other.json")
    assert load_tokenizer(str(other)).vocab_size == 4096
    with pytest.raises(TokenizerError, match="is not the tokenizer the weights in .* were trained with"):
        weights_tokenizer(weights, str(other))
    line = _one_line(["generate", str(weights), "--prompt", "And God said", "--tokenizer", str(other)], capsys)
    assert "other.json" in line and own.fingerprint[:12] in line and load_tokenizer(str(other)).fingerprint[:12] in line
    # a tokenizer.json replaced beside the weights is caught by the fingerprint in the safetensors header
    copy = tmp_path / "copy"
    write_weights(read_weights(weights)[1], CFG, copy, tokenizer=load_tokenizer("bundled:kjv-bpe-4k"))
    (copy / TOKENIZER_FILE).write_text(other.read_text())
    with pytest.raises(TokenizerError, match="restore"):
        weights_tokenizer(copy)


def test_generate_decodes_with_the_tokenizer_saved_with_the_weights(tmp_path, capsys):
    """A model trained with its own (small) tokenizer: generate needs no --tokenizer, and a folder without
    one asks for it instead of decoding with a bundled tokenizer."""
    tokenizer = train_bpe([TEXT * 20, "Der Zug nach Berlin fährt um neun Uhr. " * 20], vocab_size=320)
    cfg = ModelConfig(vocab_size=320, d_model=32, n_layers=1, max_seq_len=64, attention=AttentionConfig(n_heads=4),
                      ffn=FfnConfig(d_ff=64))
    state = Transformer(cfg).state_dict()
    write_weights(state, cfg, tmp_path / "w", tokenizer=tokenizer)
    main(["generate", str(tmp_path / "w"), "--prompt", "Der Zug", "--max-new-tokens", "3"])
    assert capsys.readouterr().out.startswith("Der Zug")
    write_weights(state, cfg, tmp_path / "bare")
    with pytest.raises(TokenizerError, match="carries no tokenizer.json"):
        weights_tokenizer(tmp_path / "bare")


def test_hf_export_holds_a_tokenizer_that_auto_tokenizer_loads(weights, tmp_path):
    main(["convert", "export-hf", str(weights), str(tmp_path / "hf")])
    hf = tmp_path / "hf"
    ours = load_tokenizer("bundled:kjv-bpe-4k")
    theirs = transformers.AutoTokenizer.from_pretrained(str(hf))
    ids = theirs.encode(TEXT, add_special_tokens=False)
    assert ids == ours.encode(TEXT) and theirs.decode(ids) == TEXT
    assert (theirs.eos_token_id, theirs.bos_token_id, theirs.pad_token_id) == (ours.eos_id, ours.bos_id, ours.pad_id)
    generation = json.loads((hf / "generation_config.json").read_text())
    config = json.loads((hf / "config.json").read_text())
    for key, value in {"eos_token_id": ours.eos_id, "bos_token_id": ours.bos_id, "pad_token_id": ours.pad_id}.items():
        assert generation[key] == value and config[key] == value, key
    # and back: import-hf carries the tokenizer into the weights folder
    main(["convert", "import-hf", str(hf), str(tmp_path / "back")])
    assert weights_tokenizer(tmp_path / "back").fingerprint == ours.fingerprint


def test_weights_only_checkpoints_carry_the_tokenizer_into_their_conversions(weights, tmp_path):
    """`import-hf --checkpoint` and `to-checkpoint` write a checkpoint holding the source's tokenizer, as a run's
    checkpoints do, so `to-safetensors` of it passes the tokenizer on (README: import-hf keeps the HF folder's)."""
    own = load_tokenizer("bundled:kjv-bpe-4k").fingerprint
    main(["convert", "export-hf", str(weights), str(tmp_path / "hf")])
    main(["convert", "import-hf", str(tmp_path / "hf"), str(tmp_path / "from-hf"), "--checkpoint"])
    main(["convert", "to-checkpoint", str(weights), str(tmp_path / "from-weights")])
    for checkpoints in ("from-hf", "from-weights"):
        main(["convert", "to-safetensors", str(tmp_path / checkpoints), str(tmp_path / f"{checkpoints}-out")])
        assert weights_tokenizer(tmp_path / f"{checkpoints}-out").fingerprint == own, checkpoints


def test_export_hf_without_transformers_names_the_extra(weights, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` sees when not installed
    line = _one_line(["convert", "export-hf", str(weights), str(tmp_path / "hf")], capsys)
    assert "transformers" in line and "pip install 'meshformer[hf]'" in line
    assert not (tmp_path / "hf").exists()


def test_written_files_and_folders_follow_the_umask(weights, tmp_path):
    old = os.umask(0o022)
    try:
        write_weights(read_weights(weights)[1], CFG, tmp_path / "w", max_shard_size="100KB")
        main(["convert", "export-hf", str(weights), str(tmp_path / "hf")])
    finally:
        os.umask(old)
    for folder in (tmp_path / "w", tmp_path / "hf"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755, folder
        for path in folder.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


class _Killed(Exception):
    """Stands for a kill: nothing after it runs (write_weights cleans nothing up)."""


def _killed_after(state: dict[str, torch.Tensor], reads: int) -> dict[str, torch.Tensor]:
    class Dying(dict):
        count = 0

        def __getitem__(self, name):
            Dying.count += 1
            if Dying.count > reads:
                raise _Killed
            return super().__getitem__(name)

    return Dying(state)


@pytest.mark.parametrize("written", [0, 3, 7])
def test_a_weights_folder_cut_short_is_refused_by_every_reader(weights, tmp_path, written, capsys):
    """Tensors written up to a kill, into a fresh folder and over complete weights: no reader loads the folder
    (no model_config.json until the end), and each says so in one line."""
    state = read_weights(weights)[1]
    reads = len(saved_names(CFG)) + written  # a plain dict is read once for the layout, then once to write
    over = tmp_path / "over"
    write_weights(state, CFG, over, max_shard_size="100KB", tokenizer=load_tokenizer("bundled:kjv-bpe-4k"))
    for folder in (tmp_path / "fresh", over):
        with pytest.raises(_Killed):
            write_weights(_killed_after(state, reads), CFG, folder, max_shard_size="100KB")
        assert not (folder / CONFIG_FILE).exists() and not (folder / TOKENIZER_FILE).exists()
        for read in (open_weights, load_weights, read_model_source):
            with pytest.raises((FileNotFoundError, MeshformerError)):
                read(folder)
        assert "holds no model.safetensors" in _one_line(
            ["generate", str(folder), "--prompt", "x", "--tokenizer", "bundled:kjv-bpe-4k"], capsys)


def test_a_cut_after_the_files_leaves_the_complete_weights_or_nothing(weights, tmp_path, monkeypatch):
    """Killed while the finished files are renamed into place: the folder is refused; once model_config.json
    is there, it loads the same tensors as the original."""
    import meshformer.checkpointing.sharded_safetensors as files

    state = read_weights(weights)[1]
    renames = []
    real_rename = type(tmp_path).rename

    def rename(self, target):
        renames.append(target)
        if len(renames) == 2:
            raise _Killed
        return real_rename(self, target)

    monkeypatch.setattr(type(tmp_path), "rename", rename)
    with pytest.raises(_Killed):
        write_weights(state, CFG, tmp_path / "w", max_shard_size="100KB")
    monkeypatch.undo()
    assert renames[0].name.startswith("model-00001-of-")
    with pytest.raises(FileNotFoundError):
        open_weights(tmp_path / "w")
    write_weights(state, CFG, tmp_path / "w", max_shard_size="100KB")
    assert (tmp_path / "w" / files.INDEX_FILE).is_file()
    for name, tensor in read_weights(tmp_path / "w")[1].items():
        assert torch.equal(tensor, state[name]), name


def test_meshformer_load_gives_the_model_for_logits_and_generation_and_its_tokenizer(weights, tmp_path):
    import meshformer
    from meshformer.model.generate import greedy_decode

    model, tokenizer = meshformer.load(str(weights))
    reference = load_weights(weights).eval()
    assert not model.training and tokenizer.sha256 == load_tokenizer("bundled:kjv-bpe-4k").sha256
    ids = torch.tensor([tokenizer.encode_prompt(TEXT)])
    with torch.no_grad():
        logits = model(ids)
        assert logits.shape == (1, ids.shape[1], CFG.vocab_size) and torch.equal(logits, reference(ids))
    assert torch.equal(greedy_decode(model, ids, 4), greedy_decode(reference, ids, 4))
    with pytest.raises(TokenizerError, match="tokenizer"):
        meshformer.load(weights, tokenizer=str(same_size_other_tokenizer(tmp_path / "other.json")))
