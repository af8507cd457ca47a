"""One typed config tree, loaded from TOML with dotted command-line overrides and validated before any work.

    cfg = load_config("configs/tiny-gpt.toml", ["train.steps=200", "model.n_layers=4"])
    cfg = load_config("tiny-gpt")  # a bundled config by name (shipped inside the package)

Every section is a dataclass (`sections.py`; `[model]` is meshformer/model/config.py); `load.py` reads TOML and
overrides, `parse.py` types the values, `validate.py` checks the whole tree (family-dependent checks ask the
family's spec), `write.py` writes it back. Unknown keys, wrong types and inconsistent values raise a
`ConfigError` that names the key and the fix.
"""

from meshformer.config.load import bundled_configs, config_from_dict, given_keys, load_config, resolve_config_path
from meshformer.config.parse import build_section, parse_size
from meshformer.config.sections import (
    CheckpointConfig,
    Config,
    DataConfig,
    DataSourceConfig,
    FaultToleranceConfig,
    LoggingConfig,
    OptimConfig,
    ParallelConfig,
    ProfileConfig,
    Recompute,
    ScheduleConfig,
    TrainConfig,
)
from meshformer.config.validate import validate, validate_model
from meshformer.config.write import dump_toml
from meshformer.errors import ConfigError
from meshformer.model.config import (
    Activation,
    AttentionConfig,
    FfnConfig,
    InitConfig,
    MlaConfig,
    ModelConfig,
    MoeConfig,
    MtpConfig,
    NormConfig,
    RopeConfig,
)

__all__ = [
    "Activation",
    "AttentionConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DataSourceConfig",
    "FaultToleranceConfig",
    "FfnConfig",
    "InitConfig",
    "LoggingConfig",
    "MlaConfig",
    "ModelConfig",
    "MoeConfig",
    "MtpConfig",
    "NormConfig",
    "OptimConfig",
    "ParallelConfig",
    "ProfileConfig",
    "Recompute",
    "RopeConfig",
    "ScheduleConfig",
    "TrainConfig",
    "build_section",
    "bundled_configs",
    "config_from_dict",
    "dump_toml",
    "given_keys",
    "load_config",
    "parse_size",
    "resolve_config_path",
    "validate",
    "validate_model",
]
