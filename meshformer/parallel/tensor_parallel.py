"""Tensor + sequence parallel through DTensor plans: applies the family spec's `tp_rules` (model/families/) and
those of the block components (model/components/).

Layout of the activations (tp ranks, sequence T, hidden D):
- embeddings: vocabulary-sharded tables; their output is all-reduced to a replicated (B, T, D) so that
  position embeddings, the embedding norm and dropout run unchanged on full sequences;
- the first block of each stack slices the sequence (no communication): between blocks the residual stream
  is a plain local tensor (B, T/tp, D), and norms / dropout / residual adds run sequence-parallel;
- attention and MLP all-gather the sequence on entry (their input projections colwise: each rank owns whole
  heads / a slice of d_ff) and reduce-scatter it on exit (output projections rowwise);
- each stack ends by all-gathering its output (after the final norm, or after the last block when there is
  none), so encoder memory is replicated for cross-attention pooling and every decoder layer, and the head
  sees full sequences;
- the output projection is vocabulary-sharded and stays sharded: `vocab_parallel_cross_entropy` never
  materialises full-vocabulary logits;
- attention sinks (one logit per head) are split with the heads; a replicated tensor only this rank's heads
  read (multi-head latent attention's shared rotary key) has its gradient summed over the ranks;
- a Gated DeltaNet (linear_attention) splits by key head: its head-major projections colwise, its per-head
  A_log / dt_bias on dim 0; weights over its [all q | all k | all v] channels (the convolution, Qwen3.5's
  in_proj_qkv) and its gated norm's weight stay whole, each rank reading its heads' rows and the gradients summed
  over the ranks (the module says which: `shard_heads`);
- mHC's residual (model/residual.py): between blocks each rank holds its tokens' n streams (B, T/tp, n, D); the
  joins' and the merge's mixing weights are replicated, their gradients summed over the ranks (`token_share`);
- multi-token prediction modules take the main stack's sequence slices (under mHC its n streams) and the tokens
  ahead sliced alike; their small projections run sequence-parallel on replicated weights, their block is split as
  the main ones, an mHC module's merge is `token_share`, and their final norm gathers the sequence for the head;
- a QK-norm over the whole projection (OLMo 2) holds its heads' slice of the weight and sums the mean square
  over the tensor-parallel ranks (one all-reduce of a (B, T, 1) tensor per norm).

Parameters that are not split (position tables, embedding norm, BERT head transform) only ever see
replicated activations and replicated gradients, so they stay plain tensors and need no extra reduction.

With train.fp8 the block linears are torchao `Float8Linear`s before this runs. Under the tensorwise recipe they
get torchao's float8 styles: activations are cast to float8 *before* the sequence all-gather (half the bytes of
bf16; one cast serves q/k/v or gate/up) and output gradients before theirs, with each scale taken over the whole
tensor (an all-reduced amax), so the numbers equal the unsharded model's. Rowwise scales do not survive that
all-gather, so the rowwise recipe keeps the ordinary styles (gathers in high precision, each linear casts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshformer.config import ModelConfig
from meshformer.model import Transformer
from meshformer.model import tp_styles as styles
from meshformer.model.components import component
from meshformer.model.families.spec import TensorParallelRules
from meshformer.model.residual import residual_kind


class _EmbeddingParallel(RowwiseParallel):
    """The vocabulary-sharded embedding, its output all-reduced before it leaves the module. torch's style leaves an
    asynchronous AsyncCollectiveTensor, and a compiled block that takes one as its input (block 0 under per-block
    torch.compile, torch 2.13) cuts the embedding off the backward: no gradient reaches it through the blocks."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # type: ignore[override]
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


class _HeadValues(ParallelStyle):
    """A module holding one value per attention head (AttentionSinks): its parameters split on dim 0 with the heads
    (whole heads per rank, as colwise q/k/v), its output this rank's local values. Each rank attends over whole
    sequences with its own heads, so their gradients are complete where they live."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(_name: str, sub: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(sub.named_parameters(recurse=False)):
                split = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)
                sub.register_parameter(pname, nn.Parameter(split, param.requires_grad))

        return distribute_module(module, device_mesh, partition, output_fn=_local_outputs)  # type: ignore[arg-type]


def _summed(x: torch.Tensor, group) -> torch.Tensor:
    """`x` summed over the group, in a copy: the caller's tensor (an autograd input or gradient) may be shared.
    The plain collective on a copy is what torch.distributed.nn's deprecated all_reduce does, without its warning."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


