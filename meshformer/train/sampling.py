"""A short decoded sample at intervals: the quickest way for a person to see what the model learned."""

from __future__ import annotations

import torch

from meshformer.config import Config
from meshformer.model.families import get_family_spec
from meshformer.model.generate import greedy_decode

PROMPT = "And God said unto"
SOURCE = "In the beginning God created the heaven and the earth."


@torch.no_grad()
def decoded_sample(
    model: torch.nn.Module, tokenizer, cfg: Config, device: torch.device, max_new: int = 0
) -> str | None:
    """Greedy continuation (decoder-only), span filling (encoder-decoder) or mask filling (encoder-only)."""
    max_new = max_new or cfg.train.sample_tokens
    was_training = model.training
    model.eval()
    try:
        spec = get_family_spec(cfg.model.family)
        if spec.has_decoder and not spec.seq2seq:
            prompt = torch.tensor([tokenizer.encode(PROMPT)], device=device)
            max_new = min(max_new, cfg.model.max_seq_len - prompt.shape[1])
            out = greedy_decode(model, prompt, max_new, eos_id=tokenizer.eos_id)
            return tokenizer.decode(out[0].tolist())
        ids = tokenizer.encode(SOURCE)[: cfg.data.seq_len]  # the encoder's position table ends at max_seq_len
        if not spec.has_decoder:
            masked = list(ids)
            for i in range(2, len(masked), 4):  # hide every fourth token and let the model fill it in
                masked[i] = tokenizer.mask_id
            logits = model(torch.tensor([masked], device=device))
            filled = [int(p) if m == tokenizer.mask_id else m for m, p in zip(masked, logits[0].argmax(-1))]
            return f"{tokenizer.decode(masked)!s} -> {tokenizer.decode(filled)}"
        source = torch.tensor([ids], device=device)
        max_new = min(max_new, cfg.data.target_len)
        out = greedy_decode(model, None, max_new, eos_id=tokenizer.eos_id, bos_id=tokenizer.bos_id, source_ids=source)
        return f"{SOURCE} -> {tokenizer.decode(out[0].tolist())}"
    finally:
        model.train(was_training)
