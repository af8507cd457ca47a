"""`FamilySpec`: everything the rest of meshformer needs to know about one model family, in one place.

A family says which layer stacks it has and how deep the config makes them, how it trains (objectives),
what else it asks of a config, how it initialises, how a pipeline splits it, how tensor parallelism shards
it, how its weights are named by other implementations, and how many FLOPs it costs. `config/`, `parallel/`,
`checkpointing/` and `train/` apply what a spec declares and name no family and no module inside a block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from meshformer.model.config import ModelConfig
from meshformer.model.families.naming import MegatronNames, Rule
from meshformer.model.tp_styles import (  # noqa: F401  (re-exported: the rules name them through this module)
    COLWISE,
    GATHER,
    GATHER_MASKED,
    GATHER_MEMORY,
    HEAD_VALUES,
    HEADS,
    ROWWISE,
    SEQUENCE,
    TOKENS,
    VOCAB_COLUMNS,
    VOCAB_ROWS,
)

if TYPE_CHECKING:  # the Transformer is built from a spec, so it is imported for the type hints only
    from meshformer.model.transformer import Transformer

RulesFn = Callable[[ModelConfig], list[Rule]]


@dataclass(frozen=True)
class Stack:
    """One stack of blocks: held in `<name>_layers` (a ModuleDict "0", "1", ...) with final norm `<name>_norm`."""

    name: str  # "encoder" or "decoder": the Transformer's attributes that hold it
    causal: bool
    count: Callable[[ModelConfig], int]  # how many blocks the config asks for
    depth_key: str  # the [model] key(s) `count` reads, named when the depth is not positive
    cross: bool = False  # blocks cross-attend the encoder's output

    @property
    def layers(self) -> str:
        return f"{self.name}_layers"

    @property
    def norm(self) -> str:
        return f"{self.name}_norm"

    @property
    def merge(self) -> str:
        """The residual kind's merge of the stream before the final norm (model/residual.py; None for a plain one)."""
        return f"{self.name}_merge"


@dataclass(frozen=True)
class StagePieces:
    """Which model pieces (top-level attributes) a pipeline stage holds besides its range of blocks.

    Each stack's final norm goes with the stack's last block.
    """

    first: tuple[str, ...]  # the first stage: everything that embeds
    every: tuple[str, ...]  # every stage: parameter-free helpers rebuilt locally
    last: tuple[str, ...]  # the last stage: the head


@dataclass(frozen=True)
class TensorParallelRules:
    """Tensor-parallel styles by module path; paths a model (or stage) lacks are skipped. The mixers inside a block
    add their own (`TransformerBlock.mixers`, model/components/)."""

    top: Mapping[str, str]  # top-level attribute -> style
    block: Mapping[str, str]  # path inside every block -> style


@dataclass(frozen=True)
class FamilySpec:
    name: str
    stacks: tuple[Stack, ...]  # in execution order
    objectives: tuple[str, ...]  # train.objective values that fit; the first is what "auto" picks
    init: Callable[[Transformer], None]  # draws every weight of a freshly built model
    pipeline: StagePieces
    tp_rules: TensorParallelRules
    training_flops: Callable[[ModelConfig, int, int | None], int]  # (cfg, seq_len, target_len) -> FLOPs
    name_maps: Mapping[str, RulesFn]  # foreign implementation -> weight-name rules (checkpointing/mapping.py)
    megatron: MegatronNames | None = None  # how our weights map to a Megatron-Core model, if they do
    # What else the family asks of the [model] section (config validation runs it after the generic checks,
    # before any work): raise meshformer.errors.ConfigError naming the key and the fix.
    check: Callable[[ModelConfig], None] | None = None

    @property
    def has_encoder(self) -> bool:
        return any(not s.causal for s in self.stacks)

    @property
    def has_decoder(self) -> bool:
        return any(s.causal for s in self.stacks)

    @property
    def seq2seq(self) -> bool:
        """Source and target are separate streams (decoder_input_ids / decoder_attention_mask)."""
        return any(s.cross for s in self.stacks)

    def depth(self, cfg: ModelConfig, stack: str) -> int:
        """Blocks in the stack called `stack` ("encoder" / "decoder"); 0 if the family has none."""
        return sum(s.count(cfg) for s in self.stacks if s.name == stack)

    def total_layers(self, cfg: ModelConfig) -> int:
        return sum(s.count(cfg) for s in self.stacks)

    def layer_offsets(self, cfg: ModelConfig) -> dict[str, int]:
        """Each stack's attribute -> the global execution index of its first block."""
        offsets, offset = {}, 0
        for stack in self.stacks:
            offsets[stack.layers] = offset
            offset += stack.count(cfg)
        return offsets

    def blocks(self, model: Transformer) -> list[tuple[int, nn.Module]]:
        """(global execution index, block) for the blocks `model` holds: the FSDP and recompute units."""
        out: list[tuple[int, nn.Module]] = []
        for name, offset in self.layer_offsets(model.cfg).items():
            layers = getattr(model, name, None)
            if layers is not None:
                out.extend((offset + int(key), block) for key, block in layers.items())
        return out
