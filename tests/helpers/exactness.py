"""Architecture exactness against `transformers` (tests/unit/models/<arch>/): a padded batch, logits within 1e-4 at
its real tokens, state dicts round tripping bitwise both ways.

    ids, mask = padded_batch(vocab)
    got = assert_import_exact(hf, from_hf_model(hf).eval(), ids, mask)   # theirs -> ours
    assert_export_exact(perturbed_ours, ids, mask)                       # ours -> theirs -> ours
"""

from __future__ import annotations

import torch
from torch import nn

from meshformer.checkpointing.hf import from_hf_model, to_hf_model
from meshformer.model import Transformer


def padded_batch(vocab: int, length: int = 12, left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of `length` tokens: one whole, one right-padded after `length` - 4, and one left-padded over its
    first 5 (left=True: a recurrent block must start from an empty state after the padding) or right-padded after
    its first 4."""
    ids = torch.randint(0, vocab, (3, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, length, dtype=torch.long)
    mask[1, length - 4:] = 0
    if left:
        mask[2, :5] = 0
    else:
        mask[2, 4:] = 0
    return ids, mask


def assert_import_exact(hf: nn.Module, ours: Transformer, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`ours` (imported from `hf`) computes transformers' logits at the real tokens, and exports back to every one
    of `hf`'s tensors bitwise (transformers' in-memory layout). Returns our logits."""
    real = mask.bool()
    with torch.no_grad():
        expected, got = hf(input_ids=ids, attention_mask=mask).logits, ours(ids, real)
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-4)
    assert expected.std() > 0.1  # logits that vary: the comparison is not between near-constants
    back = to_hf_model(ours).state_dict()
    original = hf.state_dict()
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], v) for k, v in original.items())
    return got


def assert_export_exact(mine: Transformer, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """`mine` exported to transformers computes its logits at the real tokens and imports back with the same config
    and every tensor bitwise."""
    real = mask.bool()
    exported = to_hf_model(mine).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids, attention_mask=mask).logits[real], mine(ids, real)[real],
                                   rtol=0, atol=1e-4)
    again = from_hf_model(exported)
    assert again.cfg == mine.cfg
    assert all(torch.equal(v, mine.state_dict()[k]) for k, v in again.state_dict().items())
