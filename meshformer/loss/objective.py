"""The training objective as one object: the token loss and the weighted auxiliary terms every layout calls.

`Loss` is what `ParallelModel` (every layout), the pipeline's last stage, evaluation and downstream scoring call:

- the token cross-entropy, computed either by the model's fused head (`head_loss`: chunked, chunked with
  recomputation, liger, each vocabulary-parallel under tensor parallel) or on the logits it returns
  (`logits_loss`: plain or vocabulary-parallel cross-entropy, or a caller's own loss);
- the auxiliary terms, each with its weight and its logged parts (`AuxTerm`). Terms computed from the model's
  outputs on the last stage (multi-token prediction's modules) are weighted here. Terms computed inside a layer
  (MoE balance and z-losses, DSA's indexer loss) are declared here too, with their weights (`layer_weights`, which
  the layout binds to the layers) and their logged parts (`layer_scalars`); the layer only computes them, and they
  join the gradient in its own backward (layer_terms.py: under pipeline parallelism the layer may sit on a stage
  whose forward never reaches the loss).

Every value is a sum over tokens: the caller divides by the step's global target tokens (cross_entropy.py).
Evaluation paths use a copy with another token loss (`with_token_loss`), never by changing a model's attributes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch

from meshformer.loss.cross_entropy import LossFn
from meshformer.loss.fused import HeadLoss

# Outputs of a forward with multi-token prediction: (main output, [(module output, module targets), ...]); an output
# is a summed loss with a fused head loss, else logits.
MTPOutputs = tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]


@dataclass(frozen=True)
class AuxTerm:
    """One auxiliary term of the objective: its name ("<group>/<part>": logged per layer as "<group>/<layer>/<part>"
    for a layer term), its weight, and where it is computed ("outputs": from the model's outputs here; "layer":
    inside the layers, joining in their backward; a layer term of weight 0 is logged, not added)."""

    name: str
    weight: float
    where: str = "outputs"


@dataclass(frozen=True)
class Loss:
    """Token loss plus auxiliary terms (see the module notes). `mtp_weight`: multi-token prediction's weight, split
    evenly over its modules (model.mtp.loss_weight); `layer_terms`: the terms the layers compute (layer_terms.py)."""

    logits_loss: LossFn
    head_loss: HeadLoss | None = None
    mtp_weight: float = 0.0
    layer_terms: tuple[AuxTerm, ...] = field(default=())

    @property
    def terms(self) -> tuple[AuxTerm, ...]:
        """Every auxiliary term with its weight, for the run report."""
        mtp = (AuxTerm("mtp", self.mtp_weight),) if self.mtp_weight else ()
        return mtp + self.layer_terms

    @property
    def layer_weights(self) -> dict[str, float]:
        """The weight of each layer term by name: what the layout binds to the layers (`bind_layer_terms`)."""
        return {term.name: term.weight for term in self.layer_terms}

    def layer_scalars(self, layers: Iterable[tuple[str, Mapping[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
        """The logged parts of the layer terms: "<group>/<layer>/<part>" for each declared term a layer reports
        (`layers`: (layer name, its latest unweighted values by term name)); device values, read by the caller."""
        out = {}
        for layer, values in layers:
            for term in self.layer_terms:
                if term.name in values:
                    group, part = term.name.rsplit("/", 1)
                    out[f"{group}/{layer}/{part}"] = values[term.name]
        return out

    def with_token_loss(self, logits_loss: LossFn, head_loss: HeadLoss | None = None) -> Loss:
        """This objective with another token loss (evaluation and downstream scoring: per-row plain losses)."""
        return replace(self, logits_loss=logits_loss, head_loss=head_loss)

    def token_sum(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed token loss of a forward's output: the loss itself with a fused head, else its logits'."""
        return output if self.head_loss is not None else self.logits_loss(output, labels)

    def mtp_sums(self, outputs: MTPOutputs, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the main summed loss, each multi-token prediction module's summed loss) of a forward with the modules."""
        main, modules = outputs
        if self.head_loss is not None:
            return main, torch.stack([out for out, _ in modules])
        return self.logits_loss(main, labels), torch.stack([self.logits_loss(out, t) for out, t in modules])

    def objective(self, main: torch.Tensor, mtp_sums: torch.Tensor | None = None,
                  mtp_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The summed objective in units of the main loss's target tokens (the caller divides by their count): the
        main loss plus mtp_weight / depth times each module's sum scaled to a mean over its own targets
        (`mtp_scale`: main targets over each module's)."""
        if mtp_sums is None or len(mtp_sums) == 0:
            return main
        assert mtp_scale is not None, "multi-token prediction needs the step's target counts"
        return main + self.mtp_weight / len(mtp_sums) * (mtp_sums * mtp_scale.to(mtp_sums.dtype)).sum()

    @staticmethod
    def mtp_scalars(sums: torch.Tensor, tokens: torch.Tensor, reduce) -> dict[str, float]:
        """`mtp/loss_<k>`: each module's mean token loss from its summed losses and target counts (`reduce`: a
        per-rank sum made global)."""
        return {f"mtp/loss_{k + 1}": reduce(s) / max(float(n), 1.0)
                for k, (s, n) in enumerate(zip(sums, tokens.float()))}
