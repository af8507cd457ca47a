"""The flat [model] keys of the release before the [model.*] tables (config/migrate.py): every old file, saved
config and override still loads, to the same model, with one log line per old key."""

from __future__ import annotations

import dataclasses
import json
import logging
import tomllib
import warnings

import pytest
import torch
from helpers.common import CONFIGS, ROOT

from meshformer.checkpointing.safetensors_io import checkpoint_model_config
from meshformer.checkpointing.weights import open_weights
from meshformer.config import ConfigError, given_keys, load_config
from meshformer.config.migrate import RENAMES, migrate_model_table, model_from_dict
from meshformer.model import Transformer
from meshformer.model.config import moe_pattern

FLAT = ROOT / "tests" / "fixtures" / "flat_configs_59caec9"
RUN = ROOT / "tests" / "fixtures" / "run_1ed6c24"
TINY = ("tiny-gpt", "tiny-moe", "tiny-t5", "tiny-bert")


@pytest.mark.parametrize("name", sorted(p.stem for p in FLAT.glob("*.toml")))
def test_a_flat_config_loads_to_the_model_of_its_rewritten_twin(name, caplog):
    with caplog.at_level(logging.WARNING, "meshformer.config"):
        old = load_config(FLAT / f"{name}.toml")
    new = load_config(CONFIGS / f"{name}.toml")
    assert old.model == new.model
    assert old.to_dict() == new.to_dict()
    # one line per old key, naming its new key
    flat = tomllib.loads((FLAT / f"{name}.toml").read_text())["model"]
    old_keys = [k for k in flat if k in RENAMES or k in ("full_attention_every", "moe_every", "moe_first_dense")]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(old_keys) > 0
    assert all(line.startswith("config: model.") and "(translated; update " in line for line in lines)
    if "n_heads" in flat:
        assert f"config: model.n_heads is now model.attention.n_heads (translated; update {FLAT / name}.toml to " \
               "silence this)" in lines
    with torch.device("meta"):
        shapes = [{k: tuple(v.shape) for k, v in Transformer(cfg.model).state_dict().items()} for cfg in (old, new)]
    assert shapes[0] == shapes[1]
    if name in TINY:  # the same initial weights for a seed
        a, b = (Transformer(cfg.model, init_seed=3).state_dict() for cfg in (old, new))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_bundled_configs_hold_no_flat_key():
    for path in CONFIGS.glob("*.toml"):
        model = tomllib.loads(path.read_text()).get("model", {})
        assert not [k for k in model if k in RENAMES and not isinstance(model[k], dict)], path


def test_window_patterns_become_layer_types(caplog):
    with caplog.at_level(logging.WARNING, "meshformer.config"):
        table = migrate_model_table({"n_layers": 6, "attention_window": 512, "full_attention_every": 6,
                                     "rope_local_theta": 1e4}, "gemma.toml")
    assert table == {"n_layers": 6, "attention": {"window": 512}, "rope": {"local_theta": 1e4},
                     "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    assert sorted(r.getMessage() for r in caplog.records) == [
        f"config: model.{old} is now model.{new} (translated; update gemma.toml to silence this)"
        for old, new in sorted([("attention_window", "attention.window"), ("full_attention_every", "layer_types"),
                                ("rope_local_theta", "rope.local_theta")])]
    assert migrate_model_table({"attention_window": 8}, report="none")["layer_types"] == ["sliding_attention"]


def test_moe_patterns_become_mlp_types():
    every = migrate_model_table({"n_layers": 4, "n_experts": 4, "moe_every": 2}, report="none")
    assert every["mlp_types"] == ["dense", "moe"]  # a pattern: no dense first blocks
    first = migrate_model_table({"n_layers": 6, "n_experts": 4, "moe_every": 2, "moe_first_dense": 2}, report="none")
    assert first["mlp_types"] == ["dense", "dense", "dense", "moe", "dense", "moe"]  # one per block
    assert moe_pattern(1, 0, 8) == []  # every block MoE: the default
    dense = migrate_model_table({"n_layers": 4, "moe_every": 2}, report="none")
    assert "mlp_types" not in dense  # no experts: the old keys meant nothing


