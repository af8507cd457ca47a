"""Bundled configs usable everywhere (#24): `config list|show|copy`, `submit` by name, and the README's and the
documentation's commands, which name configs the way an installed wheel can resolve them."""

from __future__ import annotations

import re
import shlex

import pytest
from helpers.common import ROOT
from helpers.readme import doc_commands

from meshformer.cli import main
from meshformer.config import bundled_configs, load_config
from meshformer.parallel_dims import validate_parallel

# Commands whose first argument is a config (a TOML file or a bundled name).
CONFIG_COMMANDS = ("train", "params", "plan", "submit", "grad-report")


def test_documented_commands_name_configs_an_installed_wheel_can_find():
    names = bundled_configs()
    configs = []
    for words in doc_commands():
        if "meshformer.train" in words:
            configs.append(words[words.index("meshformer.train") + 1])
        elif len(words) > 2 and words[1] in CONFIG_COMMANDS and not words[2].startswith("-"):  # --init-from: none
            configs.append(words[2])
    assert len(configs) >= 10, configs
    assert [c for c in configs if c not in names] == [], "documented commands must name bundled configs"


def test_documented_train_on_prepared_data_fits_the_tokenizer_it_trained():
    """The data page's `data prepare --tokenizer train --vocab-size N --out X`, then `train ... data.shards=X`:
    the model must hold N tokens, or the train command stops at the tokenizer check."""
    commands = doc_commands()
    trained = {words[words.index("--out") + 1]: int(words[words.index("--vocab-size") + 1]) for words in commands
               if words[1:3] == ["data", "prepare"] and "--vocab-size" in words}
    runs = [(words, shards) for words in commands if words[1:2] == ["train"] for shards in trained
            if f"data.shards={shards}" in words]
    assert runs, "the docs train on a tokenizer they prepared"
    for words, shards in runs:
        cfg = load_config(words[2], words[words.index("--set") + 1:])
        assert cfg.model.vocab_size >= trained[shards], " ".join(words)


def test_config_show_prints_the_bundled_file(capsys):
    main(["config", "show", "tiny-gpt"])
    assert capsys.readouterr().out == bundled_configs()["tiny-gpt"].read_text()


def test_config_list_gives_each_config_its_computed_size_and_its_description(capsys):
    main(["config", "list"])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert list(rows) == list(bundled_configs())
    for name, path in bundled_configs().items():
        first = path.read_text().splitlines()[0]
        assert first.startswith("# description: ") and 20 <= len(first) <= 110, (name, first)  # one line, each
        assert rows[name].endswith("  " + first.removeprefix("# description: ")), rows[name]
    # sizes as `meshformer params` computes them: total, and the active count of a mixture of experts
    said = {name: " ".join(rows[name].split("  ")[1:-1]).strip() for name in rows}
    assert said["tiny-gpt"] == "1.33M" and said["llama-405b"] == "406B" and said["gpt3-175b"] == "175B"
    assert said["deepseek-v3"] == "671B (37.6B active)" and said["kimi-k2"] == "1.03T (32.9B active)"
    assert said["continue-hf"] == "the --init-from folder's"


def test_getting_started_lists_every_bundled_config():
    text = (ROOT / "docs" / "getting-started.md").read_text()
    listed = text[text.index("The bundled configs"):text.index("The [config reference]")]
    assert sorted(set(re.findall(r"`([a-z0-9.-]+)`", listed)) - {"meshformer"}) == sorted(bundled_configs())


def test_linear_attention_configs_say_tensor_and_context_parallel_split_those_blocks():
    hybrid = [name for name, path in bundled_configs().items()
              if "linear_attention" in load_config(path).model.layer_types]
    assert {"qwen3-next-80b-a3b", "qwen3.5-9b", "tiny-qwen3-next"} <= set(hybrid)
    for name in hybrid:
        text = " ".join(line.lstrip("# ") for line in bundled_configs()[name].read_text().splitlines()
                        if line.startswith("#"))
        assert not re.search(r"(without|cannot|no) (use )?tensor or context parallel", text), name
        layout = ["parallel.tp=2", "parallel.cp=2"] + (["parallel.ep=4"] if name == "tiny-qwen3-next" else [])
        validate_parallel(load_config(name, layout), 64, "cuda", on_this_host=False)  # no refusal


def test_config_copy_writes_a_file_to_edit_and_never_replaces_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["config", "copy", "tiny-gpt"])
    assert "meshformer train tiny-gpt.toml" in capsys.readouterr().out
    assert load_config("tiny-gpt.toml") == load_config("tiny-gpt")
    (tmp_path / "tiny-gpt.toml").write_text("# my edits\n")
    with pytest.raises(SystemExit) as info:
        main(["config", "copy", "tiny-gpt"])
    assert str(info.value.code).startswith("error: tiny-gpt.toml already exists") and "--overwrite" in str(
        info.value.code)
    assert (tmp_path / "tiny-gpt.toml").read_text() == "# my edits\n"
    (tmp_path / "mine").mkdir()
    main(["config", "copy", "tiny-bert", "mine"])
    assert (tmp_path / "mine" / "tiny-bert.toml").read_text() == bundled_configs()["tiny-bert"].read_text()
    with pytest.raises(SystemExit) as info:
        main(["config", "show", "tiny-gp"])
    assert "did you mean 'tiny-gpt'" in str(info.value.code)


def test_submit_with_a_bundled_name_names_it_not_a_local_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a folder without configs/: the script must not point at a path that is not there
    main(["submit", "tiny-gpt", "--dry-run", "--set", "checkpoint.interval=10"])
    script = capsys.readouterr().out
    train = shlex.split(script[script.index("-m meshformer.train"):].split("\\\n")[0])
    assert train[:3] == ["-m", "meshformer.train", "tiny-gpt"], train
    assert str(tmp_path / "tiny-gpt") not in script
    (tmp_path / "mine.toml").write_text(bundled_configs()["tiny-gpt"].read_text())
    main(["submit", "mine.toml", "--dry-run", "--set", "checkpoint.interval=10"])
    assert f"-m meshformer.train {tmp_path / 'mine.toml'}" in capsys.readouterr().out  # a file: its full path
