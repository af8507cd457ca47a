"""The `meshformer` command end to end (in-process): train, params, generate, attention-map, grad-report."""

import json
from types import SimpleNamespace

import pytest
from helpers.common import CONFIGS

from meshformer.cli import main

SMALL = ["model.d_model=32", "model.n_layers=1", "model.ffn.d_ff=64", "data.seq_len=32", "model.max_seq_len=64",
         "train.steps=3", "train.eval_interval=0", "train.sample_interval=0", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("run")
    main(["train", str(CONFIGS / "tiny-gpt.toml"), "--set", *SMALL, f"logging.run_dir={path}"])
    return path


def test_the_trainer_uses_the_tokenizer_preflight_loaded(tmp_path, monkeypatch):
    from meshformer.train import preflight as preflight_module
    from meshformer.train.__main__ import run
    from meshformer.train.trainer import Trainer

    checked, used = [], []
    real = preflight_module.preflight
    monkeypatch.setattr(preflight_module, "preflight", lambda cfg: checked.append(real(cfg)) or checked[-1])
    monkeypatch.setattr(Trainer, "fit", lambda self: used.append(self.tokenizer) or SimpleNamespace(stopped_by=None))
    run(str(CONFIGS / "tiny-gpt.toml"), [*SMALL, f"logging.run_dir={tmp_path}"])
    assert len(checked) == 1 and len(used) == 1 and used[0] is checked[0]


def test_params_json_reports_published_sizes(capsys):
    main(["params", str(CONFIGS / "transformer-big.toml"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert abs(report["total_params"] / 213e6 - 1) < 0.03
    assert report["non_embedding_params"] < report["total_params"]
    main(["params", str(CONFIGS / "gpt3-175b.toml"), "--json"])
    gpt3 = json.loads(capsys.readouterr().out)
    # 6N plus attention and the output head: Megatron's 72 l h^2 (1 + s/6h + V/12lh) = 1.076e12 at s = 2048
    assert gpt3["flops_per_token"] == pytest.approx(72 * 96 * 12288**2 * (1 + 2048 / (6 * 12288)
                                                                          + 50304 / (12 * 96 * 12288)), rel=1e-3)


def test_generate_is_identical_with_and_without_cache(run_dir, capsys):
    main(["generate", str(run_dir / "final"), "--prompt", "And God said", "--max-new-tokens", "12"])
    cached = capsys.readouterr().out
    main(["generate", str(run_dir / "final"), "--prompt", "And God said", "--max-new-tokens", "12", "--no-cache"])
    assert capsys.readouterr().out == cached
    assert cached.startswith("And God said")


def test_final_weights_carry_the_run_tokenizer(run_dir):
    """final/ holds the run's tokenizer and its fingerprint in the safetensors header (#24)."""
    from meshformer.checkpointing.weights import TOKENIZER_FINGERPRINT, open_weights, weights_tokenizer
    from meshformer.data import load_tokenizer

    used = load_tokenizer("bundled:kjv-bpe-4k")  # tiny-gpt's data.tokenizer
    assert (run_dir / "final" / "tokenizer.json").read_text() == used.json
    assert open_weights(run_dir / "final")[1].metadata[TOKENIZER_FINGERPRINT] == used.fingerprint
    assert weights_tokenizer(run_dir / "final").fingerprint == used.fingerprint



def test_checkpoints_carry_the_run_tokenizer_into_conversions(run_dir, tmp_path, capsys):
    """A checkpoint holds the run's tokenizer: to-safetensors and export-hf carry it on, and refuse another one
    (#24)."""
    from helpers.convert import same_size_other_tokenizer

    from meshformer.checkpointing.weights import weights_tokenizer
    from meshformer.data import load_tokenizer

    used = load_tokenizer("bundled:kjv-bpe-4k")
    main(["convert", "to-safetensors", str(run_dir / "checkpoints"), str(tmp_path / "export")])
    assert weights_tokenizer(tmp_path / "export").fingerprint == used.fingerprint
    other = same_size_other_tokenizer(tmp_path / "other.json")
    with pytest.raises(SystemExit) as info:
        main(["convert", "export-hf", str(run_dir / "checkpoints"), str(tmp_path / "hf"), "--tokenizer", str(other)])
    assert "is not the tokenizer the weights in" in str(info.value.code) and not (tmp_path / "hf").exists()


def test_attention_map_and_grad_report(run_dir, tmp_path, capsys):
    out = tmp_path / "attn.png"
    main(["attention-map", str(run_dir / "final"), "--text", "In the beginning", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    main(["grad-report", str(CONFIGS / "tiny-gpt.toml"), "--weights", str(run_dir / "final"), "--set", *SMALL])
    report = capsys.readouterr().out
    assert "tok_embeddings.weight" in report and "decoder_layers.0.ffn.up_proj.weight" in report


def test_bad_override_exits_with_the_fix():
    with pytest.raises(SystemExit, match="did you mean 'train.steps'"):
        main(["train", str(CONFIGS / "tiny-gpt.toml"), "--set", "train.step=3"])