def test_old_overrides_are_translated_onto_a_new_file(caplog):
    with caplog.at_level(logging.WARNING, "meshformer.config"):
        cfg = load_config(CONFIGS / "tiny-gpt.toml", ["model.n_heads=8", "model.attention_window=16",
                                                      "model.full_attention_every=2"])
    assert cfg.model.attention.n_heads == 8 and cfg.model.attention.window == 16
    assert cfg.model.layer_types == ["sliding_attention", "full_attention"]
    assert [cfg.model.window(i) for i in range(4)] == [16, None, 16, None]
    assert "config: model.n_heads is now model.attention.n_heads (translated; update the --set override to silence " \
           "this)" in [r.getMessage() for r in caplog.records]
    assert {"model.attention.n_heads", "model.layer_types"} <= given_keys(cfg)
    new = load_config(CONFIGS / "tiny-gpt.toml", ["model.attention.n_heads=8"])
    assert new.model.attention.n_heads == 8


def test_an_old_key_and_its_new_key_with_other_values_are_refused(tmp_path):
    path = tmp_path / "mixed.toml"
    path.write_text("[model]\nn_heads = 4\n\n[model.attention]\nn_heads = 8\n")
    with pytest.raises(ConfigError, match=r"model.n_heads=4 and model.attention.n_heads=8 disagree; keep only "
                                          r"model.attention.n_heads") as err:
        load_config(path)
    assert "\n" not in str(err.value)
    path.write_text("[model]\nn_heads = 8\n\n[model.attention]\nn_heads = 8\n")
    assert load_config(path).model.attention.n_heads == 8  # the same value: no conflict
    path.write_text('[model]\nn_layers = 2\nattention_window = 4\nfull_attention_every = 2\n'
                    'layer_types = ["sliding_attention"]\n')
    with pytest.raises(ConfigError, match="model.layer_types=.* disagrees with the old pattern keys"):
        load_config(path)


def test_saved_configs_of_the_flat_release_load(caplog):
    with caplog.at_level(logging.INFO, "meshformer.config"):
        weights_cfg, _ = open_weights(RUN / "final")
        step_cfg = checkpoint_model_config(RUN / "checkpoints" / "step-00000002")
    assert weights_cfg == step_cfg == load_config(RUN / "config.toml").model
    assert weights_cfg.attention.n_heads == 2 and weights_cfg.ffn.d_ff == 32
    saved = [r.getMessage() for r in caplog.records if "model_config.json" in r.getMessage()]
    assert len(saved) == 1 and "translated the flat [model] keys" in saved[0]  # one line for a saved config
    flat = json.loads((RUN / "final" / "model_config.json").read_text())
    assert model_from_dict(flat) == weights_cfg


@pytest.mark.parametrize("overrides,message", [
    (['model.layer_types=["retention"]'], "model.layer_types holds 'retention', not a kind meshformer builds"),
    (['model.layer_types=["full_attention", "full_attention", "full_attention", "full_attention", "full_attention"]'],
     "model.layer_types has 5 entries but the deepest stack has 4 blocks"),
    (['model.layer_types=["sliding_attention"]'], "sliding_attention blocks but model.attention.window is not set"),
    (["model.attention.window=8"], "model.layer_types has none"),
    (['model.mlp_types=["dense", "moe"]'], "model.mlp_types has \"moe\" blocks but model.moe.n_experts = 0"),
    (['model.mlp_types=["experts"]'], "model.mlp_types holds 'experts'"),
])
def test_bad_layer_and_mlp_types_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(CONFIGS / "tiny-gpt.toml", overrides)
    assert "\n" not in str(err.value)


def test_a_per_block_moe_list_follows_the_depth_an_override_sets(tmp_path):
    path = tmp_path / "deepseek.toml"
    path.write_text("[model]\nn_layers = 4\nn_experts = 4\nmoe_first_dense = 1\n")
    cfg = load_config(path, ["model.n_layers=6"])
    assert [cfg.model.is_moe(i) for i in range(6)] == [False] + [True] * 5  # as moe_first_dense = 1 meant


