"""meshformer: pretraining for the classic Transformer family. The command is `meshformer` (meshformer/cli.py);
from Python, `meshformer.load(folder)` gives a trained model and its tokenizer, and `meshformer.train.trainer.train`
trains from a config."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshformer.data import Tokenizer
    from meshformer.model import Transformer


def load(folder: str | Path, tokenizer: str | None = None) -> tuple[Transformer, Tokenizer]:
    """A weights folder (a run's `final/`, a `convert to-safetensors` export) as (model, tokenizer): the model on the
    CPU in fp32 and eval mode, `model(ids)` giving logits (batch, tokens, vocabulary) and
    `meshformer.model.generate.greedy_decode(model, ids, n)` continuing them; the tokenizer the folder carries
    (`tokenizer`: another spec, accepted only if it is the same tokenizer). The same loading as `meshformer generate`.
    """
    from meshformer.checkpointing.weights import load_for_inference

    return load_for_inference(Path(folder), tokenizer, "tokenizer")
