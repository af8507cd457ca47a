"""Training objectives applied at load time: raw token windows in, a batch dict of tensors out.

Batch contract (B = batch size, T = data.seq_len, Tt = data.target_len; all tensors int64 except masks):
- causal:  input_ids (B,T), labels (B,T) next tokens (-100 = ignore; packed data has none),
           doc_ids (B,T) document index within the row; an EOS belongs to the document it ends.
- mlm:     input_ids (B,T), labels (B,T) (-100 where not predicted), attention_mask (B,T) bool.
           Each non-special token is selected with probability p; selected: 80% mask, 10% random
           non-special token, 10% unchanged.
- span / seq2seq: input_ids, attention_mask (B,T); decoder_input_ids, decoder_attention_mask,
           labels (B,Tt). labels end with EOS and are padded with -100; decoder_input_ids =
           [bos] + labels[:-1], padded with pad_id (teacher forcing). Span corruption follows T5:
           noise density d, mean span length m, spans replaced by <extra_id_i> in the input and
           prefixed by it in the target.
- seq2seq without a pair corpus: a synthetic task on corpus token windows (target = reversed source).

Randomness comes only from the per-sample generator handed in, seeded from (seed, epoch, unit id), so a
sample's corruption does not depend on which rank or worker builds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshformer.errors import MeshformerError

from .tokenizer import Tokenizer

IGNORE = -100
Sample = np.ndarray | tuple[np.ndarray, np.ndarray]


class ObjectiveError(MeshformerError, ValueError):
    """An objective that cannot run with this configuration or data."""


def span_lengths(raw_len: int, density: float, mean_span: float) -> tuple[int, int, int, int]:
    """T5's bookkeeping: raw tokens -> (noise tokens, spans, encoder length, decoder length)."""
    noise = min(max(round(raw_len * density), 1), raw_len - 1)
    spans = max(round(noise / mean_span), 1)
    return noise, spans, raw_len - noise + spans + 1, noise + spans + 1


def span_raw_length(seq_len: int, target_len: int, density: float, mean_span: float) -> int:
    """Longest raw window whose corrupted input fits seq_len and whose target fits target_len."""
    raw = 2
    while True:
        _, _, enc, dec = span_lengths(raw + 1, density, mean_span)
        if enc > seq_len or dec > target_len:
            break
        raw += 1
    _, _, enc, dec = span_lengths(raw, density, mean_span)
    if enc > seq_len or dec > target_len:
        raise ObjectiveError(f"span corruption cannot fit data.seq_len={seq_len}, data.target_len={target_len}; "
                             "raise both")
    return raw