def test_an_old_window_beside_a_new_pattern_is_that_pattern_s_window(tmp_path):
    path = tmp_path / "half.toml"
    path.write_text('[model]\nn_layers = 2\nattention_window = 4\nlayer_types = ["sliding_attention", '
                    '"full_attention"]\n')
    cfg = load_config(path)
    assert [cfg.model.window(i) for i in range(2)] == [4, None]
    over = load_config(CONFIGS / "tiny-gpt.toml", ['model.layer_types=["full_attention", "sliding_attention"]',
                                                   "model.attention_window=8"])
    assert [over.model.window(i) for i in range(4)] == [None, 8, None, 8]


def test_a_key_renamed_inside_its_table_migrates_and_its_python_name_warns_once(tmp_path, caplog, monkeypatch):
    """model.moe.expert_bias_terms (the experts' projection biases; "expert bias" is the router's buffer) is
    model.moe.expert_linear_bias: in a file, an override, the flat key, and as a MoeConfig attribute or keyword."""
    from meshformer.model import config_compat
    from meshformer.model.config import MoeConfig

    path = tmp_path / "old.toml"
    old = (CONFIGS / "tiny-moe.toml").read_text()
    path.write_text(old.replace("[model.moe]", "[model.moe]\nexpert_bias_terms = true"))
    with caplog.at_level(logging.WARNING, "meshformer.config"):
        assert load_config(path).model.moe.expert_linear_bias
    assert any("model.moe.expert_bias_terms is now model.moe.expert_linear_bias" in r.getMessage()
               for r in caplog.records)
    assert load_config(CONFIGS / "tiny-moe.toml", ["model.moe.expert_bias_terms=true"]).model.moe.expert_linear_bias
    assert migrate_model_table({"expert_bias_terms": True}, report="none") == {"moe": {"expert_linear_bias": True}}
    with pytest.raises(ConfigError, match="model.moe.expert_bias_terms=True and model.moe.expert_linear_bias=False"):
        migrate_model_table({"moe": {"expert_bias_terms": True, "expert_linear_bias": False}})

    monkeypatch.setattr(config_compat, "_warned", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = MoeConfig(n_experts=4, expert_bias_terms=True)  # type: ignore[call-arg]
        assert cfg.expert_linear_bias and cfg.expert_bias_terms  # type: ignore[attr-defined]
        cfg.expert_bias_terms = False  # type: ignore[attr-defined]
    assert not cfg.expert_linear_bias and "expert_bias_terms" not in dataclasses.asdict(cfg)
    assert [w.category for w in seen] == [FutureWarning]
    assert "MoeConfig.expert_linear_bias" in str(seen[0].message)


@pytest.mark.parametrize("engine", ["builtin", "lm_eval"])
def test_the_removed_downstream_engine_key_still_loads_and_is_no_change(tmp_path, caplog, engine):
    """downstream.engine chose between a hand-written scorer and lm-eval's evaluator: lm-eval's is the only one, so a
    file, an override or a run folder's saved config.toml that sets it loads, with one line, and is no change."""
    from meshformer.train.run_record import RUN_CONFIG, config_changes

    cfg = load_config("tiny-gpt")
    text = cfg.to_toml().replace("[downstream]\n", f'[downstream]\nengine = "{engine}"\n')
    assert f'engine = "{engine}"' in text
    (tmp_path / "old.toml").write_text(text)
    with caplog.at_level(logging.INFO, "meshformer.config"):
        assert load_config(tmp_path / "old.toml").to_dict() == cfg.to_dict()
        assert load_config("tiny-gpt", [f'downstream.engine="{engine}"']).to_dict() == cfg.to_dict()
    assert sum("downstream.engine is no longer a key" in r.getMessage() for r in caplog.records) == 2
    (tmp_path / RUN_CONFIG).write_text(text)
    assert config_changes(tmp_path, cfg) == []
