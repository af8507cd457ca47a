"""What a block component declares: `TokenMixer` (attention of some kind) and `ChannelMixer` (a feed-forward).

A block is a token mixer and a channel mixer, each behind its norms and residual (`model/layers.py`), plus a
cross-attention of the encoder memory in the decoder of a two-stack family. One subclass per kind declares, for its
config table: the module, its tensor-parallel styles, what it does under context parallel, its parameters, forward
FLOPs and saved activations, its initialisation and its generation cache. Everything else (the block, TP
application, FLOPs, the planner, config validation) asks these declarations and names no kind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar, Protocol

import torch
from torch import nn

from meshformer.model.config import ModelConfig

FP32 = 4
INDEX = 8  # int64 routing indices

InitFn = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


class ActivationLayout(Protocol):
    """What activation accounting reads of a micro-batch's layout (the planner's `ActivationShape`)."""

    @property
    def batch(self) -> int:  # sequences in one (pipeline) micro-batch
        ...

    @property
    def seq(self) -> int:  # this rank's tokens of each sequence (under context parallel, its two pieces)
        ...

    @property
    def tp(self) -> int:  # tensor-parallel ranks
        ...

    @property
    def bytes(self) -> int:  # element size of matmul/attention activations
        ...

    @property
    def residual_bytes(self) -> int:  # element size of the residual stream
        ...

    @property
    def blockwise(self) -> bool:  # attention runs the blockwise CPU kernel
        ...

    @property
    def cp(self) -> int:  # context-parallel ranks
        ...

    @property
    def masked(self) -> bool:  # self-attention gets a mask tensor
        ...

    @property
    def ep(self) -> int:  # expert-parallel ranks
        ...

    @property
    def moe_imbalance(self) -> float:  # rows an expert-parallel rank's experts receive over the balanced load
        ...

    @property
    def experts_loop(self) -> bool:  # experts back-propagate one at a time
        ...

    @property
    def ulysses(self) -> bool:  # context parallel by Ulysses (parallel.cp_method): head shards over whole sequences
        ...


class Carry:
    """What a block hands later blocks of one forward, by key (a dsa block's key selection for dsa_shared blocks).
    Not a dict: wrappers that rebuild a call's containers (FSDP's input casts) pass it on as it is."""

    def __init__(self) -> None:
        self.items: dict[object, object] = {}


class GenerationCache(Protocol):
    """A token mixer's state between generation steps (attention: the keys and values so far)."""

    @property
    def length(self) -> int:  # tokens it has seen
        ...


def local_tokens(x: ActivationLayout) -> int:
    """Tokens of each sequence between blocks on this rank (sequence parallel: a 1/tp slice)."""
    return x.seq // x.tp if x.tp > 1 else x.seq


