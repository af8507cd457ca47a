"""Greedy decoding of an imported Hugging Face model equals transformers' `generate(do_sample=False)` on a batch of
prompts of different lengths (left padding, KV cache), and `meshformer generate` frames prompts as the model's
tokenizer does (BOS where it adds one) and stops at its EOS."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_models import hf_folder, hf_model

from meshformer.checkpointing.hf import from_hf_model
from meshformer.model.generate import greedy_decode, left_pad

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 10


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_greedy_equals_transformers_generate(arch):
    theirs = hf_model(arch)
    ours = from_hf_model(theirs).eval()
    generator = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, 4096, (n,), generator=generator).tolist() for n in (3, 9, 6)]
    ids, padding = left_pad(rows, pad_id=0)
    expected = theirs.generate(input_ids=ids, attention_mask=padding.long(), max_new_tokens=NEW_TOKENS,
                               min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    for use_cache in (True, False):
        out = greedy_decode(ours, ids, NEW_TOKENS, prompt_padding=padding, use_cache=use_cache)
        assert out[:, ids.shape[1]:].tolist() == expected[:, ids.shape[1]:].tolist()
    assert len({tuple(row) for row in out[:, ids.shape[1]:].tolist()}) == 3  # rows of their own, not one repeated
