"""The kda and mamba2 kinds' planner bytes under selective recomputation (`selective_bytes`) against what a
selectively checkpointed mixer keeps: parallel/recompute.py's policy through torch's selective checkpoint, the live
tensor storages (planner/measure.py's `LiveTensorBytes`) after its forward less before it, with the output dropped
and reference cycles collected, so that only the graph's cache counts (the parameters and the input are counted
before: the block's input is `block_selective`'s own term)."""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from meshformer.model.components import TOKEN_MIXERS
from meshformer.model.config import LinearAttentionConfig, MambaConfig, ModelConfig
from meshformer.model.kda import KimiDeltaAttention
from meshformer.model.mamba2 import Mamba2
from meshformer.parallel.recompute import _save_list, _selective_policy
from meshformer.planner.activations import ActivationShape
from meshformer.planner.measure import LiveTensorBytes

pytestmark = pytest.mark.usefixtures("one_thread")


def kept_bytes(module: torch.nn.Module, x: torch.Tensor, half: bool) -> int:
    context = functools.partial(create_selective_checkpoint_contexts, _selective_policy(_save_list()))
    with LiveTensorBytes(x, *module.parameters()) as live:
        before = live.live
        with torch.autocast("cpu", torch.bfloat16, enabled=half):  # its cache of cast weights is gone on exit
            out = checkpoint(module, x, use_reentrant=False, context_fn=context)
        loss = out.float().sum()  # keeps the graph, and its cache, alive
        del out
        gc.collect()
        kept = live.live - before - loss.untyped_storage().nbytes()
    assert loss.grad_fn is not None
    return kept


def kda(heads: int, dk: int, dv: int, chunk: int) -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=64, n_layers=1, layer_types=["kda"],
                       linear_attention=LinearAttentionConfig(n_heads=heads, key_head_dim=dk, value_head_dim=dv,
                                                              chunk_size=chunk))


def mamba2(heads: int, width: int, groups: int, size: int, chunk: int) -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=64, n_layers=1, layer_types=["mamba2"],
                       mamba=MambaConfig(n_heads=heads, head_dim=width, n_groups=groups, state_size=size,
                                         chunk_size=chunk))


CASES = [("kda", kda(4, 16, 32, 8), 1, 50), ("kda", kda(2, 32, 16, 32), 2, 300), ("kda", kda(4, 32, 32, 64), 1, 256),
         ("mamba2", mamba2(4, 16, 2, 8, 16), 1, 50), ("mamba2", mamba2(8, 8, 4, 16, 32), 2, 300),
         ("mamba2", mamba2(2, 32, 1, 16, 64), 1, 256)]


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize(("kind", "cfg", "batch", "seq"), CASES)
def test_selective_bytes_equal_what_the_checkpoint_keeps(kind: str, cfg: ModelConfig, batch: int, seq: int,
                                                         half: bool) -> None:
    torch.manual_seed(0)
    module = KimiDeltaAttention(cfg) if kind == "kda" else Mamba2(cfg)
    x = torch.randn(batch, seq, cfg.d_model).requires_grad_()
    kept = kept_bytes(module, x, half)
    layout = ActivationShape(batch, seq, 1, 2 if half else 4, 4)
    predicted = TOKEN_MIXERS[kind].selective_bytes(cfg, layout, memory_len=0, causal=True)
    assert abs(predicted / kept - 1) < 0.02, (predicted, kept)
