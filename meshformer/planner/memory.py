"""Peak memory of one rank over a training step, from its `RankShare` and the activation accounting.

The step is walked in the order things are allocated, and the peak is the largest of these moments:
- forward end / backward start: master weights, optimizer state, FSDP's unsharded root unit, every in-flight
  micro-batch's saved activations, the logits and the loss's fp32 work, the head's gradient;
- each block's backward (last to first): the activations still held, the block's re-gathered weights and
  unsharded gradients, its recomputed activations, gradients of its activations, finished gradient shards;
- the optimizer step: weights, gradients, both AdamW moments (Muon: one momentum for its matrices, and the
  largest matrix gathered whole with Newton–Schulz's work on it).
Master weights, gradient shards and AdamW moments are fp32 (FSDP keeps fp32 shards whatever its policy);
unsharded weights/gradients use `parallel.mixed_precision_param` under FSDP.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshformer.config import Config
from meshformer.model.families import get_family_spec
from meshformer.optim import get_optimizer_spec
from meshformer.parallel.parallelize import compile_mode
from meshformer.parallel_dims import ZERO_BUBBLE, ParallelDims, last_stage_losses_in_flight, n_microbatches
from meshformer.planner import activations as act
from meshformer.planner.assumptions import CUDA_CONTEXT, DEVICES, SAFETY_FRACTION
from meshformer.planner.shard import RankShare
from meshformer.train import loss_choice


@dataclass
class RankMemory:
    """Bytes on one pipeline rank (the worst data/tensor-parallel rank of it)."""

    pp_rank: int
    layers: int
    params: float  # fp32 master shards
    grads: float  # fp32 gradient shards
    optimizer: float  # AdamW exp_avg + exp_avg_sq (Muon's matrices: one momentum buffer)
    fsdp_buffers: float  # unsharded root unit + one block's all-gathered weights and unsharded gradients
    activations: float  # all in-flight micro-batches, saved for backward
    activations_per_microbatch: float
    in_flight: float  # micro-batches (of one stage's layers) alive at the worst moment
    logits: float  # logits + loss work at the start of backward (last stage)
    peak: float
    peak_at: str


def usable_bytes(device: str) -> float:
    """What a rank may plan for: capacity less the safety fraction and (on GPUs) the CUDA context."""
    capacity = DEVICES[device]
    return capacity * (1 - SAFETY_FRACTION) - (CUDA_CONTEXT if device != "cpu" else 0)


def pipeline_in_flight(cfg: Config, dims: ParallelDims, share: RankShare) -> float:
    """Micro-batches whose activations a pipeline rank holds at once, in units of one stage's worth.

    GPipe runs every forward first (all micro-batches); 1F1B holds pp - rank; interleaved schedules warm up
    (chunks - 1) * pp + 2 * (pp - rank - 1) + 1 chunk-forwards (Narayanan et al. 2021), each 1/chunks of
    the rank's layers; zero-bubble schedules are counted like their 1F1B counterpart.
    """
    if dims.pp == 1:
        return 1.0
    m, pp, r = n_microbatches(cfg), dims.pp, share.pp_rank
    schedule = cfg.parallel.pp_schedule
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - r))
    chunks = share.chunks
    warmup = min(m * chunks, (chunks - 1) * pp + 2 * (pp - r - 1) + 1)
    return warmup / chunks


def head_loss_live(cfg: Config, x: act.ActivationShape, method: str, device_type: str) -> float:
    """The last stage's loss memory at its worst moment: what the loss keeps per micro-batch, times the
    micro-batches holding it, plus one backward's work. A fused loss keeps its saved tensors until the weight
    backward (`last_stage_losses_in_flight`); the plain loss's logits go with the stage output at the (input)
    backward, so only GPipe keeps several, but a zero-bubble schedule holds the fp32 logits gradient that its
    input pass captured for each deferred weight pass (measured: bench/pp_head_loss_memory.py)."""
    kept, work = act.loss_memory(cfg.model, x, method, device_type)
    held = last_stage_losses_in_flight(cfg)
    if method != "plain" or cfg.parallel.pp_schedule == "gpipe":
        return kept * held + work
    return kept + (held - 1) * x.batch * x.seq * (cfg.model.vocab_size // x.tp) * act.FP32 + work


def rank_memory(cfg: Config, dims: ParallelDims, share: RankShare, moe_imbalance: float = act.MOE_IMBALANCE
                ) -> RankMemory:
    """`moe_imbalance`: rows an expert-parallel rank's experts receive over the balanced load (`act.moe_rows`)."""
    m, p = cfg.model, cfg.parallel
    fsdp = dims.fsdp_enabled
    micro = max(1, cfg.data.batch_size // (n_microbatches(cfg) if dims.pp > 1 else 1))
    device_type = "cpu" if cfg.train.device == "cpu" else "cuda"  # "auto": planning for GPUs
    shape = act.activation_shape(cfg, micro, dims.tp, fsdp, device_type=device_type,
                                 compiled=compile_mode(cfg, dims) != "off", cp=dims.cp, ep=dims.ep,
                                 moe_imbalance=moe_imbalance)
    unsharded_bytes = 2 if p.mixed_precision_param == "bf16" else 4
    reduce_bytes = 2 if p.mixed_precision_reduce == "bf16" else 4

    params = share.sharded_numel * 4.0
    # the optimizer's own count (meshformer/optim/): state between steps, transient buffers while stepping
    optimizer, muon_gather = get_optimizer_spec(cfg.optim.name).state_bytes(
        share.sharded_numel, share.muon_numel, share.muon_gather)
    grads = params

    modes = act.recompute_mode_blocks(cfg, share.layers, p.recompute)
    spec = get_family_spec(m.family)
    cross = spec.seq2seq  # decoder blocks also cross-attend the encoder memory
    enc = spec.depth(m, "encoder")
    offsets = sorted(spec.layer_offsets(m).values())
    kept: list[float] = []  # per held block: bytes kept through forward
    rebuild: list[float] = []  # per held block: bytes rebuilt in its backward
    in_stack: list[int] = []  # per held block: its index within its stack (which picks its kinds)
    for index, mode in zip(share.layers, modes, strict=True):
        is_cross = cross and index >= enc
        causal = spec.stacks[min(int(index >= enc), len(spec.stacks) - 1)].causal
        block = index - max(o for o in offsets if o <= index)
        in_stack.append(block)
        full = act.block_saved(m, shape, cross=is_cross, memory_len=cfg.data.seq_len, causal=causal, index=block)
        if mode == "none":
            kept.append(full)
            rebuild.append(0.0)
        elif mode == "selective":
            kept.append(act.block_selective(m, shape, cross=is_cross, memory_len=cfg.data.seq_len, causal=causal,
                                            index=block))
            rebuild.append(full - kept[-1])
        else:
            kept.append(act.block_input(m, shape))
            rebuild.append(full)
    head = act.head_saved(m, shape, share.last)
    in_flight = pipeline_in_flight(cfg, dims, share)
    loss_method = loss_choice.loss_method(cfg, dims, device_type)
    # multi-token prediction on the stage holding the head: each module after the main stack, back-propagated first
    mtp_mode = p.recompute if p.recompute in ("full", "selective") else "none"
    loss_kept = act.loss_memory(m, shape, loss_method, device_type)[0]
    mtp = [act.mtp_module_saved(m, shape, mtp_mode, loss_kept)] * (m.mtp.depth if share.last else 0)
    per_microbatch = sum(kept) + head + sum(saved for saved, _ in mtp)
    logits_live = head_loss_live(cfg, shape, loss_method, device_type) if share.last else 0.0

    root = share.root_numel * unsharded_bytes if fsdp else 0.0
    block_unit = share.block_numel * unsharded_bytes if fsdp else 0.0
    resharded = p.reshard_after_forward
    held_units = 0.0 if (not fsdp or resharded) else block_unit * len(share.layers)
    earlier = (in_flight - 1) * per_microbatch  # other micro-batches' activations (pipeline)
    # Gradients are whole during the worst backward when an earlier backward filled them: grad_accum > 1, or a
    # 1F1B-like pipeline with more micro-batches than it holds in flight.
    later = dims.pp > 1 and p.pp_schedule != "gpipe" and n_microbatches(cfg) > in_flight
    accumulating = cfg.train.grad_accum > 1 or later
    static = params + optimizer + (grads if accumulating else 0.0)
    if fsdp and dims.pp > 1 and (p.pp_fsdp_unsharded_microbatches or p.pp_schedule in ZERO_BUBBLE):
        # torch's own PP x FSDP (and zero-bubble schedules always) keeps every block's weights and gradients
        # unsharded from the first micro-batch's backward to the step's end (parallel/pipeline/sharded_stage.py)
        static += share.block_numel * len(share.layers) * (unsharded_bytes + reduce_bytes)
    # The head's gradient (under FSDP the unsharded one); without FSDP an accumulated one is already in `grads`.
    head_grad = (share.root_numel * (reduce_bytes if fsdp else 4)) if share.last and (fsdp or not accumulating) \
        else 0.0

    # GPipe's last forward comes before any backward of the step: no head gradient exists yet (the recomputing
    # loss's worst moment is its backward, accumulating into the head gradient: counted)
    gpipe_first_pass = (dims.pp > 1 and p.pp_schedule == "gpipe" and not accumulating
                        and loss_method != "chunked_recompute")
    moments = {"forward end": static + root + held_units + earlier + per_microbatch + logits_live
               + (0.0 if gpipe_first_pass else head_grad)}
    done_grads = head_grad
    for k in range(len(mtp), 0, -1):
        mtp_kept = earlier + sum(kept) + head + sum(saved for saved, _ in mtp[:k])
        moments[f"backward of multi-token prediction module {k}"] = (
            static + root + held_units + mtp_kept + mtp[k - 1][1] + act.block_backward_extra(m, shape, m.n_layers - 1)
            + (block_unit * 2 if fsdp else 0.0) + done_grads)
    for i in range(len(kept) - 1, -1, -1):
        still_kept = earlier + sum(kept[:i + 1])
        unit = 0.0 if not fsdp else block_unit * (1 if resharded else 0) + block_unit + block_unit * reduce_bytes / max(
            unsharded_bytes, 1)
        moments[f"backward of block {share.layers[i]}"] = (
            static + root + held_units + still_kept + rebuild[i] + act.block_backward_extra(m, shape, in_stack[i])
            + unit + done_grads)
        shard_grad = (share.block_numel / dims.fsdp_shard * 4) if fsdp else share.block_numel * 4
        done_grads += 0 if accumulating else shard_grad
    if share.first and not share.last:
        # The input embedding back-propagates last in each micro-batch: a dense gradient the size of its table (fp32;
        # under FSDP unsharded, in the reduce dtype). Without accumulation the first one becomes the gradient and a
        # later micro-batch's is added to it (both alive, one micro-batch fewer in flight); with accumulation the
        # gradient is already counted in `static`.
        embedding_grad = share.root_numel * (reduce_bytes if fsdp else 4)
        at_embedding = static + root + held_units + done_grads
        moments["embedding backward"] = max(
            at_embedding + earlier + embedding_grad,
            at_embedding + max(0.0, earlier - per_microbatch) + 2 * embedding_grad
            if n_microbatches(cfg) > 1 and not accumulating else 0.0)
    moments["optimizer step"] = params + optimizer + grads + muon_gather
    peak_at = max(moments, key=lambda moment: moments[moment])
    fsdp_buffers = root + (block_unit * 3 if fsdp else 0.0)
    return RankMemory(share.pp_rank, len(share.layers), params, grads, optimizer, fsdp_buffers,
                      in_flight * per_microbatch, per_microbatch, in_flight, logits_live, moments[peak_at], peak_at)


def as_dict(memory: RankMemory) -> dict:
    return asdict(memory)
