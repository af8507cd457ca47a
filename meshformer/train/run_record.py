"""A run folder is a record: its config.toml describes the weights beside it.

A re-run with another config either continues the run (more steps to train: the earlier config is kept as
configs/config-step<N>.toml, the config that trained the run up to step N) or is refused before it rewrites
anything. `--new-run` starts a fresh run in a new folder beside the old one instead.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshformer.checkpointing.directory import TRAINER_STATE
from meshformer.config import Config, ConfigError, build_section
from meshformer.config.migrate import flatten, migrate_tree
from meshformer.config.write import toml_value
from meshformer.errors import UsageError

RUN_CONFIG = "config.toml"
CONFIG_HISTORY = "configs"
NEW_RUN_HINT = "pass --new-run (or set logging.run_dir to a new folder) to start a fresh run"


def history_name(step: int) -> str:
    """The config that trained the run up to `step`."""
    return f"config-step{step:08d}.toml"


def config_changes(run_dir: Path, cfg: Config) -> list[str]:
    """`section.key: old -> new` for each key where `cfg` differs from the run's config.toml (none without one)."""
    path = Path(run_dir) / RUN_CONFIG
    try:
        saved = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return [f"{path} cannot be read as TOML"]
    # both through TOML: tuples read back as lists
    old, new = flatten(_current_form(saved)), flatten(tomllib.loads(cfg.to_toml()))
    return [f"{key}: {toml_value(old.get(key))} -> {toml_value(new.get(key))}"
            for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]


def _current_form(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config.toml as this release writes it: an earlier release's flat [model] keys translated, and the
    keys it did not have at their defaults (read back through the config's dataclasses)."""
    tree = migrate_tree(saved, report="none")
    try:
        return tomllib.loads(build_section(Config, tree, "").to_toml())
    except ConfigError:  # a key this release no longer has: compared as written
        return tree


def check_checkpoint_owner(cfg: Config, checkpoint_dir: Path, step_dir: Path) -> None:
    """A checkpoint.dir set apart from the run folder may hold another run's checkpoints (two configs naming one
    folder): resuming would adopt that run's weights and write them as this run's final. Refused unless
    checkpoint.resume_other_run says so. `step_dir`: the newest committed checkpoint there."""
    if not cfg.checkpoint.dir or cfg.checkpoint.resume_other_run:
        return
    try:
        saved = json.loads((step_dir / TRAINER_STATE).read_text())["config"]["logging"]["run_dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # weights converted to a checkpoint, or a damaged state file (resume's verification names it)
    if Path(saved).resolve() != Path(cfg.logging.run_dir).resolve():
        raise ConfigError(f"checkpoint.dir={cfg.checkpoint.dir!r} holds {step_dir.name} of the run in {saved}, not "
                          f"of this run (logging.run_dir={cfg.logging.run_dir!r}); resuming would adopt its weights",
                          "set checkpoint.dir to a folder of this run's own (or leave it empty: <run_dir>/"
                          "checkpoints), or set checkpoint.resume_other_run=true to continue from that run's "
                          "checkpoint")


def check_rerun(cfg: Config, run_dir: Path, reached_step: int, has_final: bool) -> list[str]:
    """The changes from the run's config.toml; refuses a changed config that would leave the run's record
    describing other weights: one that trains nothing (the run already reached train.steps), or one that
    would retrain a finished run from step 0 (no checkpoint to continue from) and replace its final weights."""
    changes = config_changes(run_dir, cfg)
    if not changes:
        return []
    listed = "; ".join(changes[:4]) + ("; ..." if len(changes) > 4 else "")
    model_changes = [change for change in changes if _changes_the_model(change)]
    if model_changes and reached_step > 0 and cfg.checkpoint.load_mode != "partial":
        # no train.steps continues it: its checkpoints hold another model
        raise ConfigError(f"the run in {run_dir} holds checkpoints of another model than this config's "
                          f"({'; '.join(model_changes[:4])}{'; ...' if len(model_changes) > 4 else ''})",
                          f"{NEW_RUN_HINT}, or set checkpoint.load_mode=\"partial\" to continue it with the "
                          "tensors that fit")
    if reached_step >= cfg.train.steps:
        raise ConfigError(f"the run in {run_dir} already reached step {reached_step}, so train.steps="
                          f"{cfg.train.steps} trains nothing, yet this config differs from its config.toml ({listed})",
                          f"raise train.steps above {reached_step} to continue the run, or {NEW_RUN_HINT}")
    if reached_step == 0 and has_final:
        raise ConfigError(f"{run_dir} holds the final weights of a finished run with another config ({listed}) and "
                          "no checkpoint to continue from; this run would replace them",
                          f"{NEW_RUN_HINT} (checkpoint.interval > 0 lets a later run continue one)")
    return changes


def _changes_the_model(change: str) -> bool:
    """Whether a `section.key: old -> new` change makes another model (not dropout, kernels or training terms)."""
    from meshformer.checkpointing.init_from import FUNCTION_NEUTRAL

    key = change.split(":", 1)[0]
    return key.startswith("model.") and key.removeprefix("model.") not in FUNCTION_NEUTRAL


def record_config(cfg: Config, run_dir: Path, start_step: int, changes: list[str],
                  log: Callable[[str], None]) -> None:
    """Rank 0, when training starts at `start_step`: config.toml becomes this config; a changed earlier one that
    trained steps is kept in configs/, and the continuation is said in one log line."""
    path = Path(run_dir) / RUN_CONFIG
    if changes and start_step > 0 and path.is_file():
        kept = Path(run_dir) / CONFIG_HISTORY / history_name(start_step)
        kept.parent.mkdir(exist_ok=True)
        if not kept.is_file():  # else an earlier continuation from this step kept it; config.toml trained no step
            kept.write_text(path.read_text())
        log(f"continuing the run in {run_dir} from step {start_step} to {cfg.train.steps} with a changed config "
            f"({'; '.join(changes)}); the config that trained it so far is kept as "
            f"{CONFIG_HISTORY}/{kept.name}")
    staged = path.with_name(path.name + ".tmp")  # other ranks may be reading it: replaced whole, never half-written
    staged.write_text(cfg.to_toml())
    staged.replace(path)


def new_run_dir(run_dir: Path) -> Path:
    """`run_dir` when it holds no run yet, else the first free `<run_dir>-<n>` beside it (n = 2, 3, ...)."""
    run_dir = Path(run_dir)
    if run_dir.name in ("", ".."):  # "." or "..": the folder's own name, to put the new run beside it
        run_dir = run_dir.resolve()
    if not run_dir.name:
        raise UsageError(f"--new-run cannot put a run beside {run_dir}", "set logging.run_dir to a run folder")
    if not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir())):
        return run_dir
    n = 2
    while run_dir.with_name(f"{run_dir.name}-{n}").exists():
        n += 1
    return run_dir.with_name(f"{run_dir.name}-{n}")


def new_run_overrides(cfg: Config, overrides: list[str]) -> tuple[list[str], Path]:
    """`--new-run`: the overrides that put this run in a fresh folder, and that folder."""
    if cfg.checkpoint.dir:
        raise UsageError(f"--new-run picks a new logging.run_dir, but checkpoint.dir={cfg.checkpoint.dir!r} is set "
                         "and would be shared with the earlier run", "set checkpoint.dir to a new folder as well, or "
                         "leave it empty (checkpoints then go into the run folder)")
    fresh = new_run_dir(Path(cfg.logging.run_dir))
    return [*overrides, f"logging.run_dir={fresh}"], fresh
