"""Greedy decoding for decoder-only and encoder-decoder models, with or without the KV cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # the model imports nothing from here, but keep generate importable on its own
    from meshformer.model.transformer import Transformer

from meshformer.errors import UsageError
from meshformer.model.moe import dropless, moe_layers

TABLE_POSITIONS = ("learned", "sinusoidal", "rope")  # position schemes backed by a max_seq_len table


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _check_length(cfg, prompt_len: int, max_new_tokens: int) -> None:
    # The last generated token is never fed back, so the decoder sees prompt_len + max_new_tokens - 1 positions.
    needed = prompt_len + max_new_tokens - 1
    if cfg.position in TABLE_POSITIONS and prompt_len > cfg.max_seq_len:  # no number of new tokens fits
        new = min(max_new_tokens, cfg.max_seq_len)
        over = prompt_len - cfg.max_seq_len
        raise UsageError(f"a {prompt_len}-token prompt is {over} tokens longer than the model's context ("
                         f"{cfg.position!r} positions stop at model.max_seq_len={cfg.max_seq_len})",
                         f"shorten the prompt to at most {cfg.max_seq_len - new + 1} tokens to generate {new} new ones")
    if cfg.position in TABLE_POSITIONS and needed > cfg.max_seq_len:
        raise UsageError(
            f"decoding {max_new_tokens} new tokens after a {prompt_len}-token prompt needs {needed} positions, but "
            f"{cfg.position!r} positions stop at model.max_seq_len={cfg.max_seq_len}; use max_new_tokens <= "
            f"{cfg.max_seq_len - prompt_len + 1}"
        )


def pad_rows(rows: list[list[int]], pad_id: int, *, left: bool = True, device: torch.device | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, padding) of token rows of different lengths, padded on the left (decoder prompts, as `greedy_decode`
    takes them) or the right (encoder sources); the padding mask is True for real tokens."""
    if not rows or not all(rows):
        raise UsageError("every prompt needs at least one token")
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    padding = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span] = torch.tensor(row, dtype=torch.long)
        padding[i, span] = True
    return ids, padding


@torch.no_grad()
def greedy_decode(
    model: Transformer,
    prompt_ids: torch.Tensor | None,
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    bos_id: int | None = None,
    source_ids: torch.Tensor | None = None,
    source_padding: torch.Tensor | None = None,
    prompt_padding: torch.Tensor | None = None,
    use_cache: bool = True,
    between_tokens: Callable[[], None] | None = None,
    stopped: Callable[[torch.Tensor], torch.Tensor] | None = None,
    choose: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Prompt followed by up to `max_new_tokens` argmax tokens, shape (B, T_prompt + n_new).

    prompt_ids: (B, T) decoder prompt; None starts from `bos_id` (the usual encoder-decoder start; one row per
        source, or a single row for decoder-only).
    prompt_padding: (B, T) True for real prompt tokens, for prompts of different lengths padded on the left
        (`pad_rows`): padding is never attended to, and positions count from each row's first real token.
    eos_id: a row stops at its first EOS; its later positions are filled with `eos_id`. Decoding ends
        early once every row has stopped.
    source_ids / source_padding: encoder input (B, S) and its mask (True = real) for encoder-decoder models.
    use_cache: reuse keys/values of earlier positions (one new token per step); False recomputes the
        whole prefix each step. Both give the same tokens.
    between_tokens: called before each new token (a training run's stop check, which raises to end decoding).
    stopped: given the tokens so far (B, T), which rows need no more (B,) bool, e.g. a stop string was written;
        decoding ends early once every row has stopped, by EOS or by `stopped` (later tokens of a row that
        stopped this way are still argmax tokens: the caller cuts them).
    choose: the next token of each row (B,) from its logits (B, vocabulary) in place of the argmax (sampling).
    The model runs in eval mode; its previous mode is restored.
    """
    cfg = model.cfg
    if not model.spec.has_decoder:
        raise UsageError("greedy decoding needs a decoder: this model is encoder-only")
    if model.spec.seq2seq != (source_ids is not None):
        raise UsageError("pass source_ids for an encoder-decoder model, and only for one")
    if source_ids is not None and cfg.position in TABLE_POSITIONS and source_ids.shape[1] > cfg.max_seq_len:
        raise UsageError(f"the source has {source_ids.shape[1]} tokens but {cfg.position!r} positions stop at "
                         f"model.max_seq_len={cfg.max_seq_len}; shorten the source")
    if prompt_ids is None:  # start every row from BOS: one row, or one per source
        if bos_id is None:
            raise UsageError("pass prompt_ids, or bos_id to start every row from BOS")
        batch, device = (source_ids.shape[0], source_ids.device) if source_ids is not None else (1, _device(model))
        prompt_ids = torch.full((batch, 1), bos_id, dtype=torch.long, device=device)
    if prompt_ids.ndim != 2 or prompt_ids.shape[1] == 0:
        raise UsageError(f"prompt_ids must be (batch, length >= 1), got shape {tuple(prompt_ids.shape)}")
    if prompt_padding is not None:
        prompt_padding = prompt_padding.bool()
        if prompt_padding.shape != prompt_ids.shape or not prompt_padding[:, -1].all() or \
                (prompt_padding[:, :-1] & ~prompt_padding[:, 1:]).any():
            raise UsageError("prompt_padding must be prompt_ids' shape, True from each row's first real token to "
                             "its end (padding on the left only)")
    _check_length(cfg, prompt_ids.shape[1] if prompt_padding is None else int(prompt_padding.sum(1).max()),
                  max_new_tokens)

    was_training = model.training
    model.eval()
    try:
        with dropless(layer for _, layer in moe_layers(model)):  # generation is dropless: see `dropless`
            memory = memory_padding = None
            if source_ids is not None:
                memory, memory_padding = model.encode(source_ids, source_padding)
            tokens = prompt_ids
            finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
            eos_done = finished.clone()  # rows ended by EOS (filled with EOS after it), a part of `finished`
            cache = model.new_cache() if use_cache else None
            padding = prompt_padding
            positions = None if padding is None else (padding.long().cumsum(1) - 1).clamp(min=0)
            step_input, step_positions = tokens, positions
            for _ in range(max_new_tokens):
                if between_tokens is not None:
                    between_tokens()
                hidden = model.decode(step_input if use_cache else tokens, padding, memory=memory,
                                      memory_padding=memory_padding, cache=cache,
                                      position_ids=step_positions if use_cache else positions)
                logits = model.head(hidden[:, -1])
                next_token = logits.argmax(dim=-1) if choose is None else choose(logits)
                if eos_id is not None:
                    next_token = next_token.masked_fill(eos_done, eos_id)
                    eos_done |= next_token == eos_id
                    finished |= eos_done
                tokens = torch.cat([tokens, next_token[:, None]], dim=1)
                step_input = next_token[:, None]
                if padding is not None and positions is not None:  # the new token is real, one place after the last
                    padding = torch.cat([padding, padding.new_ones(padding.shape[0], 1)], dim=1)
                    step_positions = positions[:, -1:] + 1
                    positions = torch.cat([positions, step_positions], dim=1)
                if stopped is not None:
                    finished |= stopped(tokens)
                if (eos_id is not None or stopped is not None) and bool(finished.all()):
                    break
            return tokens
    finally:
        model.train(was_training)
