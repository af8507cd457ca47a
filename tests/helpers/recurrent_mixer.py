"""Checks every recurrent token mixer (gated delta, KDA, Mamba-2: test_linear_attention, test_kda, test_mamba2)
passes the same way: against its transformers layer on a padded batch and through transformers' cache, packed
documents as if one by one, context-parallel pieces as the whole sequence, gradients into every parameter.

    mine, theirs = pair()                 # the test file's block and transformers' layer, same weights
    assert_matches_transformers_on_a_padded_batch(mine, theirs, D)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshformer.model.linear_attention import LinearCache


def assert_matches_transformers_on_a_padded_batch(mine: nn.Module, theirs: Any, width: int) -> None:
    """3 rows of 11 tokens, one left-padded over 4, one right-padded after 7: equal at the real tokens."""
    x = torch.randn(3, 11, width)
    padding = torch.ones(3, 11, dtype=torch.bool)
    padding[1, :4] = False  # left padding
    padding[2, 7:] = False  # right padding
    with torch.no_grad():
        expected = theirs(x, attention_mask=padding.long())
        got = mine(x, padding=padding)
    real = padding[..., None].expand_as(got)
    assert expected[real].std() > 0.01  # outputs that vary: the comparison is not between near-constants
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


def assert_cached_steps_match_transformers(mine: nn.Module, theirs: Any, cache_hf: Any, width: int,
                                           against_whole: bool = True) -> LinearCache:
    """A prefill of 6 tokens and 3 single steps through our cache equal transformers' through `cache_hf` (and, with
    `against_whole`, our whole sequence at once). Returns our cache after the 9 tokens."""
    x = torch.randn(2, 9, width)
    cache = LinearCache()
    with torch.no_grad():
        expected = [theirs(x[:, :6], cache=cache_hf)]
        got = [mine(x[:, :6], cache=cache)]
        for t in range(6, 9):
            expected.append(theirs(x[:, t:t + 1], cache=cache_hf))
            got.append(mine(x[:, t:t + 1], cache=cache))
        whole = mine(x) if against_whole else None
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(expected, 1), atol=1e-5, rtol=1e-5)
    if whole is not None:
        torch.testing.assert_close(torch.cat(got, 1), whole, atol=1e-5, rtol=1e-5)
    assert cache.length == 9 and cache.state is not None and cache.conv is not None
    return cache


def assert_packed_documents_equal_one_by_one(mine: nn.Module, width: int) -> None:
    """Documents of 5, 1, 7 and 3 tokens in one row equal each run alone; without the resets the later documents
    would see the earlier ones."""
    lengths = [5, 1, 7, 3]
    x = torch.randn(1, sum(lengths), width)
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = mine(x, documents=documents)
        alone = torch.cat([mine(part) for part in x.split(lengths, dim=1)], dim=1)
        crossing = mine(x)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    assert (crossing[:, lengths[0]:] - alone[:, lengths[0]:]).abs().max() > 1e-3


def assert_context_parallel_pieces_equal_the_whole(mine: nn.Module, lengths: list[int], width: int) -> None:
    """One rank holding both pieces (cp's layout at count 1: the gather is the identity): values and the gradients
    into the input and every parameter equal the whole sequence's."""
    from meshformer.model.attention import SequenceChunk

    x = torch.randn(2, sum(lengths), width, requires_grad=True)
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None].expand(2, -1)
    whole = mine(x, documents=documents)
    weights = torch.randn_like(whole)
    expected = torch.autograd.grad((whole * weights).sum(), [x, *mine.parameters()])
    pieces = mine(x, documents=documents, chunk=SequenceChunk(0, 1, lambda t: t))
    got = torch.autograd.grad((pieces * weights).sum(), [x, *mine.parameters()])
    torch.testing.assert_close(pieces, whole, atol=1e-6, rtol=1e-6)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def assert_gradients_reach_every_parameter(mine: nn.Module, width: int) -> None:
    mine.train()
    mine(torch.randn(2, 7, width)).square().sum().backward()
    for name, p in mine.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
