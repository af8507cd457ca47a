import dataclasses

import pytest
from helpers.common import CONFIGS

from meshformer.config import Config, ConfigError, bundled_configs, config_from_dict, load_config

SHIPPED = sorted(CONFIGS.glob("*.toml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_overrides_apply_with_types():
    cfg = load_config(CONFIGS / "tiny-gpt.toml", ["train.steps=7", "model.n_layers=2", "model.norm.kind=rmsnorm",
                                               "optim.betas=[0.8, 0.9]"])
    assert cfg.train.steps == 7 and cfg.model.n_layers == 2 and cfg.model.norm.kind == "rmsnorm"
    assert cfg.optim.betas == (0.8, 0.9)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(CONFIGS / "tiny-t5.toml", ["train.seed=5"])
    path = tmp_path / "resolved.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path) == cfg


def test_resolved_config_round_trips_any_string(tmp_path):
    """Non-BMP characters, quotes, backslashes and control characters survive the written config.toml."""
    cfg = load_config("tiny-gpt")
    cfg.logging.run_dir = 'runs/\U0001f600 é "quoted" back\\slash\ttab\u0007bell'
    cfg.data.corpus = "\U0001d4b3\U0001d4ae/日本語.txt"
    path = tmp_path / "resolved.toml"
    path.write_text(cfg.to_toml(), encoding="utf-8")
    assert load_config(path) == cfg


def test_bundled_configs_load_by_name():
    assert set(bundled_configs()) == {p.stem for p in SHIPPED}
    assert load_config("tiny-gpt") == load_config(CONFIGS / "tiny-gpt.toml")
    with pytest.raises(ConfigError, match="did you mean 'tiny-gpt'"):
        load_config("tiny-gtp")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.n_layer=2"], "did you mean 'model.n_layers'"),
        (["trian.steps=2"], "did you mean 'train'"),
        (["model.d_model=130"], "not divisible by model.attention.n_heads"),
        (["model.attention.n_kv_heads=3"], "n_kv_heads must divide n_heads"),
        (["model.attention.window=1000", 'model.layer_types=["sliding_attention"]'], "larger than data.seq_len"),
        (["train.steps=ten"], "train.steps must be int"),
        (["model.norm.kind=batchnorm"], "is not one of"),
        (["data.seq_len=4096"], "exceeds model.max_seq_len"),
        (["train.objective=mlm"], "does not fit model.family"),
        (["steps=3"], "unknown config key"),
        (["schedule.min_lr_ratio=-0.5"], "min_lr_ratio"),
        (["schedule.name=wsd", "schedule.decay_fraction=0.95"], "before warmup ends"),
        (["optim.betas=[1.5, 0.9]"], "optim.betas"),
        (["optim.grad_clip=-1"], "grad_clip"),
        (["train.z_loss=-1"], "z_loss"),
        (["train.eval_batches=0"], "eval_batches"),
        (["train.steps"], "section.key=value"),
        (["data.num_workers=-1"], "data.num_workers"),  # data keys are checked on load, not when data is built
        (["data.eval_fraction=1.0"], "data.eval_fraction"),
        (["checkpoint.max_shard_size=lots"], "checkpoint.max_shard_size: cannot read the size"),  # not after training
        (["model.family=decodr"], "did you mean 'decoder'\\? registered families"),
        (["model.cross_downsample=2"], "cross_downsample only applies"),
        (["model.family=encoder", "model.attention.document_mask=true"], "document_mask needs the causal objective"),
        (["optim.max_nonfinite_in_a_row=-1"], "max_nonfinite_in_a_row"),
    ],
)
def test_bad_config_names_key_and_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIGS / "tiny-gpt.toml", overrides)


def test_missing_file_is_clear():
    with pytest.raises(ConfigError, match="not found"):
        load_config(CONFIGS / "nope.toml")


def test_objective_follows_family():
    assert config_from_dict({"model": {"family": "encoder"}}).objective == "mlm"
    assert config_from_dict({"model": {"family": "encoder_decoder"}}).objective == "span"
    assert config_from_dict({}).objective == "causal"


def test_max_seq_len_error_names_the_longer_stream():
    with pytest.raises(ConfigError, match="data.target_len=200 exceeds"):
        load_config(CONFIGS / "tiny-t5.toml", ["data.target_len=200"])


def test_every_config_key_is_documented_and_the_reference_is_current():
    """Each key's meaning is its comment in the section's dataclass; docs/config-reference.md is generated from them
    (`meshformer config keys > docs/config-reference.md`) and the README points there."""
    from helpers.common import ROOT

    from meshformer.config.reference import config_reference, field_comments, undocumented_keys

    assert undocumented_keys() == []

    @dataclasses.dataclass
    class Example:
        plain: int = 1
        said: int = 2  # on its line
        # above it,
        # on two lines
        above: int = 3

    assert field_comments(Example) == {"plain": "", "said": "on its line", "above": "above it, on two lines"}
    assert (ROOT / "docs" / "config-reference.md").read_text() == config_reference() + "\n", \
        "regenerate it: meshformer config keys > docs/config-reference.md"
    assert "docs/config-reference.md" in (ROOT / "README.md").read_text()
