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
    """Any model folder `meshformer eval` reads (a run folder, its `final/`, a checkpoints or step folder, a weights
    export, a Hugging Face folder) as (model, tokenizer): the model on the CPU in fp32 and eval mode, `model(ids)`
    giving logits (batch, tokens, vocabulary) and `meshformer.model.generate.greedy_decode(model, ids, n)` continuing
    them; the tokenizer the folder carries (`tokenizer`: another spec, accepted only if it is the same tokenizer).
    """
    from meshformer.checkpointing.weights import load_for_inference
    from meshformer.eval.model_folder import load_model_folder, resolve_folder

    kind, path = resolve_folder(folder)
    if kind == "weights":  # the same loading as `meshformer generate`
        return load_for_inference(path, tokenizer, "tokenizer")
    model, carried = load_model_folder(path)
    if tokenizer is not None:
        from meshformer.data import load_tokenizer
        from meshformer.data.tokenizer import TokenizerError

        if load_tokenizer(tokenizer).fingerprint != carried.fingerprint:
            raise TokenizerError(f"tokenizer {tokenizer!r} is not the tokenizer {path} carries; leave tokenizer "
                                 "unset to use the folder's own")
    return model, carried
