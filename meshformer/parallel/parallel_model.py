"""The contract between the trainer and a parallel layout.

The trainer only ever talks to a `ParallelModel`: it hands over micro-batches and the global count of
target tokens, and gets back gradients that equal d(sum of token losses / global tokens) — the same
gradients a single process computes on the whole global batch. How the model is sharded (FSDP, TP,
PP) is hidden behind this object.
"""

from __future__ import annotations

from functools import cached_property

import torch
from torch import nn

from meshformer.batch import Batch, model_inputs
from meshformer.loss.cross_entropy import LossFn, count_tokens
from meshformer.loss.fused import HeadLoss
from meshformer.model.dsa import SparseLatentAttention, dsa_layers, set_token_count
from meshformer.model.moe import MoEFeedForward, moe_layers, set_balance_weight, update_expert_bias
from meshformer.model.mtp import shifted_labels
from meshformer.model.transformer import Transformer
from meshformer.parallel.grad_norm import scale_grads_


class ParallelModel:
    """Single device: the reference every parallel layout must match."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, device: torch.device, *,
                 autocast_dtype: torch.dtype | None = None, head_loss: HeadLoss | None = None,
                 report: dict[str, str] | None = None) -> None:
        self.model, self.loss_fn, self.device = model, loss_fn, device
        self.dp_rank, self.dp_size = 0, 1  # the data loader's view of this rank
        self.autocast_dtype = autocast_dtype  # None: the model's own dtype (fp32)
        # train.loss: the model computes the loss from its final hidden states, chunked, instead of returning
        # full-vocabulary logits to `loss_fn` (None: the plain path).
        self.head_loss = head_loss
        # How the run is laid out and which kernels run (layout, attention, norms, compile, recompute, FSDP,
        # pipeline, loss), for the run log.
        self.report: dict[str, str] = dict(report or {})
        # FSDP all-gathers float8 weights, whose scales must be refreshed after every optimizer step (parallelize).
        self.float8_weight_gather = False
        self._balance_weight = 1.0  # the MoE layers' (their default)
        # multi-token prediction: each module's summed loss and target tokens since the last logged step, and this
        # step's main target tokens over each module's (its mean is over its own targets)
        self._mtp_sums: torch.Tensor | None = None
        self._mtp_tokens: torch.Tensor | None = None
        self._mtp_scale: torch.Tensor | None = None

    @property
    def model_parts(self) -> list[nn.Module]:
        """Modules holding this rank's parameters (several with pipeline parallelism)."""
        return [self.model]

    @property
    def supports_generation(self) -> bool:
        """Whether every rank can run the whole model's forward (not so under pipeline parallelism)."""
        return True

    @property
    def reports_loss(self) -> bool:
        """Whether this rank sees the loss (the last pipeline stage does)."""
        return True

    def global_token_count(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Target tokens in the whole step: every micro-batch, every data-parallel rank. With multi-token prediction
        it also counts each module's targets, whose mean that module's loss is."""
        counts = self._step_sum(torch.stack([step_token_counts(b["labels"], self.mtp_depth)
                                             for b in micro_batches]).sum(0).to(self.device))
        if self.mtp_depth:
            self._count_mtp_tokens(counts)
        set_token_count(self.dsa_layers, counts[0])  # DSA's indexer loss: a mean over the step's target tokens
        return counts[0]

    def _step_sum(self, counts: torch.Tensor) -> torch.Tensor:
        """A count of this rank's whole micro-batches summed over the step's data-parallel ranks."""
        return counts

    def _count_mtp_tokens(self, counts: torch.Tensor) -> None:
        """Keep the step's (main, module 1, ...) target counts: the modules' loss scales and their logged counts."""
        self._mtp_scale = counts[0] / counts[1:].clamp(min=1)
        self._mtp_tokens = self._mtp_tokens + counts[1:] if self._mtp_tokens is not None else counts[1:]

    def forward_backward(self, batch: Batch, global_tokens: torch.Tensor, last_micro_batch: bool = True
                         ) -> torch.Tensor:
        """Accumulate gradients of (summed loss of this micro-batch / global_tokens); return the detached sum.

        `last_micro_batch`: whether the step's gradients are complete after this one (gradient accumulation)."""
        loss_sum, objective = self._training_loss_sums(batch)
        (objective / global_tokens).backward()  # MoE layers add their balance terms in this backward
        return loss_sum.detach()

    @cached_property
    def mtp_depth(self) -> int:
        """Multi-token prediction modules the model runs in training (model.mtp.depth; 0 for a model that has
        none); the same on every rank, pipeline stages without the modules included."""
        part = self.model_parts[-1]
        if not isinstance(part, Transformer) or not part.spec.has_decoder or part.spec.seq2seq:
            return 0
        return part.cfg.mtp.depth

    @property
    def mtp_loss_weight(self) -> float:
        part = self.model_parts[-1]
        assert isinstance(part, Transformer)  # FSDP keeps the class (as a subclass)
        return part.cfg.mtp.loss_weight

    def _training_loss_sums(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the summed main loss, the objective times the step's main target tokens): the main loss plus
        loss_weight / depth times each multi-token prediction module's mean loss over its own targets
        (model/mtp.py). A batch outside a step (no `global_token_count` before it) is its own step."""
        if self.mtp_depth == 0:
            loss_sum = self._loss_sum(batch)
            return loss_sum, loss_sum
        if self._mtp_scale is None:
            self._count_mtp_tokens(step_token_counts(batch["labels"], self.mtp_depth).to(self.device))
        labels = batch["labels"]
        ahead = (batch["mtp_ahead_ids"], batch["mtp_ahead_labels"]) if "mtp_ahead_ids" in batch else None
        with self._autocast():
            main, modules = self.model(**model_inputs(batch), labels=labels, head_loss=self.head_loss,
                                       mtp_labels=labels, mtp_ahead=ahead)
        loss_sum, sums = mtp_loss_sums((main, modules), labels, self.loss_fn, self.head_loss)
        self.record_mtp_sums(sums)
        return loss_sum, self.mtp_objective(loss_sum, sums)

    def mtp_objective(self, loss_sum: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        """The main summed loss plus loss_weight / depth times each module's summed loss scaled to a mean over its
        own targets, in units of the main loss's tokens (which the caller divides by)."""
        assert self._mtp_scale is not None  # global_token_count ran
        weight = self.mtp_loss_weight / len(sums)
        return loss_sum + weight * (sums * self._mtp_scale.to(sums.dtype)).sum()

    def record_mtp_sums(self, sums: torch.Tensor) -> None:
        """Keep each module's summed loss for `mtp_scalars`."""
        detached = sums.detach().float()
        self._mtp_sums = self._mtp_sums + detached if self._mtp_sums is not None else detached

    def mtp_scalars(self) -> dict[str, float]:
        """`mtp/loss_<k>`: each multi-token prediction module's mean token loss since the last call (a collective
        under data parallel); none without MTP."""
        if self._mtp_tokens is None:
            return {}
        tokens = self._mtp_tokens
        # a pipeline stage without the modules has no sums but joins the collective
        sums = self._mtp_sums if self._mtp_sums is not None else torch.zeros(len(tokens), device=self.device)
        self._mtp_sums = self._mtp_tokens = None
        # the counts are already the step's global ones (global_token_count)
        return {f"mtp/loss_{k + 1}": self.reduce_for_logging(s) / max(float(n), 1.0)
                for k, (s, n) in enumerate(zip(sums, tokens.float()))}

    @property
    def forwards_per_micro_batch(self) -> int:
        """Model forwards one micro-batch takes (the pipeline's microbatches under pipeline parallel)."""
        return 1

    def begin_step(self, micro_batches: int) -> None:
        """Told before each step: MoE balance terms are averaged over the step's forwards."""
        weight = 1.0 / (micro_batches * self.forwards_per_micro_batch)
        if self.moe_layers and weight != self._balance_weight:
            set_balance_weight(self.moe_layers, weight)
            self._balance_weight = weight

    def update_expert_bias(self, applied: torch.Tensor) -> None:
        """After an optimizer step: auxiliary-loss-free balancing from the step's expert loads (model/moe.py); none
        where `applied` is 0 (the step's update was skipped)."""
        update_expert_bias(self.moe_layers, applied)

    @cached_property
    def named_moe_layers(self) -> list[tuple[str, MoEFeedForward]]:
        """This rank's MoE layers by their name in the whole model, found once: no walk over every module per step
        (none for a dense model)."""
        return [item for part in self.model_parts for item in moe_layers(part)]

    @cached_property
    def dsa_layers(self) -> list[SparseLatentAttention]:
        """This rank's sparse latent attentions, whose indexer losses are means over each step's target tokens."""
        return dsa_layers(self.model_parts)

    @cached_property
    def moe_layers(self) -> list[MoEFeedForward]:
        return [layer for _, layer in self.named_moe_layers]

    def moe_scalars(self) -> dict[str, float]:
        """Per MoE layer, of its latest training forward over the whole micro-batch: the busiest expert's load over
        the mean load (1 = perfectly balanced), the fraction of token-slots dropped for capacity, the aux and z
        balance losses (unweighted)."""
        if not self.moe_layers:
            return {}
        keys = ("load_max_over_mean", "dropped_fraction", "aux_loss", "z_loss")
        prefixes, rows = [], []
        for name, layer in self.named_moe_layers:
            stats = layer.last_stats
            load = stats.tokens_per_expert
            prefixes.append(f"moe/{name.removesuffix('.ffn')}")
            rows.append(torch.stack([load.max() / load.mean().clamp(min=1e-9), stats.dropped_fraction,
                                     stats.aux_loss, stats.z_loss]))
        values = torch.stack(rows).tolist()  # one host read for every layer
        return {f"{prefix}/{key}": value for prefix, row in zip(prefixes, values) for key, value in zip(keys, row)}

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, token count) of a batch, reduced over data-parallel ranks."""
        return self._loss_sum(batch).float(), count_tokens(batch["labels"])

    def _loss_sum(self, batch: Batch) -> torch.Tensor:
        if self.head_loss is not None:
            with self._autocast():
                return self.model(**model_inputs(batch), labels=batch["labels"], head_loss=self.head_loss)
        with self._autocast():
            logits = self.model(**model_inputs(batch))
        return self.loss_fn(logits, batch["labels"])

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the whole gradient."""
        return torch.nn.utils.get_total_norm(self._all_grads(), foreach=True)

    def scale_grads_(self, coef: torch.Tensor) -> None:
        """Multiply every gradient by `coef` (a scalar tensor) in place."""
        scale_grads_(self._all_grads(), coef)

    def _all_grads(self) -> list[torch.Tensor]:
        """Every gradient once, duplicates of shared weights included (under pipelines they are separate tensors)."""
        seen, grads = set(), []
        for part in self.model_parts:
            for param in part.parameters():
                if param.grad is not None and id(param) not in seen:
                    seen.add(id(param))
                    grads.append(param.grad)
        return grads

    def reduce_for_logging(self, value: torch.Tensor) -> float:
        """A per-rank sum made global (identity on one device)."""
        return float(value)

    def _autocast(self) -> torch.autocast:
        if self.autocast_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def mtp_loss_sums(outputs: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]], labels: torch.Tensor,
                  loss_fn: LossFn | None, head_loss: HeadLoss | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the main summed loss, each module's summed loss) from a forward with multi-token prediction: its
    outputs are summed losses with a fused head loss, else logits for `loss_fn`."""
    main, modules = outputs
    if head_loss is not None:
        return main, torch.stack([out for out, _ in modules])
    if loss_fn is None:
        raise ValueError("multi-token prediction without a fused head loss needs the plain loss function")
    return loss_fn(main, labels), torch.stack([loss_fn(out, targets) for out, targets in modules])


def step_token_counts(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """(main targets, module 1's, ..., module depth's) of one micro-batch's whole sequences."""
    counts = [count_tokens(labels)]
    counts += [count_tokens(shifted_labels(labels, k)) for k in range(1, depth + 1)]
    return torch.stack(counts)
