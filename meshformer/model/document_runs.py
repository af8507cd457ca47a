"""A batch's runs of one document's real tokens over the whole sequence (B, T), read from its padding and its
documents: context parallel pieces hold parts of runs that start elsewhere, so DeepSeek-V4's attention
(model/compressed_attention.py) rotates each token by its place in its run, reads only its run's keys, and pools its
run's compression windows (`Runs.windows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def segments(padding: torch.Tensor | None, documents: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, first tokens, lengths) of each run of a row's real tokens within one document."""
    if padding is not None:
        real = padding.bool()
    elif documents is not None:
        real = torch.ones_like(documents, dtype=torch.bool)
    else:
        raise ValueError("runs are read from padding or documents")
    doc = torch.zeros_like(real, dtype=torch.long) if documents is None else documents
    after = torch.ones_like(real[:, :1])
    starts = real & torch.cat([after, ~real[:, :-1] | (doc[:, 1:] != doc[:, :-1])], 1)
    ends = real & torch.cat([~real[:, 1:] | (doc[:, 1:] != doc[:, :-1]), after], 1)
    rows, firsts = starts.nonzero(as_tuple=True)
    return rows, firsts, ends.nonzero(as_tuple=True)[1] - firsts + 1


@dataclass
class Windows:
    """Every compression window of `rate` tokens of a batch's runs (`Runs.windows`), in row and sequence order:
    its row, its first token's place in the sequence, its place in its run (w: the entry's rotary position is w x
    rate; w > 0: CSA reads the previous window's first halves), its entry's slot among its row's entries; and per
    row's entry slot (B, W) the run it belongs to (-1: no entry) and its window's last token's place."""

    rate: int
    rows: torch.Tensor
    starts: torch.Tensor
    index: torch.Tensor
    slots: torch.Tensor
    run: torch.Tensor
    ends: torch.Tensor
    counts: torch.Tensor  # (R,) each run's entries
    first: torch.Tensor  # (R,) the slot of each run's first entry (0 where it has none)


class Runs:
    """A batch's runs of one document's real tokens over the whole sequence (B, T), for context parallel pieces
    that hold parts of runs starting elsewhere: each token's run (-1: a pad) and its position in the run."""

    def __init__(self, padding: torch.Tensor | None, documents: torch.Tensor | None) -> None:
        self.rows, self.firsts, self.lengths = segments(padding, documents)
        shape = (padding if padding is not None else documents).shape  # type: ignore[union-attr]
        device = self.rows.device
        ids = torch.arange(len(self.rows), device=device)
        # token k of run r: offset k from its first token
        offsets = torch.arange(int(self.lengths.sum()), device=device) - (
            self.lengths.cumsum(0) - self.lengths).repeat_interleave(self.lengths)
        cols = self.firsts.repeat_interleave(self.lengths) + offsets
        rows = self.rows.repeat_interleave(self.lengths)
        self.run = torch.full(shape, -1, dtype=torch.long, device=device).index_put((rows, cols),
                                                                                  ids.repeat_interleave(self.lengths))
        self.pos = torch.zeros(shape, dtype=torch.long, device=device).index_put((rows, cols), offsets)
        self._windows: dict[int, Windows] = {}

    def windows(self, rate: int) -> Windows:
        if rate not in self._windows:
            counts = self.lengths // rate  # a run's trailing partial window has no entry
            index = torch.arange(int(counts.sum()), device=counts.device) - (
                counts.cumsum(0) - counts).repeat_interleave(counts)
            runs = torch.arange(len(counts), device=counts.device).repeat_interleave(counts)
            rows = self.rows[runs]
            per_row = torch.zeros(self.run.shape[0], dtype=torch.long, device=counts.device).index_add(0, rows,
                                                                                                      torch.ones_like(rows))
            slots = torch.arange(len(rows), device=counts.device) - (per_row.cumsum(0) - per_row)[rows]
            starts = self.firsts[runs] + index * rate
            width = int(per_row.max()) if len(rows) else 0
            run = torch.full((self.run.shape[0], width), -1, dtype=torch.long, device=counts.device)
            # a slot without an entry ends past every query
            ends = torch.full_like(run, self.run.shape[1])
            first = torch.zeros_like(counts).index_put((runs[index == 0],), slots[index == 0])
            self._windows[rate] = Windows(rate, rows, starts, index, slots, run.index_put((rows, slots), runs),
                                           ends.index_put((rows, slots), starts + rate - 1), counts, first)
        return self._windows[rate]


__all__ = ["Runs", "Windows", "segments"]