def output_projection_bytes(cfg: ModelConfig, x: ActivationLayout) -> float:
    """An attention output projection's result before the reduce-scatter, and under sequence parallel its slice."""
    whole = x.batch * x.seq * cfg.d_model * x.bytes
    return whole + (x.batch * (x.seq // x.tp) * cfg.d_model * x.bytes if x.tp > 1 else 0)


class _Component:
    name: ClassVar[str]  # what model.layer_types / model.mlp_types call it
    section: ClassVar[str]  # the [model.<section>] table it reads
    selectable: ClassVar[bool] = True  # named in the config (cross-attention: added by the stack instead)
    # builds no module: a block of this kind holds no such sub-layer (no module, norm or residual branch); `none`
    empty: ClassVar[bool] = False
    # the options of its table (dotted: "mla.kv_lora_rank") a Hugging Face export of a model using it may write, for an
    # adapter whose `kinds` list it; an option nobody declares keeps the model from exporting
    # (checkpointing/hf_adapter.py's `undeclared_options`)
    exports: ClassVar[frozenset[str]] = frozenset()

    def check(self, cfg: ModelConfig) -> None:
        """Raise meshformer.errors.ConfigError when the config lacks what this kind needs (model.layer_types or
        model.mlp_types names it in a block)."""

    def tp_rules(self, cfg: ModelConfig) -> Mapping[str, str]:
        """Tensor-parallel style (model/families/spec.py names them) by path inside the module; "" is the module."""
        return {}

    def tp_divides(self, cfg: ModelConfig) -> list[tuple[str, int, str]]:
        """(config key, value, why) of the sizes tensor parallel splits: tp must divide each."""
        return []

    def context_parallel(self, cfg: ModelConfig) -> str | None:
        """None where each rank's pieces of the sequence can run this kind; else why not, in one clause."""
        return None

    def context_piece_multiple(self, cfg: ModelConfig) -> int:
        """Tokens each context-parallel piece of a sequence must hold a multiple of (1: any)."""
        return 1

    def tensor_parallel(self, cfg: ModelConfig) -> str | None:
        """None where tensor parallel splits this kind as `tp_rules` say; else why it cannot, in one clause."""
        return None

    def ulysses(self, cfg: ModelConfig, cp: int, tp: int) -> str | None:
        """None where Ulysses context parallel (parallel.cp_method="ulysses": an all-to-all from sequence shards to
        head shards around the mixer) can run this kind with cp ranks, each tensor-parallel rank's heads split
        again over cp; else why not, in one clause that names the fix."""
        return None

    def trains_only(self, cfg: ModelConfig) -> str | None:
        """A submodule name: while it is set, only the parameters of the modules so named train and every other
        parameter of the model is frozen (DSA's indexer warm-up); None: every parameter trains."""
        return None

    def init_rule(self, cfg: ModelConfig, name: str) -> InitFn | None:
        """The initialisation of the parameter `name` (inside the module) where it differs from the model's rules
        (model/init.py); None: those rules."""
        return None


class TokenMixer(_Component):
    """Mixes information across positions: one per block (model.layer_types), reading `[model.<section>]`."""

    section = "attention"
    blockwise_kernel: ClassVar[bool] = True  # runs model/blockwise_attention.py's CPU kernel where the backend picks it
    # MuonClip (optim.qk_clip_threshold) records and clips its heads' logits: its module has `max_logit`,
    # `record_max_logit` and `qk_clip_rows` (train/qk_clip.py)
    qk_clip: ClassVar[bool] = True
    # its module also takes `padding=` and `documents=`: this call's tokens' (B, T) padding (True: real) and packed
    # document ids, for a mixer that reads no mask (a recurrence)
    reads_padding_and_documents: ClassVar[bool] = False
    # its module also takes `carry=` (the `Carry` the blocks of one forward share, for what a block hands later blocks:
    # GLM-5's shared key selection) and `block=` (the block's index in its stack)
    reads_carry: ClassVar[bool] = False

    def build(self, cfg: ModelConfig, *, causal: bool) -> nn.Module:
        """The module, called by the block as `module(x, mask, rope=..., bias=..., cache=..., chunk=...)` on the
        normalised (B, T, D) input (cross-attention: `module(x, memory_mask, memory=..., cache=...)`): the mask and
        relative-position keywords of its place in the stack, its `new_cache()` state while generating, and this
        rank's `SequenceChunk` under context parallel; `padding=` and `documents=` too where the kind reads them.
        It returns (B, T, D)."""
        raise NotImplementedError

    def window(self, cfg: ModelConfig) -> int | None:
        """The sliding window of its mask (None: every key); blocks sharing a window share one mask."""
        return None

    def rotary_width(self, cfg: ModelConfig) -> int:
        """The per-head width RoPE rotates (model.position = "rope"); the model holds one rotary table for it. Here:
        the first rope.partial_factor of each attention head's dimensions (all of them by default)."""
        return int(cfg.attention_head_dim * cfg.rope.partial_factor)

    def params(self, cfg: ModelConfig) -> int:
        raise NotImplementedError

    def flops(self, cfg: ModelConfig, queries: int, keys: int, *, causal: bool) -> int:
        """Forward FLOPs over one sequence: `queries` positions reading `keys` (the memory's for cross-attention)."""
        raise NotImplementedError

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        """Bytes the module keeps for its backward (its norm, residual and dropout are the block's)."""
        raise NotImplementedError

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        """Bytes it keeps under selective recomputation (parallel/recompute.py): its matmul and kernel outputs, its
        output before and (tp > 1) after the reduce-scatter."""
        raise NotImplementedError

    def backward_bytes(self, cfg: ModelConfig, x: ActivationLayout, freed: float) -> float:
        """Gradients of its activations alive at once in its backward; `freed`: what the channel mixer's branch kept,
        already back-propagated and released by then."""
        raise NotImplementedError

    def new_cache(self) -> GenerationCache | None:
        """Its generation state (None: it keeps none and re-reads nothing)."""
        return None

    def cache_per_token(self, cfg: ModelConfig) -> int:
        """Elements its generation cache stores per token of one sequence."""
        return 0

    def ulysses(self, cfg: ModelConfig, cp: int, tp: int) -> str | None:
        # a token mixer is not split by heads unless its kind says how
        return "Ulysses context parallel does not split this kind's heads; use parallel.cp_method='allgather'"


class ChannelMixer(_Component):
    """Transforms each position on its own: one per block (model.mlp_types), reading `[model.<section>]`."""

    section = "ffn"
    expert_parallel: ClassVar[bool] = False  # holds experts that parallel.ep splits (model/moe.py's Experts)
    # its module also takes `token_ids=`: the (B, T) ids of the tokens it transforms (hash routing)
    reads_token_ids: ClassVar[bool] = False

    def build(self, cfg: ModelConfig) -> nn.Module:
        """The module, called by the block as `module(x)` on the normalised (B, T, D) input."""
        raise NotImplementedError

    def params(self, cfg: ModelConfig) -> tuple[int, int]:
        """(all, active) parameters; active: those one token uses."""
        raise NotImplementedError

    def flops(self, cfg: ModelConfig, tokens: int) -> int:
        """Forward FLOPs over `tokens` positions."""
        raise NotImplementedError

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        raise NotImplementedError

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        raise NotImplementedError

    def backward_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        raise NotImplementedError


def linear(n_in: int, n_out: int, bias: bool) -> int:
    """Parameters of an n_in -> n_out linear layer."""
    return n_in * n_out + (n_out if bias else 0)


Component = TokenMixer | ChannelMixer
__all__ = ["FP32", "INDEX", "ActivationLayout", "ChannelMixer", "Component", "GenerationCache", "InitFn", "TokenMixer",
           "linear",
           "local_tokens"]
