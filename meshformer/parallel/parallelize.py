"""`parallelize`: the one call the trainer makes to get a `ParallelModel` for this process's world.

Order of application on each model part (as in torchtitan): context parallel -> expert parallel -> float8 linears
-> tensor parallel -> activation recomputation -> torch.compile (per block or whole model) -> FSDP (the experts'
units first). Pipeline splitting comes first, so every stage goes through the same steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from meshformer.config import Config, ConfigError
from meshformer.loss.fused import VocabShard
from meshformer.loss.objective import Loss
from meshformer.loss.token_loss import LossSpec
from meshformer.model import Transformer
from meshformer.parallel.context import apply_context_parallel
from meshformer.parallel.expert_parallel import (
    MeshTokenGroup,
    apply_expert_parallel,
    expert_shard_placement,
    has_moe,
)
from meshformer.parallel.float8 import apply_float8, check_fp8, end_blocks, fp8_report
from meshformer.parallel.fsdp import apply_fsdp
from meshformer.parallel.kernels import (
    attention_kernels,
    compile_blocks,
    compile_kwargs,
    compile_mode_note,
    kernel_report,
    trace_routed_sizes,
    use_apex_norms,
)
from meshformer.parallel.materialize import is_meta, materialize
from meshformer.parallel.mesh import Meshes, build_mesh
from meshformer.parallel.mesh_model import MeshParallelModel, MultiRankParallelModel
from meshformer.parallel.parallel_model import ParallelModel, objective_for
from meshformer.parallel.pipeline.model import PipelineParallelModel, shared_weights
from meshformer.parallel.pipeline.stages import TransformerStage, stage_placement
from meshformer.parallel.recompute import apply_recompute
from meshformer.parallel.tensor_parallel import apply_tensor_parallel, vocab_shard
from meshformer.parallel_dims import (
    ZERO_BUBBLE,
    ParallelDims,
    n_microbatches,
    validate_parallel,
)

log = logging.getLogger(__name__)

ModelOrFactory = Transformer | Callable[[], Transformer]


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def parallelize(model: ModelOrFactory, cfg: Config, device: torch.device, loss: LossSpec,
               dims: ParallelDims | None = None) -> ParallelModel:
    """Shard `model` (built identically on every rank) by `cfg.parallel` and return this rank's `ParallelModel`,
    training with `loss` (meshformer.train.loss_choice.resolve_loss), bound to this rank's vocabulary shard under
    tensor parallel.

    `dims`: the layout the run validated where it started (the trainer passes its own); without it the layout is
    validated here, for callers that start with this function (tests, benchmarks).

    A model built on the meta device is sharded first and then materialised: each rank allocates and
    initialises only its own shards (meshformer.parallel.materialize).

    World size 1 gives the single-device `ParallelModel` (recomputation and compile still apply).
    """
    device = torch.device(device)
    if dims is None:
        dims = validate_parallel(cfg, world_size(), device)
    if not isinstance(model, Transformer):
        model = model()
    parallel_model = _build(model, cfg, dims, device, loss)
    if is_meta(parallel_model.model_parts[0]):
        materialize(parallel_model.model_parts, device)
    return parallel_model


def _build(model: Transformer, cfg: Config, dims: ParallelDims, device: torch.device, loss: LossSpec
           ) -> ParallelModel:
    if not is_meta(model):
        model.to(device)
    check_fp8(cfg.train.fp8, device)
    meshes = None if dims.is_single else build_mesh(dims, device)
    shard = None
    if meshes is not None and dims.tp_enabled:
        start, _ = vocab_shard(cfg.model, meshes.tp)
        shard = VocabShard(meshes.tp.get_group(), start, cfg.model.vocab_size)
    bound = loss.bind(shard)
    loss_fn, loss_note = bound.logits_loss, ""
    if bound.head_loss is None and loss.custom is None and not (dims.tp_enabled or dims.pp_enabled) \
            and compile_mode(cfg, dims) != "off":
        # A whole-model-compiled reference (nanoGPT) fuses the fp32 upcast and cross-entropy over the full logits
        # into its graph; compiling the plain loss does the same here instead of several eager passes over B*T*V.
        loss_fn = torch.compile(loss_fn, **compile_kwargs(cfg.train.compile_mode))
        loss_note = ", compiled"
    # The one objective every path calls: this token loss with the model's auxiliary terms and weights.
    objective = objective_for(model, loss_fn, bound.head_loss)
    autocast_dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else None
    if meshes is None:
        report = {**parallelize_part(model, cfg, dims, None, device), "loss": _loss_report(loss, loss_note)}
        return ParallelModel(model, objective, device, autocast_dtype=autocast_dtype, report=report)
    parallel_model: MultiRankParallelModel
    if dims.pp_enabled:  # the last stage computes the fused head loss in its forward
        parallel_model = _pipeline_model(model, cfg, dims, meshes, device, objective, autocast_dtype)
        parallel_model.report["loss"] = _loss_report(loss)
    else:
        report = {**parallelize_part(model, cfg, dims, meshes, device), "loss": _loss_report(loss, loss_note),
                  "layout": dims.describe()}
        parallel_model = MeshParallelModel(model, objective, device, meshes, autocast_dtype=autocast_dtype,
                                           report=report)
    parallel_model.float8_weight_gather = float8_weight_gather(cfg, dims)
    log.info("parallel layout %s; %s", dims.describe(), parallel_model.report)
    return parallel_model


def float8_weight_gather(cfg: Config, dims: ParallelDims) -> bool:
    """Whether FSDP all-gathers weights in float8 (tensorwise only; not under TP: see meshformer/parallel/float8.py)."""
    return cfg.train.fp8 == "tensorwise" and dims.fsdp_enabled and not dims.tp_enabled


def _loss_report(loss: LossSpec, note: str = "") -> str:
    if loss.custom is not None:
        return "custom (full logits)"
    return f"plain (full logits{note})" if loss.method == "plain" else loss.method


def compile_mode(cfg: Config, dims: ParallelDims) -> str:
    """train.compile as "off" | "blocks" | "model" (a bool means off / blocks, as before)."""
    setting = cfg.train.compile
    mode: str = ("blocks" if setting else "off") if isinstance(setting, bool) else setting
    if mode == "model" and not dims.is_single:
        raise ConfigError("train.compile='model' is for a single device; with FSDP/TP/PP use train.compile='blocks' "
                          "(each block compiled inside its FSDP unit)")
    return mode


def parallelize_part(part: Transformer, cfg: Config, dims: ParallelDims, meshes: Meshes | None,
                 device: torch.device) -> dict[str, str]:
    """CP -> EP -> FP8 -> TP -> recompute -> compile -> FSDP on one model part (the whole model or one pipeline
    stage)."""
    apex_norms = 0
    context_layers = (apply_context_parallel(part, meshes.cp, cfg.parallel.cp_method)
                      if meshes is not None and dims.cp_enabled else 0)
    expert_layers = 0
    if meshes is not None and cfg.model.moe.n_experts:
        # Flattened meshes are new process groups, which every rank must create in the same order: built here on
        # every rank, whether or not its pipeline stage holds an MoE layer
        tokens, sequence = meshes.moe_tokens, meshes.sequence
        ep_mesh = meshes.ep if dims.ep_enabled else None
        if has_moe(part):
            # MoE balance statistics cover the micro-batch: every rank of the stage holding other tokens of it
            part.set_parallel_context(replace(part.parallel_context, token_group=MeshTokenGroup(tokens, sequence)))
            expert_layers = apply_expert_parallel(part, ep_mesh) if ep_mesh is not None else 0
    keep = end_blocks(cfg.model) if cfg.train.fp8_keep_ends else frozenset()
    fp8 = apply_float8(part, cfg.train.fp8, fsdp_gather=float8_weight_gather(cfg, dims), emulate=device.type != "cuda",
                       keep=keep) if cfg.train.fp8 != "off" else 0
    if meshes is not None and dims.tp_enabled:  # meshes exist whenever the world has more than one rank
        apply_tensor_parallel(part, meshes.tp, float8_gather=cfg.train.fp8 == "tensorwise")
    else:
        apex_norms = use_apex_norms(part, device)
    recomputed = apply_recompute(part, cfg.parallel.recompute, cfg.parallel.recompute_every)
    mode = compile_mode(cfg, dims)
    compiled = compile_blocks(part, cfg.train.compile_mode) if mode == "blocks" else 0
    report = kernel_report(cfg, device, apex_norms=apex_norms, compiled=compiled, recompute=recomputed)
    if mode == "model":
        trace_routed_sizes(part)
        part.compile(**compile_kwargs(cfg.train.compile_mode))
        report["compile"] = "whole-model torch.compile" + compile_mode_note(cfg.train.compile_mode)
        report["attention"] = attention_kernels(cfg, device, compiled=True)
    report["fp8"] = fp8_report(cfg.train.fp8, fp8, dims.fsdp_enabled, dims.tp_enabled)
    if expert_layers:
        report["experts"] = (f"{expert_layers} MoE layers, experts split over ep={dims.ep} ranks (all-to-all "
                             "dispatch)")
        if dims.fsdp_enabled and dims.dp_replicate * dims.dp_shard_mod_ep > 1:
            report["experts"] += (f", then by {'HSDP' if dims.hsdp else 'FSDP'} over the "
                                  f"{dims.dp_replicate * dims.dp_shard_mod_ep} data-parallel ranks ep leaves")
    if context_layers:
        report["context"] = (f"{dims.cp} ranks, each holding 2 of {2 * dims.cp} pieces of every sequence; "
                             + (f"{context_layers} layers exchange keys/values (attention) or states "
                                "(linear_attention, kda, mamba2)" if cfg.parallel.cp_method == "allgather" else
                                f"Ulysses: {context_layers} layers exchange sequence shards for head shards "
                                "(all-to-all) and back"))
    if fp8 and keep:
        report["fp8"] += f"; high precision: {', '.join(sorted(keep))}"
    if meshes is not None and dims.fsdp_enabled:
        reshard = cfg.parallel.reshard_after_forward
        if dims.pp_enabled and cfg.parallel.pp_schedule in ZERO_BUBBLE:
            # The deferred weight-gradient pass runs after FSDP would have resharded the block and reads freed
            # unsharded weights (wrong or missing gradients in torch 2.13), so blocks stay unsharded.
            reshard = False
        placement = expert_shard_placement(part, meshes.expert_fsdp) if expert_layers else None
        apply_fsdp(part, meshes.fsdp, cfg.parallel, reshard_after_forward=reshard, placement=placement)
        report["fsdp"] = (f"{'HSDP' if dims.hsdp else 'FSDP2'} over {dims.dp * dims.cp} ranks, reshard_after_forward="
                          f"{reshard}, params {cfg.parallel.mixed_precision_param}, reduce "
                          f"{cfg.parallel.mixed_precision_reduce}")
    return report


def _pipeline_model(model: Transformer, cfg: Config, dims: ParallelDims, meshes: Meshes, device: torch.device,
                    objective: Loss, autocast_dtype: torch.dtype | None
                    ) -> PipelineParallelModel:
    p = cfg.parallel
    placement = stage_placement(cfg, dims)
    spans = placement.spans
    shared = shared_weights(model, spans)
    stages = [TransformerStage(model, spans[s]) for s in placement.ids_for_rank(meshes.pp_rank)]
    del model  # each stage holds copies of its pieces
    report: dict[str, str] = {}
    for stage in stages:
        report = parallelize_part(stage, cfg, dims, meshes, device)
    if is_meta(stages[0]):  # before the pipelined model keeps references to the stages' (shared) parameters
        materialize(stages, device)
    report["pipeline"] = (f"{p.pp_schedule}, {len(spans)} stages "
                          f"({', '.join(f'{s.start}-{s.stop - 1}' for s in spans)}), "
                          f"{n_microbatches(cfg)} microbatches")
    report["layout"] = dims.describe()
    return PipelineParallelModel(stages, objective, device, meshes, schedule=p.pp_schedule,
                        n_microbatches=n_microbatches(cfg), stage_to_rank=placement.stage_to_rank, shared=shared,
                        timeout=timedelta(seconds=p.timeout_s), autocast_dtype=autocast_dtype,
                        report=report, unsharded_microbatches=p.pp_fsdp_unsharded_microbatches)
