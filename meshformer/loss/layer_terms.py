"""Loss terms computed inside a layer (MoE balance and router z-losses, DSA's indexer loss): how they join the
objective.

Under pipeline parallelism a layer may sit on a stage whose forward never reaches the loss, so such a term cannot be
returned and added there. Instead the layer hands its raw terms to its `LayerTerms`, which leaves the layer's output
unchanged but makes the output's backward also start d(scale * sum of weight x term): the term joins the gradient
wherever the layer runs, on every layout (Megatron-Core's MoEAuxLossAutoScaler does the same).

The layer computes the terms only. Their weights are the objective's (`Loss.layer_terms`, bound by the layout with
`bind_layer_terms`); `scale` is the step's normalisation, which the layout sets before each step (MoE: 1 / forwards
per step, its terms being means over a micro-batch; DSA: 1 / the step's target tokens, its term being a sum).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn


class _JoinsBackward(torch.autograd.Function):
    """Identity on `output` whose backward also starts `scale` * d(term)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, term: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(term)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (term,) = ctx.saved_tensors
        return grad, torch.full_like(term, ctx.scale), None


class LayerTerms:
    """A layer's link to the objective: `weights` by term name (the objective's; a term without a nonzero weight is
    not added) and `scale` (the step's normalisation; None outside a step: the layer's own fallback)."""

    def __init__(self) -> None:
        self.weights: dict[str, float] = {}
        self.scale: float | torch.Tensor | None = None

    def add(self, output: torch.Tensor, terms: Mapping[str, torch.Tensor],
            fallback_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """`output` unchanged; its backward also starts d(scale * sum of weight x term) over the weighted `terms`."""
        weighted = [self.weights[name] * term for name, term in terms.items() if self.weights.get(name)]
        if not weighted:
            return output
        total = weighted[0]
        for term in weighted[1:]:
            total = total + term
        scale = self.scale if self.scale is not None else fallback_scale
        if isinstance(scale, torch.Tensor):  # a device value: multiplied in, no host read
            total, scale = total * scale.detach(), 1.0
        return _JoinsBackward.apply(output, total, scale)


def layer_terms_of(modules: Iterable[nn.Module]) -> list[LayerTerms]:
    """The `LayerTerms` of every layer inside `modules` (a rank's model parts) that computes terms."""
    found = (getattr(m, "loss_terms", None) for part in modules for m in part.modules())
    return [terms for terms in found if isinstance(terms, LayerTerms)]


def bind_layer_terms(modules: Iterable[nn.Module], weights: Mapping[str, float]) -> None:
    """Give every layer inside `modules` the objective's weights of layer-local terms (`Loss.layer_weights`)."""
    for terms in layer_terms_of(modules):
        terms.weights = dict(weights)
