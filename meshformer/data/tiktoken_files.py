"""tiktoken-format BPE files (`cl100k_base.tiktoken`, `o200k_base.tiktoken`, ...: lines of `base64(token) rank`),
read from a local path and converted to an equivalent HF `tokenizers` BPE, so that everything downstream (batch
encoding, worker processes, the tokenizer.json saved beside prepared shards) is the same as for any tokenizer.

    load_tokenizer("tok/cl100k_base.tiktoken")           # a known file name gives its pattern and special tokens
    load_tokenizer("tiktoken:cl100k:tok/my_bpe.tiktoken")  # any file, with a named pre-tokenizer pattern

Equivalence with tiktoken: the pattern splits text into pieces exactly as tiktoken's does; a piece that is a token
is taken whole (`ignore_merges`, as tiktoken does), otherwise its bytes are merged lowest rank first, which a BPE
whose merge list is ordered by the rank of the merged token reproduces. Special tokens get the ids tiktoken gives
them (a file of unknown name: `<|endoftext|>` right after the last rank); ids between the last rank and the
special tokens are filled with reserved tokens, so the vocabulary size is tiktoken's `n_vocab`.
"""

from __future__ import annotations

import base64
import binascii
import itertools
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from meshformer.errors import MeshformerError

ENDOFTEXT, ENDOFPROMPT = "<|endoftext|>", "<|endofprompt|>"
# tiktoken's own patterns; `$` (end of text in tiktoken's regex engine) is written `\z` for Oniguruma, where `$`
# would also match before every newline
_GPT2 = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++\z|\s+(?!\S)|\s"""
PATTERNS = {
    "gpt2": _GPT2,
    "cl100k": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++\z|"""
              r"""\s*[\r\n]|\s+(?!\S)|\s""",
    "o200k": "|".join([
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+"""]),
}
# the encodings tiktoken ships: (pattern, special tokens)
KNOWN_FILES = {
    "gpt2": ("gpt2", {ENDOFTEXT: 50256}),
    "r50k_base": ("gpt2", {ENDOFTEXT: 50256}),
    "p50k_base": ("gpt2", {ENDOFTEXT: 50256}),
    "cl100k_base": ("cl100k", {ENDOFTEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                               "<|fim_suffix|>": 100260, ENDOFPROMPT: 100276}),
    "o200k_base": ("o200k", {ENDOFTEXT: 199999, ENDOFPROMPT: 200018}),
}
_MAX_RESERVED = 1024  # more ids without a token than this: the special tokens belong to another file


class TiktokenError(MeshformerError, ValueError):
    """A tiktoken BPE file that cannot be read, or a pattern that is not named."""


def is_tiktoken_spec(spec: str) -> bool:
    return spec.startswith("tiktoken:") or spec.endswith(".tiktoken")


def load_tiktoken(spec: str) -> HFTokenizer:
    """`tiktoken:<pattern>:<path>` or a path to a known file (`cl100k_base.tiktoken`, ...), as an HF tokenizer."""
    parts = spec.split(":", 2)[1:] if spec.startswith("tiktoken:") else ["", spec]
    if len(parts) < 2 or not parts[1]:
        raise TiktokenError(f"tokenizer {spec} names no file (tiktoken files are read from a local path)",
                            f"write tiktoken:PATTERN:PATH with PATTERN one of {sorted(PATTERNS)}, or the path of a "
                            f"file named as tiktoken ships it ({', '.join(f'{n}.tiktoken' for n in KNOWN_FILES)})")
    pattern, path_text = parts
    path = Path(path_text).expanduser()
    known = KNOWN_FILES.get(path.name.removesuffix(".tiktoken"))
    if not pattern and not known:
        raise TiktokenError(f"tiktoken file {path}: its name is not one of {sorted(KNOWN_FILES)}, so its "
                            "pre-tokenizer pattern is unknown", f"name it: --tokenizer tiktoken:PATTERN:{path} with "
                            f"PATTERN one of {sorted(PATTERNS)}")
    if pattern and pattern not in PATTERNS:
        raise TiktokenError(f"tiktoken pattern {pattern!r} is not known", f"use one of {sorted(PATTERNS)}")
    ranks = read_ranks(path)
    n_ranks = max(ranks.values(), default=-1) + 1
    special = dict(known[1]) if known else {ENDOFTEXT: n_ranks}
    if known and not pattern and min(special.values()) - n_ranks > _MAX_RESERVED:
        raise TiktokenError(f"{path}: {n_ranks} tokens, but {path.stem}'s special tokens start at id "
                            f"{min(special.values())}: not that encoding's file",
                            f"name the pattern instead: --tokenizer tiktoken:PATTERN:{path}")
    clash = [t for t, i in special.items() if i < n_ranks and i in set(ranks.values())]
    if clash:
        raise TiktokenError(f"{path}: special token {clash[0]} has id {special[clash[0]]}, which a BPE token has",
                            "name the pattern (tiktoken:PATTERN:PATH) to give the file its own <|endoftext|>")
    return _to_hf(ranks, PATTERNS[pattern or known[0]], special)  # type: ignore[index]


def read_ranks(path: Path) -> dict[bytes, int]:
    """The file's tokens and ranks; one line per token, `base64 rank`, every single byte a token."""
    fix = "pass a tiktoken BPE file (lines of `base64(token) rank`, as cl100k_base.tiktoken)"
    try:
        lines = path.read_bytes().splitlines()
    except OSError as err:
        raise TiktokenError(f"tiktoken file {path} cannot be read ({err.strerror})", fix) from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise TiktokenError(f"{path}:{lineno}: not a `base64(token) rank` line ({line[:60]!r})", fix) from None
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing or len(set(ranks.values())) != len(ranks):
        what = f"byte {missing[0]:#04x} is not a token" if missing else "two tokens share a rank"
        raise TiktokenError(f"{path}: not a byte-level BPE file ({what})", fix)
    return ranks


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of HF's ByteLevel pre-tokenizer and decoder."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + k) for k, b in enumerate(others)}}


def _last_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes] | None:
    """The pair tiktoken's byte-pair merge joins last when it builds `token` (ranks below the token's own)."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        pair_ranks = [ranks.get(a + b, limit) for a, b in itertools.pairwise(parts)]
        best = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
        if pair_ranks[best] >= limit:
            return None
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def _to_hf(ranks: dict[bytes, int], pattern: str, special: dict[str, int]) -> HFTokenizer:
    chars = _byte_chars()

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    vocab = {text(t): r for t, r in ranks.items()}
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        pair = _last_merge(ranks, token) if len(token) > 1 else None
        if pair:
            merges.append((text(pair[0]), text(pair[1])))
    taken = set(ranks.values()) | set(special.values())
    reserved = {f"<|reserved_{i}|>": i for i in range(max(taken) + 1) if i not in taken}
    vocab.update(special)
    vocab.update(reserved)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in sorted({**special, **reserved}, key=lambda t: vocab[t])])
    return hf