@dataclass
class Objective:
    name: str
    tok: Tokenizer
    seq_len: int
    target_len: int
    mlm_probability: float = 0.15
    noise_density: float = 0.15
    mean_span: float = 3.0

    def __post_init__(self) -> None:
        if self.name == "mlm":
            self.tok.require("mask", "mlm")
        if self.name == "span":
            self.tok.require("sentinels", "span")
            if self.mean_span < 1:
                raise ObjectiveError(f"data.span_mean_length={self.mean_span} must be >= 1")
            _, spans, _, _ = span_lengths(self.raw_length, self.noise_density, self.mean_span)
            if spans > len(self.tok.sentinel_ids):
                raise ObjectiveError(f"span corruption of {self.raw_length} tokens makes {spans} spans but the "
                                     f"tokenizer has {len(self.tok.sentinel_ids)} sentinels; lower data.seq_len "
                                     "or data.span_noise_density")
        special = np.zeros(self.tok.vocab_size, dtype=bool)
        special[self.tok.special_ids] = True
        self._special = special
        self._normal_ids = np.flatnonzero(~special)

    @property
    def needs_rng(self) -> bool:
        return self.name != "causal"

    @property
    def raw_length(self) -> int:
        """Tokens of packed corpus one sample consumes."""
        if self.name == "causal":
            return self.seq_len + 1
        if self.name == "mlm":
            return self.seq_len
        if self.name == "span":
            return span_raw_length(self.seq_len, self.target_len, self.noise_density, self.mean_span)
        return max(2, min(self.seq_len, self.target_len) - 1)  # synthetic seq2seq source window

    def collate(self, samples: list[Sample], rngs: list[np.random.Generator] | None) -> dict[str, torch.Tensor]:
        if self.name == "causal":
            return self._causal(np.stack(samples))
        assert rngs is not None
        if self.name == "mlm":
            return self._mlm(np.stack(samples), rngs)
        if self.name == "span":
            return self._encoder_decoder([self._corrupt(s, r) for s, r in zip(samples, rngs)])
        pairs = [s if isinstance(s, tuple) else _synthetic_pair(s, r) for s, r in zip(samples, rngs)]
        return self._encoder_decoder([self._pair(src, tgt) for src, tgt in pairs])

    # -------------------------------------------------------------- causal

    def _causal(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        inputs, labels = rows[:, :-1], rows[:, 1:]
        ends = inputs == self.tok.eos_id
        doc_ids = np.cumsum(ends, axis=1) - ends  # EOS closes its own document
        return {"input_ids": _long(inputs), "labels": _long(labels), "doc_ids": _long(doc_ids)}

    # -------------------------------------------------------------- masked LM

    def _mlm(self, rows: np.ndarray, rngs: list[np.random.Generator]) -> dict[str, torch.Tensor]:
        inputs = rows.copy()
        labels = np.full_like(rows, IGNORE)
        for i, rng in enumerate(rngs):
            draw = rng.random((2, rows.shape[1]))
            chosen = (draw[0] < self.mlm_probability) & ~self._special[rows[i]]
            labels[i, chosen] = rows[i, chosen]
            to_mask = chosen & (draw[1] < 0.8)
            to_random = chosen & (draw[1] >= 0.8) & (draw[1] < 0.9)
            inputs[i, to_mask] = self.tok.mask_id
            inputs[i, to_random] = rng.choice(self._normal_ids, size=int(to_random.sum()))
        mask = np.ones_like(rows, dtype=bool)  # packed windows are all real tokens (prepare drops the ragged tail)
        return {"input_ids": _long(inputs), "labels": _long(labels), "attention_mask": torch.from_numpy(mask)}

    # -------------------------------------------------------------- span corruption (T5)

    def _corrupt(self, raw: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        noise_n, spans, _, _ = span_lengths(len(raw), self.noise_density, self.mean_span)
        noise_len = _segment(noise_n, spans, rng)
        keep_len = _segment(len(raw) - noise_n, spans, rng)
        src, tgt, pos = [], [], 0
        for i in range(spans):  # T5 order: kept span, then noise span
            src.append(raw[pos:pos + keep_len[i]])
            pos += keep_len[i]
            sentinel = np.array([self.tok.sentinel_ids[i]], dtype=raw.dtype)
            src.append(sentinel)
            tgt += [sentinel, raw[pos:pos + noise_len[i]]]
            pos += noise_len[i]
        eos = np.array([self.tok.eos_id], dtype=raw.dtype)
        return np.concatenate([*src, eos]), np.concatenate([*tgt, eos])

    def _pair(self, src: np.ndarray, tgt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        eos = np.array([self.tok.eos_id], dtype=np.int64)
        return (np.concatenate([src[:self.seq_len - 1], eos]), np.concatenate([tgt[:self.target_len - 1], eos]))

    def _encoder_decoder(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
        b, pad = len(pairs), self.tok.pad_id
        enc = np.full((b, self.seq_len), pad, dtype=np.int64)
        enc_mask = np.zeros((b, self.seq_len), dtype=bool)
        labels = np.full((b, self.target_len), IGNORE, dtype=np.int64)
        dec = np.full((b, self.target_len), pad, dtype=np.int64)
        dec_mask = np.zeros((b, self.target_len), dtype=bool)
        for i, (src, tgt) in enumerate(pairs):
            enc[i, :len(src)], enc_mask[i, :len(src)] = src, True
            labels[i, :len(tgt)] = tgt
            dec[i, 0], dec[i, 1:len(tgt)], dec_mask[i, :len(tgt)] = self.tok.bos_id, tgt[:-1], True
        return {"input_ids": _long(enc), "attention_mask": torch.from_numpy(enc_mask),
                "decoder_input_ids": _long(dec), "decoder_attention_mask": torch.from_numpy(dec_mask),
                "labels": _long(labels)}


def _segment(n_items: int, n_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Random split of n_items into n_segments non-empty parts (T5's _random_segmentation)."""
    if n_segments <= 1:
        return np.array([n_items])
    cuts = np.sort(rng.choice(n_items - 1, size=n_segments - 1, replace=False)) + 1
    return np.diff(np.concatenate([[0], cuts, [n_items]]))


def _synthetic_pair(window: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Reverse a corpus window of random length: a learnable, deterministic seq2seq task."""
    n = int(rng.integers(max(1, len(window) // 2), len(window) + 1))
    src = window[:n]
    return src, src[::-1].copy()


def _long(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


def make_objective(name: str, tok: Tokenizer, data_cfg) -> Objective:  # data_cfg: meshformer.config.DataConfig
    if name not in ("causal", "mlm", "span", "seq2seq"):
        raise ObjectiveError(f"unknown objective {name!r}; use causal, mlm, span or seq2seq")
    return Objective(name, tok, data_cfg.seq_len, data_cfg.target_len, data_cfg.mlm_probability,
                     data_cfg.span_noise_density, data_cfg.span_mean_length)
