"""A short decoded sample at intervals: the quickest way for a person to see what the model learned.

The prompt comes from the run's own data (the opening of the first held-out sequence), never a fixed phrase:
a model trained on another corpus or language is shown text it knows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshformer.batch import IGNORE_INDEX
from meshformer.config import Config
from meshformer.model import Transformer
from meshformer.model.families import get_family_spec
from meshformer.model.generate import greedy_decode

PROMPT_TOKENS = 8  # decoder-only: the continuation shows more than the prompt
SOURCE_TOKENS = 24  # encoder and encoder-decoder: a sentence or so to fill in or transform


def prompt_ids(batch: dict[str, torch.Tensor], tokenizer) -> list[int]:
    """The first sequence of `batch` as the data has it (masked tokens put back from the labels), up to its
    first padding or end-of-text token."""
    ids = batch["input_ids"][0].tolist()
    if tokenizer.mask_id is not None and tokenizer.mask_id in ids:  # MLM: the labels hold the hidden tokens
        labels = batch["labels"][0].tolist()
        ids = [i if label == IGNORE_INDEX else label for i, label in zip(ids, labels, strict=True)]
    stops = {tokenizer.eos_id, tokenizer.pad_id}
    end = next((i for i, t in enumerate(ids) if t in stops and i > 0), len(ids))
    return [t for t in ids[:end] if t not in stops]


@torch.no_grad()
def decoded_sample(model: Transformer, tokenizer, cfg: Config, device: torch.device,
                   batch: dict[str, torch.Tensor], max_new: int = 0,
                   poll: Callable[[], None] | None = None) -> str | None:
    """Greedy continuation (decoder-only), span filling (encoder-decoder) or mask filling (encoder-only) of the
    opening of `batch`'s first sequence (a held-out batch of the run's data). `poll` runs before each decoded
    token (the run's stop check)."""
    max_new = max_new or cfg.train.sample_tokens
    ids = prompt_ids(batch, tokenizer)
    if not ids:
        return None
    was_training = model.training
    model.eval()
    try:
        spec = get_family_spec(cfg.model.family)
        if spec.has_decoder and not spec.seq2seq:
            prompt = torch.tensor([ids[:PROMPT_TOKENS]], device=device)
            max_new = min(max_new, cfg.model.max_seq_len - prompt.shape[1])
            out = greedy_decode(model, prompt, max_new, eos_id=tokenizer.eos_id, between_tokens=poll)
            return tokenizer.decode(out[0].tolist())
        ids = ids[: min(SOURCE_TOKENS, cfg.data.seq_len)]  # the encoder's position table ends at max_seq_len
        if not spec.has_decoder:
            masked = list(ids)
            for i in range(2, len(masked), 4):  # hide every fourth token and let the model fill it in
                masked[i] = tokenizer.mask_id
            logits = model(torch.tensor([masked], device=device))
            filled = [int(p) if m == tokenizer.mask_id else m for m, p in zip(masked, logits[0].argmax(-1))]
            return f"{tokenizer.decode(masked)!s} -> {tokenizer.decode(filled)}"
        source = torch.tensor([ids], device=device)
        max_new = min(max_new, cfg.data.target_len)
        out = greedy_decode(model, None, max_new, eos_id=tokenizer.eos_id, bos_id=tokenizer.bos_id, source_ids=source,
                            between_tokens=poll)
        return f"{tokenizer.decode(ids)} -> {tokenizer.decode(out[0].tolist())}"
    finally:
        model.train(was_training)
