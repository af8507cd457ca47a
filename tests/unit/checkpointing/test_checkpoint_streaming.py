"""Streamed weights: sharded safetensors folders (HF layout) written and read tensor by tensor, Hugging Face
`from_pretrained` on a sharded export, and conversions whose peak memory stays well under the model's size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import assert_bitwise

from meshformer.checkpointing.hf import config_from_hf
from meshformer.checkpointing.sharded_safetensors import INDEX_FILE, SINGLE_FILE, parse_size
from meshformer.checkpointing.weights import load_weights, read_weights, write_weights
from meshformer.cli import main
from meshformer.model import Transformer

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[3]


def _model(arch: str, layers: int = 3, width: int = 32) -> Transformer:
    if arch == "gpt2":
        hf_config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=width, n_layer=layers, n_head=4)
    else:
        hf_config = transformers.LlamaConfig(vocab_size=96, hidden_size=width, intermediate_size=2 * width,
                                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Transformer(config_from_hf(hf_config)).eval()


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.safetensors"))


def test_size_parsing():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(123) == 123
    with pytest.raises(ValueError, match="5GB"):
        parse_size("five gigs")


def test_sharded_weights_folder_round_trip(tmp_path):
    model = _model("llama")
    index = write_weights(model.state_dict(), model.cfg, tmp_path / "w", max_shard_size="20KB")
    assert index.name == INDEX_FILE
    files = _files(tmp_path / "w")
    assert len(files) > 2 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    weight_map = json.loads(index.read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == files
    # no file holds more than the limit, except a single tensor larger than it
    sizes = {f: (tmp_path / "w" / f).stat().st_size for f in files}
    assert max(sizes.values()) < 20_000 + 8 * 1024
    assert_bitwise(load_weights(tmp_path / "w").state_dict(), model.state_dict())
    # a rewrite with one file replaces the shards instead of mixing layouts
    write_weights(model.state_dict(), model.cfg, tmp_path / "w")
    assert _files(tmp_path / "w") == [SINGLE_FILE] and not (tmp_path / "w" / INDEX_FILE).exists()
    # weights-only checkpoint and back, from the sharded folder, streamed
    write_weights(model.state_dict(), model.cfg, tmp_path / "w", max_shard_size="20KB")
    main(["convert", "to-checkpoint", str(tmp_path / "w"), str(tmp_path / "ck")])
    main(["convert", "to-safetensors", str(tmp_path / "ck"), str(tmp_path / "back"), "--max-shard-size", "30KB"])
    assert (tmp_path / "back" / INDEX_FILE).is_file()
    assert_bitwise(read_weights(tmp_path / "back")[1], read_weights(tmp_path / "w")[1])


def test_bad_shard_size_is_one_clear_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["convert", "to-safetensors", str(tmp_path), str(tmp_path / "o"), "--max-shard-size", "lots"])
    assert "cannot read the size 'lots'" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_sharded_hf_export_loads_with_from_pretrained(arch, tmp_path):
    model = _model(arch)
    write_weights(model.state_dict(), model.cfg, tmp_path / "ours")
    main(["convert", "export-hf", str(tmp_path / "ours"), str(tmp_path / "hf"), "--max-shard-size", "20KB"])
    assert (tmp_path / "hf" / INDEX_FILE).is_file() and len(_files(tmp_path / "hf")) > 2
    cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}[arch]
    hf_model = cls.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf_model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    # and back from the sharded HF folder into a sharded weights folder, bitwise
    main(["convert", "import-hf", str(tmp_path / "hf"), str(tmp_path / "back"), "--max-shard-size", "20KB"])
    assert_bitwise(read_weights(tmp_path / "back")[1], read_weights(tmp_path / "ours")[1])


# VmHWM is this process's own high-water mark (ru_maxrss would carry the parent's over fork + exec).
_PEAK = """
import re, sys
from meshformer.cli import main
main(sys.argv[1:])
status = open("/proc/self/status").read()
print("PEAK", int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) * 1024)
"""


def _peak_rss(args: list[str]) -> int:
    out = subprocess.run([sys.executable, "-c", _PEAK, *args], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, check=True)
    return int(out.stdout.split("PEAK")[-1])


@pytest.mark.slow  # every conversion of a 100M model, ~1.5 min
def test_conversions_never_hold_the_whole_model(tmp_path):
    """Peak RSS of import-hf, to-safetensors and import-megatron on a 60 MiB model, less the same
    on a tiny one, stays well under the model (a full state dict would be 1-2x): one tensor (1 MiB; for Megatron
    one layer of a stacked tensor) and one output file (2 MB) at a time."""
    from meshformer.checkpointing.hf_folder import export_hf

    peaks = {}
    for size, (layers, width) in {"tiny": (1, 32), "big": (20, 256)}.items():
        model = _model("gpt2", layers, width)
        hf = tmp_path / size / "hf"
        export_hf(model.state_dict(), model.cfg, hf, max_shard_size="4MB")
        write_weights(model.state_dict(), model.cfg, tmp_path / size / "ours", max_shard_size="4MB")
        main(["convert", "import-hf", str(hf), str(tmp_path / size / "w"), "--checkpoint"])
        main(["convert", "export-megatron", str(tmp_path / size / "ours"), str(tmp_path / size / "mcore")])
        peaks[size] = {
            "import": _peak_rss(["convert", "import-hf", str(hf), str(tmp_path / size / "w2"),
                                 "--max-shard-size", "2MB"]),
            "to_safetensors": _peak_rss(["convert", "to-safetensors", str(tmp_path / size / "w"),
                                         str(tmp_path / size / "out"), "--max-shard-size", "2MB"]),
            "import_megatron": _peak_rss(["convert", "import-megatron", str(tmp_path / size / "mcore"),
                                          str(tmp_path / size / "w3"), "--max-shard-size", "2MB"]),
        }
        model_bytes = sum(p.numel() * 4 for p in model.parameters())
        del model
    assert model_bytes > 55 * 2**20
    print({k: {kind: round((v - peaks["tiny"][kind]) / model_bytes, 3) for kind, v in p.items()}
           for k, p in peaks.items()})
    assert_bitwise(read_weights(tmp_path / "big" / "w3")[1], read_weights(tmp_path / "big" / "ours")[1])
    for kind in peaks["big"]:
        assert peaks["big"][kind] - peaks["tiny"][kind] < 0.4 * model_bytes, (kind, peaks, model_bytes)
