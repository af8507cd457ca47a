"""tiktoken-format BPE files read from a local path (#23): the same ids as tiktoken's own byte-pair merge (a
reference written here, and tiktoken itself when installed), tiktoken's special-token ids and vocabulary size,
and a prepare whose saved tokenizer.json encodes the same. The BPE files are trained and written by the test."""

from __future__ import annotations

import base64
import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import regex
from helpers.data import kjv_docs

from meshformer.data import load_tokenizer, prepare, read_manifest
from meshformer.data.shards import read_shard
from meshformer.data.tiktoken_files import PATTERNS, TiktokenError

TEXTS = [*kjv_docs(3), "Hello  world\n\n  trailing   ", "don't I'LL we've 1234567 café 東京 🙂\r\n\tx", "a\n  \nb  ",
         "CamelCaseWords and snake_case/paths, 3.14159!!", ""]


def python_pattern(name: str) -> str:
    return PATTERNS[name].replace(r"\z", r"\Z")  # Oniguruma's end of text, as Python's regex module writes it


def train_ranks(texts: list[str], pattern: str, merges: int = 300) -> dict[bytes, int]:
    """A small byte-level BPE as tiktoken files hold one: bytes in a shuffled order, then merges by frequency."""
    order = np.random.default_rng(0).permutation(256).tolist()
    ranks = {bytes([b]): r for r, b in enumerate(order)}
    words = Counter(tuple(bytes([b]) for b in w.encode()) for t in texts for w in regex.findall(pattern, t))
    for _ in range(merges):
        pairs: Counter = Counter()
        for word, count in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks[a + b] = len(ranks)
        merged: Counter = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if word[i:i + 2] == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return ranks


def write_tiktoken(path: Path, ranks: dict[bytes, int]) -> Path:
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path


def reference_encode(ranks: dict[bytes, int], pattern: str, text: str) -> list[int]:
    """tiktoken's algorithm: split by the pattern; a piece that is a token stays whole, else merge lowest rank first."""
    ids = []
    for piece in regex.findall(pattern, text):
        parts = [bytes([b]) for b in piece.encode()]
        if piece.encode() in ranks:
            parts = [piece.encode()]
        while len(parts) > 1:
            found = [(ranks[p + q], i) for i, (p, q) in enumerate(itertools.pairwise(parts)) if p + q in ranks]
            if not found:
                break
            i = min(found)[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] for p in parts]
    return ids


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_a_tiktoken_file_encodes_as_tiktoken(tmp_path, pattern):
    ranks = train_ranks(kjv_docs(30) + TEXTS, python_pattern(pattern))
    path = write_tiktoken(tmp_path / "mine.tiktoken", ranks)
    tok = load_tokenizer(f"tiktoken:{pattern}:{path}")
    assert (tok.vocab_size, tok.eos_id) == (len(ranks) + 1, len(ranks))  # <|endoftext|> right after the ranks
    try:
        import tiktoken
    except ImportError:
        tiktoken = None
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference_encode(ranks, python_pattern(pattern), text), text
        assert tok.decode(ids) == text
        if tiktoken is not None:
            theirs = tiktoken.Encoding(name="t", pat_str=PATTERNS[pattern].replace(r"\z", "$"), mergeable_ranks=ranks,
                                       special_tokens={"<|endoftext|>": len(ranks)})
            assert ids == theirs.encode_ordinary(text), text


def test_a_known_file_name_gives_its_special_tokens(tmp_path):
    ranks = train_ranks(TEXTS, python_pattern("gpt2"), merges=40)
    filler = (f"t{i:05d}".encode() for i in range(50256))  # unreachable tokens up to r50k_base's size
    while len(ranks) < 50256:
        ranks.setdefault(next(filler), len(ranks))
    tok = load_tokenizer(str(write_tiktoken(tmp_path / "r50k_base.tiktoken", ranks)))
    assert (tok.vocab_size, tok.eos_id, tok.hf.id_to_token(50256)) == (50257, 50256, "<|endoftext|>")
    assert tok.encode("hello world") == reference_encode(ranks, python_pattern("gpt2"), "hello world")
    with pytest.raises(TiktokenError, match="not that encoding's file"):  # a small file under cl100k's name
        load_tokenizer(str(write_tiktoken(tmp_path / "cl100k_base.tiktoken", train_ranks(TEXTS, "."))))


@pytest.mark.parametrize("content, words", [
    (None, ["name is not one of", "tiktoken:PATTERN:"]),
    ("aGk= 0\nnot-a-line\n", [":2: not a `base64(token) rank` line"]),
    ("aGk= 0\n", ["byte 0x00 is not a token"]),
])
def test_bad_tiktoken_files_are_one_line(tmp_path, content, words):
    path = tmp_path / "bad.tiktoken"
    if content is None:
        write_tiktoken(path, train_ranks(TEXTS, ".", merges=1))
    else:
        path.write_text(content)
    spec = str(path) if content is None else f"tiktoken:cl100k:{path}"
    with pytest.raises(TiktokenError) as err:
        load_tokenizer(spec)
    assert all(w in str(err.value) for w in words) and "\n" not in str(err.value)


@pytest.mark.parametrize("spec", ["tiktoken:cl100k_base", "tiktoken:cl100k:", "tiktoken:"])
def test_a_tiktoken_spec_without_a_path_is_one_line(spec):
    with pytest.raises(TiktokenError) as err:
        load_tokenizer(spec)
    assert f"{spec} names no file" in str(err.value) and "tiktoken:PATTERN:PATH" in str(err.value)


def test_prepare_with_a_tiktoken_file_keeps_its_ids(tmp_path):
    ranks = train_ranks(kjv_docs(30), python_pattern("cl100k"))
    spec = f"tiktoken:cl100k:{write_tiktoken(tmp_path / 'mine.tiktoken', ranks)}"
    corpus = tmp_path / "c.jsonl"
    docs = kjv_docs(2)
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    manifest = prepare(corpus, tmp_path / "out", tokenizer=spec, record_len=17, eval_fraction=0.0, progress=False)
    assert manifest is not None and manifest.tokenizer["vocab_size"] == len(ranks) + 1
    saved = load_tokenizer(str(tmp_path / "out" / "tokenizer.json"))
    assert saved.sha256 == load_tokenizer(spec).sha256
    m = read_manifest(str(tmp_path / "out"))
    tokens = [t for info in m.splits["train"] for r in [read_shard(m.shard_url(info), info, m.dtype, None)]
              for i in range(info.samples) for t in r[i]["tokens"].tolist()]
    encoded = [[*reference_encode(ranks, python_pattern("cl100k"), d), len(ranks)] for d in docs]
    streams = [encoded[0] + encoded[1], encoded[1] + encoded[0]]  # the bucket's shuffle picks the order
    assert len(tokens) > 17 and tokens in [s[:len(tokens)] for s in streams]
