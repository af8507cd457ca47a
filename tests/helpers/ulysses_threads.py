"""Ulysses context parallel in one process: cp ranks as threads whose `exchange` is an all-to-all among them."""

from __future__ import annotations

import threading

import torch

from meshformer.model.attention import SequenceChunk


def run_ranks(count: int, work) -> list:  # type: ignore[no-untyped-def]
    """work(chunk) on `count` threads, each a rank whose `exchange` is an all-to-all among the threads."""
    slots: list[torch.Tensor | None] = [None] * count
    barrier = threading.Barrier(count)
    results: list = [None] * count

    def rank(index: int) -> None:
        def exchange(t: torch.Tensor) -> torch.Tensor:
            slots[index] = t
            barrier.wait()
            out = torch.stack([slots[r][index] for r in range(count)])  # type: ignore[index]
            barrier.wait()  # every rank has read before the next exchange overwrites
            return out

        results[index] = work(SequenceChunk(index, count, lambda t: t, exchange))

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
