"""All-gather context parallel in one process: cp ranks as threads whose `gather` concatenates every rank's tensor
along dim 2 in rank order, and with `ulysses` whose `exchange` hands slice r of dim 0 to rank r (no autograd across
ranks: forward checks and saved-bytes measurements)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from meshformer.model.attention import SequenceChunk


def run_ranks(count: int, work: Callable[[SequenceChunk], Any], ulysses: bool = False) -> list:
    """work(chunk) on `count` threads, each a rank whose `gather` all-gathers among the threads (and with `ulysses`
    whose `exchange` is an all-to-all among them); an error on any rank is raised here."""
    slots: list[torch.Tensor | None] = [None] * count
    barrier = threading.Barrier(count)
    results: list = [None] * count

    def rank(index: int) -> None:
        def gather(t: torch.Tensor) -> torch.Tensor:
            slots[index] = t
            barrier.wait()
            every = torch.cat(slots, dim=2)  # type: ignore[arg-type]
            barrier.wait()  # every rank has read before the next gather overwrites
            return every

        def exchange(t: torch.Tensor) -> torch.Tensor:
            slots[index] = t
            barrier.wait()
            mine = torch.cat([s.chunk(count)[index] for s in slots])  # type: ignore[union-attr]
            barrier.wait()
            return mine

        try:
            results[index] = work(SequenceChunk(index, count, gather, exchange if ulysses else None))
        except Exception as error:  # the others, waiting at the barrier, stop too
            results[index] = error
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors := [r for r in results if isinstance(r, Exception) and not isinstance(r, threading.BrokenBarrierError)]:
        raise errors[0]
    return results


def pieces(x: torch.Tensor, chunk: SequenceChunk) -> torch.Tensor:
    """This rank's two pieces of x (B, T, ...) (`parallel.context.sequence_chunk`'s split)."""
    parts = x.chunk(2 * chunk.count, dim=1)
    return torch.cat([parts[chunk.index], parts[2 * chunk.count - 1 - chunk.index]], dim=1)


def in_order(outputs: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's (B, 2 pieces, ...) outputs put back in sequence order."""
    count = len(outputs)
    halves = [o.chunk(2, dim=1) for o in outputs]
    return torch.cat([halves[p][0] if p < count else halves[2 * count - 1 - p][1] for p in range(2 * count)], dim=1)
