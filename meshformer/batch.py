"""The batch contract shared by data (which builds batches), the model-facing layers and the loss.

A batch is a dict of tensors; `labels` marks positions that carry no loss with `IGNORE_INDEX`.
See meshformer/data/objectives.py for the keys each objective produces.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # a label that contributes no loss (padding, unmasked MLM positions); torch's default
MODEL_INPUTS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "doc_ids")

Batch = dict[str, torch.Tensor]


def model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """The keyword arguments of `Transformer.forward` present in a batch."""
    return {k: batch[k] for k in MODEL_INPUTS if k in batch}
