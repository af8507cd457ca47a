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
from meshformer.loss.layer_terms import bind_layer_terms
from meshformer.loss.objective import AuxTerm, Loss, MTPOutputs
from meshformer.model.compressed_attention import INDEX_LOSS, CompressedAttention
from meshformer.model.dsa import SparseLatentAttention, set_token_count
from meshformer.model.moe import MoEFeedForward, moe_layers, update_expert_bias
from meshformer.model.mtp import shifted_labels
from meshformer.model.transformer import Transformer
from meshformer.parallel.grad_norm import scale_grads_


class ParallelModel:
    """Single device: the reference every parallel layout must match."""

    def __init__(self, model: nn.Module, loss: Loss | LossFn, device: torch.device, *,
                 autocast_dtype: torch.dtype | None = None, head_loss: HeadLoss | None = None,
                 report: dict[str, str] | None = None) -> None:
        """loss: the objective (meshformer/loss/objective.py); a bare `(logits, labels) -> summed loss` (with
        `head_loss`, the fused head's) becomes one with the model's own auxiliary weights (`objective_for`)."""
        self.model, self.device = model, device
        self.loss = loss if isinstance(loss, Loss) else objective_for(model, loss, head_loss)
        bind_layer_terms([model], self.loss.layer_weights)  # the weights of the terms its layers compute
        self.dp_rank, self.dp_size = 0, 1  # the data loader's view of this rank
        self.autocast_dtype = autocast_dtype  # None: the model's own dtype (fp32)
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
    def loss_fn(self) -> LossFn:
        """The token loss on logits (`loss.logits_loss`)."""
        return self.loss.logits_loss

    @loss_fn.setter
    def loss_fn(self, value: LossFn) -> None:
        self.loss = self.loss.with_token_loss(value, self.loss.head_loss)

    @property
    def head_loss(self) -> HeadLoss | None:
        """train.loss's fused head (`loss.head_loss`): the model computes the loss from its final hidden states,
        chunked, instead of returning full-vocabulary logits (None: the plain path)."""
        return self.loss.head_loss

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
        (objective / global_tokens).backward()  # layer terms (MoE balance, DSA indexer) join in this backward
        return loss_sum.detach()

    @cached_property
    def mtp_depth(self) -> int:
        """Multi-token prediction modules the model runs in training (model.mtp.depth; 0 for a model that has
        none); the same on every rank, pipeline stages without the modules included."""
        part = self.model_parts[-1]
        if not isinstance(part, Transformer) or not part.spec.has_decoder or part.spec.seq2seq:
            return 0
        return part.cfg.mtp.depth

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
        loss_sum, sums = self.loss.mtp_sums((main, modules), labels)
        self.record_mtp_sums(sums)
        return loss_sum, self.mtp_objective(loss_sum, sums)

    def mtp_objective(self, loss_sum: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        """`Loss.objective` with this step's target counts (in units of the main loss's tokens)."""
        assert self._mtp_scale is not None  # global_token_count ran
        return self.loss.objective(loss_sum, sums, self._mtp_scale)

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
        return self.loss.mtp_scalars(sums, tokens, self.reduce_for_logging)

    @property
    def forwards_per_micro_batch(self) -> int:
        """Model forwards one micro-batch takes (the pipeline's microbatches under pipeline parallel)."""
        return 1

    def begin_step(self, micro_batches: int) -> None:
        """Told before each step: MoE balance terms are averaged over the step's forwards."""
        weight = 1.0 / (micro_batches * self.forwards_per_micro_batch)
        if self.moe_layers and weight != self._balance_weight:
            for layer in self.moe_layers:  # their terms are means over a forward's micro-batch
                layer.loss_terms.scale = weight
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
    def named_dsa_layers(self) -> list[tuple[str, SparseLatentAttention | CompressedAttention]]:
        """This rank's layers with an indexer loss by their name (sparse latent attentions, CSA blocks), whose
        indexer losses are means over each step's target tokens."""
        return [(name, m) for part in self.model_parts for name, m in part.named_modules()
                if isinstance(m, SparseLatentAttention) or (isinstance(m, CompressedAttention)
                                                            and m.indexer is not None)]

    @cached_property
    def dsa_layers(self) -> list[SparseLatentAttention | CompressedAttention]:
        return [layer for _, layer in self.named_dsa_layers]

    @cached_property
    def moe_layers(self) -> list[MoEFeedForward]:
        return [layer for _, layer in self.named_moe_layers]

    def moe_scalars(self) -> dict[str, float]:
        """Per MoE layer, of its latest training forward over the whole micro-batch: the busiest expert's load over
        the mean load (1 = perfectly balanced), the fraction of token-slots dropped for capacity, and the objective's
        logged parts of its balance terms (unweighted; `Loss.layer_scalars`). Per DSA layer, the logged part of its
        indexer loss ("dsa/<layer>/indexer_loss": its latest training forward's mean KL per real query), and per CSA
        layer with its indexer's objective on, "csa/<layer>/indexer_loss"."""
        if not self.moe_layers and not self.dsa_layers:
            return {}
        scalars: dict[str, torch.Tensor] = self.loss.layer_scalars((name.removesuffix(".attn"), layer.term_values())
                                                                   for name, layer in self.named_dsa_layers)
        for name, layer in self.named_moe_layers:
            stats, prefix = layer.last_stats, f"moe/{name.removesuffix('.ffn')}"
            load = stats.tokens_per_expert
            scalars[f"{prefix}/load_max_over_mean"] = load.max() / load.mean().clamp(min=1e-9)
            scalars[f"{prefix}/dropped_fraction"] = stats.dropped_fraction
        scalars |= self.loss.layer_scalars((name.removesuffix(".ffn"), layer.term_values())
                                           for name, layer in self.named_moe_layers)
        if not scalars:
            return {}
        values = torch.stack(list(scalars.values())).tolist()  # one host read for every layer
        return dict(zip(scalars, values))

    @torch.no_grad()
    def evaluate(self, batch: Batch, loss: Loss | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, token count) of a batch, reduced over data-parallel ranks; `loss`: another objective than
        the training one (downstream scoring's per-row losses)."""
        return self._loss_sum(batch, loss or self.loss).float(), count_tokens(batch["labels"])

    def _loss_sum(self, batch: Batch, loss: Loss | None = None) -> torch.Tensor:
        loss = loss or self.loss
        with self._autocast():
            if loss.head_loss is not None:
                return self.model(**model_inputs(batch), labels=batch["labels"], head_loss=loss.head_loss)
            return loss.token_sum(self.model(**model_inputs(batch)), batch["labels"])

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


def objective_for(model: nn.Module, logits_loss: LossFn, head_loss: HeadLoss | None = None) -> Loss:
    """The training objective of `model` (a `Transformer` or a pipeline stage): this token loss, multi-token
    prediction weighted by model.mtp.loss_weight, and the terms its layers compute (MoE balance and z-losses, DSA's
    indexer loss), each with the weight its config gives (the MoE terms declared at weight 0 too: logged)."""
    if not isinstance(model, Transformer):
        return Loss(logits_loss, head_loss)
    cfg = model.cfg
    mtp_weight = cfg.mtp.loss_weight if model.spec.has_decoder and not model.spec.seq2seq and cfg.mtp.depth else 0.0
    layer_terms: list[AuxTerm] = []
    has_moe = any(isinstance(m, MoEFeedForward) for m in model.modules())
    if has_moe:
        layer_terms += [AuxTerm("moe/aux_loss", cfg.moe.aux_loss, "layer"),
                        AuxTerm("moe/z_loss", cfg.moe.router_z_loss, "layer")]
    if any(isinstance(m, SparseLatentAttention) for m in model.modules()):
        layer_terms.append(AuxTerm("dsa/indexer_loss", cfg.dsa.loss_weight, "layer"))
    # from the config too: a pipeline's last stage (whose objective every stage binds) may hold no csa block
    if (any(cfg.layer_type(i) == "csa" for i in range(cfg.n_layers))
            or any(isinstance(m, CompressedAttention) and m.indexer is not None for m in model.modules())):
        layer_terms.append(AuxTerm(INDEX_LOSS, cfg.compressed_attention.index_loss_weight, "layer"))
    return Loss(logits_loss, head_loss, mtp_weight, tuple(layer_terms))


def mtp_loss_sums(outputs: MTPOutputs, labels: torch.Tensor, loss_fn: LossFn | None, head_loss: HeadLoss | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`Loss.mtp_sums` of a token loss given as functions."""
    if head_loss is None and loss_fn is None:
        raise ValueError("multi-token prediction without a fused head loss needs the plain loss function")
    return Loss(loss_fn or (lambda logits, labels: logits), head_loss).mtp_sums(outputs, labels)


def step_token_counts(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """(main targets, module 1's, ..., module depth's) of one micro-batch's whole sequences."""
    counts = [count_tokens(labels)]
    counts += [count_tokens(shifted_labels(labels, k)) for k in range(1, depth + 1)]
    return torch.stack(counts)
