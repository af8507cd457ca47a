"""Data: bundled corpus, tokenizers, `data prepare` shards, and the streaming, resumable loader.

    from meshformer.data import build_loader, load_tokenizer
    tok = load_tokenizer(cfg.data.tokenizer)
    train = build_loader(cfg, tok, "train", dp_rank, dp_size)
    batch = next(train); state = train.state_dict(); train.load_state_dict(state)
"""

from .build import build_loader, cache_root, ensure_shards, verify_shards
from .loader import DataStateError, Loader
from .objectives import ObjectiveError
from .prepare import prepare
from .shards import ManifestError, ShardError, read_manifest
from .tokenizer import Tokenizer, TokenizerError, load_tokenizer, train_bpe

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