class _SumGradient(torch.autograd.Function):
    """Identity forward; the backward all-reduces the gradient over the group (each rank's holds its heads' share)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _summed(grad, ctx.group), None


class _AllReduceSum(torch.autograd.Function):
    """The sum over the group; its gradient is the gradients' sum over the group (every rank's output used them)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _summed(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _summed(grad, ctx.group), None


class _PartialGradient(ParallelStyle):
    """A module whose first input is replicated but read by this rank's heads alone: the input's gradient is summed
    over the ranks (identity forward)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def summed(_module: nn.Module, args: tuple) -> tuple:
            return (_SumGradient.apply(args[0], group), *args[1:])

        module.register_forward_pre_hook(summed)
        return module


class _TokenShare(ParallelStyle):
    """A module of this rank's tokens that reads its own parameters through `read_parameter` (mHC's joins): they
    become Replicate DTensors, read as local tensors whose gradients (each rank's tokens' share) are summed over the
    ranks. Its inputs and outputs stay plain local tensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        for pname, param in list(module.named_parameters(recurse=False)):
            placed = DTensor.from_local(param.data, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(pname, nn.Parameter(placed, param.requires_grad))

        def read(p: torch.Tensor) -> torch.Tensor:
            return _SumGradient.apply(p.to_local() if isinstance(p, DTensor) else p, group)

        setattr(module, "read_parameter", read)  # noqa: B010 (an instance attribute over the method)
        return module


class _HeadSharded(Protocol):
    def shard_heads(self, ranks: int, rank: int, sum_gradient: Callable[[torch.Tensor], torch.Tensor]
                    ) -> tuple[list[str], list[str]]: ...


class _HeadShard(ParallelStyle):
    """A module that takes its heads' share itself (`shard_heads`): the parameters it names split on dim 0 (whole
    heads per rank), those it keeps whole replicated with their gradients summed over the ranks in its forward.
    Its first input is all-gathered from the sequence slices to a plain tensor: the colwise linears that read it
    all-reduce its gradient. A module with a `sum_heads` attribute (V4 attention: its indexer loss's target) gets
    the sum over the ranks of a detached tensor there."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        split, whole = cast(_HeadSharded, module).shard_heads(
            device_mesh.size(), device_mesh.get_local_rank(), lambda t: _SumGradient.apply(t, group))
        if hasattr(module, "sum_heads"):
            setattr(module, "sum_heads", lambda t: _summed(t.detach(), group))  # noqa: B010 (a callable attribute)
        for name in split + whole:
            owner_path, _, pname = name.rpartition(".")
            owner = module.get_submodule(owner_path)
            param = getattr(owner, pname)
            placed = (distribute_tensor(param.data, device_mesh, [Shard(0)], src_data_rank=None) if name in split
                      else DTensor.from_local(param.data, device_mesh, [Replicate()], run_check=False))
            owner.register_parameter(pname, nn.Parameter(placed, param.requires_grad))
        gather = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                    use_local_output=True)
        return gather._apply(module, device_mesh)


# Each style the family specs may name, as DTensor layouts. Vocabulary-sharded logits are kept local: the loss
# is computed vocab-parallel.
_STYLES = {
    styles.VOCAB_ROWS: lambda: _EmbeddingParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    styles.VOCAB_COLUMNS: lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                                  use_local_output=True),
    styles.SEQUENCE: lambda: SequenceParallel(use_local_output=True),
    styles.TOKENS: lambda: SequenceParallel(sequence_dim=0, use_local_output=True),
    styles.HEADS: lambda: SequenceParallel(sequence_dim=1, use_local_output=True),
    styles.HEAD_VALUES: _HeadValues,
    styles.GATHER: lambda: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    styles.GATHER_MASKED: lambda: PrepareModuleInput(input_layouts=(Shard(1), None),
                                                     desired_input_layouts=(Replicate(), None)),
    styles.GATHER_MEMORY: lambda: PrepareModuleInput(
        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"memory": Replicate()}, desired_input_kwarg_layouts={"memory": Replicate()}),
    styles.COLWISE: ColwiseParallel,
    styles.ROWWISE: lambda: RowwiseParallel(output_layouts=Shard(1)),
    styles.PARTIAL_GRADIENT: _PartialGradient,
    styles.HEAD_SHARD: _HeadShard,
    styles.TOKEN_SHARE: _TokenShare,
    # Replicate to Shard(1): each rank keeps its slice of the ids, no communication
    styles.TOKEN_IDS: lambda: PrepareModuleInput(input_kwarg_layouts={"token_ids": Replicate()},
                                                 desired_input_kwarg_layouts={"token_ids": Shard(1)},
                                                 use_local_output=True),
}


def apply_tensor_parallel(model: Transformer, mesh: DeviceMesh, *, float8_gather: bool = False) -> nn.Module:
    """Parallelise a Transformer (or a pipeline stage of one: absent pieces are skipped) in place.

    `float8_gather`: the tensorwise FP8 recipe, whose block linears take torchao's float8 styles.
    """
    cfg: ModelConfig = model.cfg
    spec = model.spec
    tp, rank = mesh.size(), mesh.get_local_rank()
    # torch's styles re-create the parameters they place as trainable: frozen ones (a DSA warm-up) stay frozen
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    _shard_alibi_slopes(model, cfg, tp, rank)
    parallelize_module(model, mesh, _plan(model, spec.tp_rules.top))
    _retie(model, cfg)

    style = residual_kind(cfg).tp_style  # the residual's joins and merges (mHC's mixing weights)
    for stack in spec.stacks:
        layers = getattr(model, stack.layers, None)
        if layers is None:
            continue
        for key, block in layers.items():
            parallelize_module(block, mesh, _plan(block, _block_rules(block, cfg, spec.tp_rules), float8_gather))
            _local_buffers(block)
            _split_projection_norms(block, cfg, mesh)
            if key == "0":  # enter sequence parallel: slice the replicated embedding output
                parallelize_module(block, mesh, PrepareModuleInput(
                    input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None), use_local_output=True))
        final_norm = getattr(model, stack.norm, None)
        merge = getattr(model, stack.merge, None)
        if merge is not None and style is not None and final_norm is not None:  # on this rank's tokens, as the norm
            parallelize_module(merge, mesh, _STYLES[style]())
        last = str(stack.count(cfg) - 1)
        if final_norm is not None:
            parallelize_module(final_norm, mesh, SequenceParallel(use_local_output=True))
            _gather_sequence(final_norm, mesh)
        elif last in layers:
            _gather_sequence(layers[last], mesh)
    for module in getattr(model, "mtp_layers", None) or ():
        _parallelize_mtp_module(module, mesh, cfg, spec.tp_rules, float8_gather)
    _replicate_rest(model, mesh)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return model


def _parallelize_mtp_module(module: nn.Module, mesh: DeviceMesh, cfg: ModelConfig, rules: TensorParallelRules,
                            float8_gather: bool) -> None:
    """A multi-token prediction module (model/mtp.py) in the main blocks' layout: it takes the last main block's
    sequence-sharded output (under mHC its n streams, (B, T/tp, n, D)) and the replicated embedding of the tokens
    ahead, sliced to this rank's part of the sequence (no communication, as the first block slices its input); its
    block takes the model's block rules, mHC's merge of its streams the residual's style (on this rank's tokens, as
    the stack's merge), and its final norm gathers the sequence for the shared vocabulary-parallel head, as the
    stack's final norm does."""
    parallelize_module(module, mesh, PrepareModuleInput(
        input_layouts=(Shard(1), Replicate(), None), desired_input_layouts=(Shard(1), Shard(1), None),
        use_local_output=True))
    # The norms and projections (eh_proj; under mHC h_proj and e_proj, its two halves) run sequence-parallel on
    # replicated weights, their gradients summed over the ranks. They stay whole: they are small beside the block,
    # and sharding them column-wise would need the sequence gathered before them and their output's features
    # scattered back to sequence shards for the residual.
    for name in ("enorm", "hnorm", "eh_proj", "h_proj", "e_proj"):
        if hasattr(module, name):
            parallelize_module(module.get_submodule(name), mesh, SequenceParallel(use_local_output=True))
    block = module.get_submodule("block")
    parallelize_module(block, mesh, _plan(block, _block_rules(block, cfg, rules), float8_gather))
    _local_buffers(block)
    _split_projection_norms(block, cfg, mesh)
    style = residual_kind(cfg).tp_style
    merge = getattr(module, "merge", None)
    if merge is not None and style is not None:
        parallelize_module(merge, mesh, _STYLES[style]())
    final_norm = module.get_submodule("final_norm")
    parallelize_module(final_norm, mesh, SequenceParallel(use_local_output=True))
    _gather_sequence(final_norm, mesh)


def _block_rules(block: nn.Module, cfg: ModelConfig, rules: TensorParallelRules) -> Mapping[str, str]:
    """The family's block rules and those each mixer's kind declares, under the attribute that holds it."""
    out = dict(rules.block)
    if (style := residual_kind(cfg).tp_style) is not None:
        out |= {join: style for join in ("attn_residual", "cross_residual", "ffn_residual")}
    for attribute, name in getattr(block, "mixers", {}).items():
        for path, style in component(name).tp_rules(cfg).items():
            out[f"{attribute}.{path}" if path else attribute] = style
    return out


class HeadShardedRMSNorm(nn.Module):
    """RMSNorm over a width the tensor-parallel ranks split by heads (OLMo 2's QK-norm over a whole projection):
    this rank's slice of the weight (a Shard(0) DTensor) and the mean square summed over the ranks."""

    def __init__(self, norm: nn.RMSNorm, mesh: DeviceMesh) -> None:
        super().__init__()
        self.width, self.eps = norm.normalized_shape[0], norm.eps
        self.offset = getattr(norm, "offset", 0.0)  # Gemma's (1 + weight) scale
        self.group = mesh.get_group()
        whole = (norm.weight.to_local() if isinstance(norm.weight, DTensor) else norm.weight).detach()  # replicated
        self.weight = nn.Parameter(distribute_tensor(whole, mesh, [Shard(0)]), norm.weight.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = _AllReduceSum.apply(x.float().pow(2).sum(-1, keepdim=True), self.group)  # backward: summed
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        normed = (x.float() * torch.rsqrt(squares / self.width + eps)).type_as(x)
        return normed * (self.weight.to_local() + self.offset)  # type: ignore[attr-defined]


def _split_projection_norms(block: nn.Module, cfg: ModelConfig, mesh: DeviceMesh) -> None:
    if not cfg.attention.qk_norm or cfg.attention.qk_norm_scope != "projection":
        return
    for attention in (m for m in block.modules() if hasattr(m, "qk_norm_scope")):
        for name in ("q_norm", "k_norm"):
            setattr(attention, name, HeadShardedRMSNorm(getattr(attention, name), mesh))


def _local_buffers(module: nn.Module) -> None:
    """torch's styles replicate a module's buffers as well; a router's selection bias and load counts are updated
    in place from global loads, identical on every rank, so they stay plain tensors."""
    for sub in module.modules():
        for name, buffer in list(sub.named_buffers(recurse=False)):
            if isinstance(buffer, DTensor):
                sub.register_buffer(name, buffer.to_local(), persistent=name not in sub._non_persistent_buffers_set)


def _plan(module: nn.Module, styles_by_path: Mapping[str, str], float8_gather: bool = False
          ) -> dict[str, ParallelStyle]:
    """The DTensor styles of the paths `module` has (a stage lacks pieces, a block without SwiGLU its gate)."""
    plan: dict[str, ParallelStyle] = {}
    float8_styles = _float8_styles() if float8_gather else {}
    for path, style in styles_by_path.items():
        try:
            target = module.get_submodule(path)
        except AttributeError:  # absent, or None
            continue
        plan[path] = float8_styles[style]() if style in float8_styles and _all_float8(target) else _STYLES[style]()
    return plan


def _float8_styles() -> dict[str, Callable[[], ParallelStyle]]:
    """torchao's float8 counterparts of the block styles (tensorwise scaling only)."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return {
        styles.COLWISE: Float8ColwiseParallel,
        styles.ROWWISE: lambda: Float8RowwiseParallel(output_layouts=Shard(1)),
        styles.GATHER: lambda: PrepareFloat8ModuleInput(input_layouts=(Shard(1),),
                                                        desired_input_layouts=(Replicate(),)),
        styles.GATHER_MASKED: lambda: PrepareFloat8ModuleInput(input_layouts=(Shard(1), None),
                                                               desired_input_layouts=(Replicate(), None)),
        # cross-attention keeps GATHER_MEMORY: the memory is no block linear's alone to cast
    }


def _all_float8(module: nn.Module) -> bool:
    """Whether every linear in `module` is a Float8Linear (a float8-cast input may only meet those), and a linear
    itself has no bias: torchao's linear styles cast the output gradient before the bias sees it, so a bias would
    get a float8-rounded gradient that the unsharded Float8Linear does not give it."""
    from torchao.float8.float8_linear import Float8Linear

    if isinstance(module, nn.Linear) and module.bias is not None:
        return False
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return bool(linears) and all(isinstance(m, Float8Linear) for m in linears)


def _gather_sequence(module: nn.Module, mesh: DeviceMesh) -> None:
    """Leave sequence parallel after `module`: all-gather its (B, T/tp, D) output to a replicated local tensor."""
    parallelize_module(module, mesh, PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))


def _replicate_rest(model: nn.Module, mesh: DeviceMesh) -> None:
    """Parameters left unsplit (position table, embedding norm, head transform) become Replicate DTensors.

    They only see replicated activations, so their gradients are already complete on every rank; making them
    DTensors keeps one tensor kind in the model, which foreach/fused optimizers and FSDP's 2-D sharding need.
    Their module converts plain inputs to replicated DTensors and hands back local outputs.
    """
    for module in model.modules():
        own = [n for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        if not own:
            continue

        def partition(_name: str, sub: nn.Module, sub_mesh: DeviceMesh, target: nn.Module = module) -> None:
            if sub is target:
                for pname, param in list(sub.named_parameters(recurse=False)):
                    if not isinstance(param, DTensor):
                        replicated = DTensor.from_local(param.data, sub_mesh, [Replicate()], run_check=False)
                        sub.register_parameter(pname, nn.Parameter(replicated, param.requires_grad))

        # torch's stub types input_fn as returning None; the returned inputs replace the module's (as in a pre-hook)
        distribute_module(module, mesh, partition, _replicated_inputs, _local_outputs)  # type: ignore[arg-type]


def _replicated_inputs(_module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)


def _local_outputs(_module: nn.Module, output, _mesh: DeviceMesh):
    return output.to_local() if isinstance(output, DTensor) else output


def _shard_alibi_slopes(model: Transformer, cfg: ModelConfig, tp: int, rank: int) -> None:
    """Each rank attends with its own heads, so it must bias them with its own slopes."""
    if model.alibi_slopes is None:
        return
    per_rank = cfg.attention.n_heads // tp
    heads = slice(rank * per_rank, (rank + 1) * per_rank)
    model.set_parallel_context(replace(model.parallel_context, alibi_heads=heads))


def _retie(model: nn.Module, cfg: ModelConfig) -> None:
    """parallelize_module gives each module a new Parameter; tie the output head back to the embedding.

    Both are sharded on the vocabulary (dim 0 of both weights), so one DTensor serves both.
    """
    embedding = getattr(model, "tok_embeddings", None)
    output = getattr(model, "output", None)
    if cfg.tie_embeddings and embedding is not None and output is not None:
        output.weight = embedding.weight


def vocab_shard(cfg: ModelConfig, mesh: DeviceMesh) -> tuple[int, int]:
    """The [start, end) vocabulary rows of this tensor-parallel rank."""
    per_rank = cfg.vocab_size // mesh.size()
    start = mesh.get_local_rank() * per_rank
    return start, start + per_rank
