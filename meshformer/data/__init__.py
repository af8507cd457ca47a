"""Data: bundled corpus, tokenizers, `data prepare` shards, and the streaming, resumable loader.

    from meshformer.data import build_loader, load_tokenizer
    tok = load_tokenizer(cfg.data.tokenizer)
    train = build_loader(cfg, tok, "train", dp_rank, dp_size)
    batch = next(train); state = train.state_dict(); train.load_state_dict(state)
"""

import importlib
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .build import build_loader, cache_root, ensure_shards, verify_shards
    from .loader import DataStateError, Loader
    from .objectives import ObjectiveError
    from .prepare import prepare
    from .shards import ManifestError, ShardError, read_manifest
    from .tokenizer import Tokenizer, TokenizerError, load_tokenizer, train_bpe

# Imported on first use (these modules import torch): the CLI's argument parsers in this package, and so
# `meshformer data prepare --help`, start without it.
_SOURCES = {"build": ("build_loader", "cache_root", "ensure_shards", "verify_shards"),
            "loader": ("DataStateError", "Loader"), "objectives": ("ObjectiveError",),
            "shards": ("ManifestError", "ShardError", "read_manifest"),
            "tokenizer": ("Tokenizer", "TokenizerError", "load_tokenizer", "train_bpe")}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}


class _Package(types.ModuleType):
    """`meshformer.data.prepare` stays the function, imported when first used: importing the module of the same name
    sets the package's attribute to that module, which this setter leaves aside (sys.modules holds the module)."""

    @property
    def prepare(self) -> Callable[..., Any]:
        from .prepare import prepare

        return prepare

    @prepare.setter
    def prepare(self, module: types.ModuleType) -> None:
        pass


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> object:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


__all__ = [
           "DataStateError",
           "Loader",
           "ManifestError",
           "ObjectiveError",
           "ShardError",
           "Tokenizer",
           "TokenizerError",
           "build_loader",
           "cache_root",
           "ensure_shards",
           "load_tokenizer",
           "prepare",
           "read_manifest",
           "train_bpe",
           "verify_shards",
]
