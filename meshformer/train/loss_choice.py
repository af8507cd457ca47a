"""Which loss a run trains with, decided once from the configuration and the layout."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshformer.config import Config, ConfigError
from meshformer.loss.cross_entropy import LossFn
from meshformer.loss.fused import liger_available
from meshformer.loss.token_loss import LossMethod, LossSpec
from meshformer.parallel_dims import ZERO_BUBBLE, ParallelDims, last_stage_losses_in_flight
from meshformer.renamed import renamed_names


def loss_method(cfg: Config, dims: ParallelDims, device_type: str) -> LossMethod:
    """train.loss with "auto" resolved: liger's fused kernel on one CUDA device when installed (less peak memory
    than the chunked loss at about its speed); else the chunked loss, which runs under every layout and schedule
    and on CPU is also faster than the plain loss while holding one chunk of logits instead of all of them.

    Where the last pipeline stage holds several micro-batches' losses at once (GPipe, interleaved zero-bubble:
    `last_stage_losses_in_flight`), their stored fp32 V x D weight gradients pile up, so auto recomputes the
    logits in the backward instead ("chunked_recompute": one more head GEMM per chunk for a lower last-stage peak;
    bench/pp_head_loss_memory.py)."""
    if cfg.train.loss != "auto":
        return cfg.train.loss
    if cfg.model.logit_softcap is not None:  # the fused losses compute raw logits: only the model's head caps them
        return "plain"
    if device_type == "cuda" and dims.is_single and liger_available():
        return "liger"
    if dims.pp_enabled and last_stage_losses_in_flight(cfg) > 1:
        return "chunked_recompute"
    return "chunked"


def resolve_loss(cfg: Config, dims: ParallelDims, device_type: str, custom: LossFn | None = None) -> LossSpec:
    """The run's loss: train.loss / label_smoothing / z_loss checked against device and layout, or `custom` (a loss
    on full-vocabulary logits, used as given; refused under tensor parallel when bound)."""
    if custom is not None:
        return LossSpec("plain", custom=custom)
    method = loss_method(cfg, dims, device_type)
    if method != "plain" and cfg.model.logit_softcap is not None:
        raise ConfigError(f"train.loss={method!r} computes the logits inside the loss, without "
                          f"model.logit_softcap={cfg.model.logit_softcap}", "use train.loss='plain' (or 'auto')")
    if method == "liger" and dims.pp_enabled and cfg.parallel.pp_schedule in ZERO_BUBBLE:
        raise ConfigError(f"train.loss='liger' cannot run under parallel.pp_schedule={cfg.parallel.pp_schedule!r}: "
                          "its backward scales its stored gradients in place and the deferred weight pass runs it "
                          "again; use train.loss='chunked' or a non-zero-bubble schedule")
    if method == "liger" and (device_type != "cuda" or not liger_available() or dims.tp_enabled):
        raise ConfigError("train.loss='liger' needs CUDA, the liger-kernel package and parallel.tp=1; use "
                          "train.loss='chunked'")
    return LossSpec(method, cfg.train.label_smoothing, cfg.train.z_loss)


if not TYPE_CHECKING:
    __getattr__ = renamed_names(__name__, {"loss_kind": "loss_method"})
