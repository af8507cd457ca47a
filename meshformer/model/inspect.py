"""Looking inside a model: attention heatmaps for one layer/head, and per-parameter gradient norms.

Plotting uses matplotlib's object API with the Agg canvas, so it never touches the global backend
and works without a display.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol, cast

import torch
from torch import nn

from meshformer.errors import UsageError
from meshformer.model.layers import TransformerBlock
from meshformer.model.transformer import Transformer

Stack = Literal["encoder", "decoder", "cross"]


class KeepsWeights(Protocol):
    """A softmax attention module that keeps its last attention weights when asked (`Attention`, MLA's)."""

    capture_weights: bool
    weights: torch.Tensor | None


def default_stack(model: Transformer) -> Stack:
    """Cross-attention where the decoder reads a source, else the model's one stack."""
    return "cross" if model.spec.seq2seq else cast(Stack, model.spec.stacks[-1].name)  # "encoder" or "decoder"


def _attention_module(model: Transformer, stack: Stack, layer: int) -> KeepsWeights:
    layers = model.encoder_layers if stack == "encoder" else model.decoder_layers
    if layers is None:
        raise UsageError(f"this {model.cfg.family} model has no {stack} stack")
    if str(layer) not in layers:
        raise UsageError(f"{stack} layer {layer} does not exist; layers are {', '.join(layers)}")
    block = layers[str(layer)]
    assert isinstance(block, TransformerBlock)
    if stack == "cross" and block.cross_attn is None:
        raise UsageError("cross-attention exists only in encoder-decoder models")
    module = block.cross_attn if stack == "cross" else block.attn
    # a softmax attention module keeps its weights when asked (`capture_weights`); other token mixers have none
    if module is None or not hasattr(module, "capture_weights"):
        raise UsageError(f"{stack} layer {layer} is a {block.mixers['attn']} block, which has no softmax attention "
                         "weights to show; pick a full_attention, sliding_attention or mla layer")
    return cast(KeepsWeights, module)


@torch.no_grad()
def attention_weights(
    model: Transformer,
    input_ids: torch.Tensor,
    *,
    layer: int,
    stack: Stack | None = None,
    attention_mask: torch.Tensor | None = None,
    decoder_input_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention weights (B, heads, T_query, T_key) of one layer for one forward pass in eval mode.

    stack: "encoder" / "decoder" self-attention or the decoder's "cross"-attention; default: the decoder
    for decoder-only, the encoder for encoder-only, cross-attention for encoder-decoder models.
    Arguments after `layer` are those of `Transformer.forward`.
    """
    stack = stack or default_stack(model)
    attention = _attention_module(model, stack, layer)
    was_training = model.training
    model.eval()
    attention.capture_weights = True  # routes this layer through the math path, which keeps the weights
    try:
        model(input_ids, attention_mask, decoder_input_ids=decoder_input_ids)
        if attention.weights is None:
            raise RuntimeError(f"{stack} attention of layer {layer} did not run in this forward pass")
        return attention.weights
    finally:
        attention.capture_weights = False
        attention.weights = None
        model.train(was_training)


def _ticks(labels: Sequence[str], max_ticks: int = 48) -> tuple[list[int], list[str]]:
    step = max(1, math.ceil(len(labels) / max_ticks))  # thin out long sequences so labels stay legible
    positions = list(range(0, len(labels), step))
    return positions, [labels[i] for i in positions]


def save_attention_heatmap(
    weights: torch.Tensor,
    path: str | Path,
    *,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    title: str = "",
    size_px: tuple[int, int] = (800, 800),
    dpi: int = 100,
) -> Path:
    """Write a (T_query, T_key) weight matrix as a PNG of exactly `size_px` (width, height) pixels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    weights = weights.detach().float().cpu()
    if weights.ndim != 2:
        raise UsageError(f"expected a (T_query, T_key) matrix, got shape {tuple(weights.shape)}")
    n_query, n_key = weights.shape
    query_labels = list(query_labels) if query_labels is not None else [str(i) for i in range(n_query)]
    key_labels = list(key_labels) if key_labels is not None else [str(i) for i in range(n_key)]
    if len(query_labels) != n_query or len(key_labels) != n_key:
        raise UsageError(f"{len(query_labels)} query / {len(key_labels)} key labels for a {n_query}x{n_key} matrix")

    fig = Figure(figsize=(size_px[0] / dpi, size_px[1] / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(weights.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    font = max(5, min(10, 400 // max(n_query, n_key, 1)))
    ax.set_xticks(*_ticks(key_labels), rotation=90, fontsize=font)
    ax.set_yticks(*_ticks(query_labels), fontsize=font)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()  # rearranges inside the figure; the pixel size stays size_px
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png")
    return path


def attention_heatmap(
    model: Transformer,
    input_ids: torch.Tensor,
    path: str | Path,
    *,
    layer: int = 0,
    head: int = 0,
    stack: Stack | None = None,
    tokens: Sequence[str] | None = None,
    decoder_input_ids: torch.Tensor | None = None,
    decoder_tokens: Sequence[str] | None = None,
    attention_mask: torch.Tensor | None = None,
    batch_index: int = 0,
    size_px: tuple[int, int] = (800, 800),
) -> Path:
    """PNG heatmap of one head of one layer for one sequence; `tokens` / `decoder_tokens` label the axes.

    Labels: `tokens` belong to `input_ids` (the source for encoder-decoder models), `decoder_tokens`
    to `decoder_input_ids`. Cross-attention has decoder queries and source keys.
    """
    weights = attention_weights(model, input_ids, layer=layer, stack=stack, attention_mask=attention_mask,
                                decoder_input_ids=decoder_input_ids)
    stack = stack or default_stack(model)
    if not 0 <= head < weights.shape[1]:
        raise UsageError(f"head {head} does not exist; the layer has {weights.shape[1]} heads")
    source_labels = tokens
    target_labels = decoder_tokens if model.spec.seq2seq else tokens
    query_labels = source_labels if stack == "encoder" else target_labels
    key_labels = target_labels if stack == "decoder" else source_labels
    if stack == "cross" and model.cfg.cross_downsample > 1:
        key_labels = None  # keys are pooled source positions, not tokens
    title = f"{stack} attention, layer {layer}, head {head}"
    return save_attention_heatmap(weights[batch_index, head], path, query_labels=query_labels, key_labels=key_labels,
                                  title=title, size_px=size_px)


def gradient_norms(model: nn.Module) -> dict[str, float | None]:
    """L2 norm of each parameter's gradient by name (tied parameters once); None where no gradient exists."""
    return {name: (None if p.grad is None else float(p.grad.detach().float().norm()))
            for name, p in model.named_parameters() if p.requires_grad}


def gradient_report(model: nn.Module, *, sort_by_norm: bool = False) -> tuple[str, dict[str, float | None]]:
    """A text table (parameter, shape, grad norm, weight norm, grad/weight) and the `gradient_norms` dict.

    Read after `loss.backward()` and before `optimizer.zero_grad()`. The last line is the global norm that
    gradient clipping would see.
    """
    norms = gradient_norms(model)
    params = dict(model.named_parameters())
    names = list(norms)
    if sort_by_norm:
        names.sort(key=lambda n: _or_lowest(norms[n]), reverse=True)
    width = max([len(n) for n in names] + [9])
    lines = [f"{'parameter':<{width}}  {'shape':>16}  {'grad_norm':>10}  {'weight_norm':>11}  {'ratio':>9}"]
    for name in names:
        weight_norm = float(params[name].detach().float().norm())
        grad = norms[name]
        grad_text = "no grad" if grad is None else f"{grad:.4e}"
        ratio = "-" if grad is None or weight_norm == 0 else f"{grad / weight_norm:.2e}"
        shape = "x".join(map(str, params[name].shape))
        lines.append(f"{name:<{width}}  {shape:>16}  {grad_text:>10}  {weight_norm:>11.4e}  {ratio:>9}")
    total = math.sqrt(sum(g * g for g in norms.values() if g is not None))
    lines.append(f"{'total (global L2)':<{width}}  {'':>16}  {total:>10.4e}")
    return "\n".join(lines), norms


def _or_lowest(norm: float | None) -> float:
    """Sort key: parameters without a gradient go last."""
    return -1.0 if norm is None else norm
