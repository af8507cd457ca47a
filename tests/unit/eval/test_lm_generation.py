"""Generation in meshformer's lm-eval model (meshformer/eval/lm.py): sampled generation (lm-eval's `do_sample`,
`temperature`, `top_k`, `top_p`) seeded per request, and decoding step by step through a layout's next-token logits
(what a pipeline runs: no cache) giving the tokens the cached decoding gives, greedy and sampled."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_models import hf_model

from meshformer.errors import UsageError
from meshformer.eval.lm import Sampling, request_seeds

GREEDY = {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}
SAMPLED = {"until": ["\n"], "max_gen_toks": 6, "do_sample": True, "temperature": 0.9, "top_k": 40, "top_p": 0.95}


def _generators(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def test_a_rows_draw_does_not_depend_on_the_rows_beside_it():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sampling = Sampling(temperature=1.0, top_k=0, top_p=1.0)
    alone = sampling.pick(logits[1:2], _generators(7))
    together = sampling.pick(logits, _generators(3, 7, 11))
    assert together[1] == alone[0]
    draws = torch.stack([sampling.pick(logits[:1], _generators(seed)) for seed in range(200)])
    assert len(set(draws.flatten().tolist())) > 5  # it samples: many seeds, many tokens


def test_top_k_and_top_p_keep_the_most_likely_tokens():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(Sampling(1.0, top_k=1, top_p=1.0).pick(logits, _generators(0, 1, 2, 3)), logits.argmax(-1))
    assert torch.equal(Sampling(1.0, top_k=0, top_p=1e-6).pick(logits, _generators(0, 1, 2, 3)), logits.argmax(-1))
    top3 = set(logits[0].topk(3).indices.tolist())
    picks = {int(Sampling(5.0, top_k=3, top_p=1.0).pick(logits[:1], _generators(s))[0]) for s in range(100)}
    assert picks == top3  # a high temperature spreads the draws over the three kept tokens, and none else


def test_options_choose_greedy_or_sampling_and_refuse_beams():
    assert Sampling.from_options({"do_sample": False, "temperature": 0.7}) is None
    assert Sampling.from_options({"do_sample": True, "temperature": 0.0}) is None
    sampling = Sampling.from_options({"do_sample": True, "temperature": 0.7, "top_p": 0.9})
    assert sampling is not None and (sampling.temperature, sampling.top_k, sampling.top_p) == (0.7, 0, 0.9)
    with pytest.raises(UsageError, match="beam search"):
        Sampling.from_options({"num_beams": 4})
    with pytest.raises(UsageError, match="top_p"):
        Sampling.from_options({"do_sample": True, "temperature": 1.0, "top_p": 0.0})


def _request(context: str, options: dict, doc_id: int, task: str = "t"):
    from lm_eval.api.instance import Instance

    return Instance(request_type="generate_until", doc={}, arguments=(context, dict(options)), idx=0,
                    metadata=(task, doc_id, 1))


def test_seeds_follow_the_request_not_its_place():
    a, b = _request("In the beginning", SAMPLED, 0), _request("And God said", SAMPLED, 1)
    assert request_seeds([a, b], 1234) == request_seeds([b, a], 1234)[::-1]
    repeated = request_seeds([a, a, b], 1234)
    assert len(set(repeated)) == 3  # lm-eval's repeats of one request draw apart
    assert request_seeds([a], 1234) != request_seeds([a], 1235)


class WholePrefix:
    """Next-token logits of whole prefixes through the model without a cache, as the layout's step gives them."""

    rows_per_call = 3

    def __init__(self, model) -> None:
        self.model, self.calls = model, 0

    def __call__(self, sequences: list[list[int]]) -> torch.Tensor:
        self.calls += 1
        width = max(map(len, sequences))
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        for row, tokens in enumerate(sequences):
            ids[row, :len(tokens)] = torch.tensor(tokens)
        with torch.no_grad():
            logits = self.model(ids).float()
        return torch.stack([logits[row, len(tokens) - 1] for row, tokens in enumerate(sequences)])


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from meshformer.checkpointing.hf import from_hf_model
    from meshformer.data import load_tokenizer

    return from_hf_model(hf_model("llama")).eval(), load_tokenizer("bundled:kjv-bpe-4k")


@pytest.mark.parametrize("options", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_stepwise_decoding_gives_the_cached_decodings_tokens(model_and_tokenizer, options):
    from meshformer.eval.lm import MeshformerLM

    model, tokenizer = model_and_tokenizer
    contexts = ["In the beginning God", "And the earth was", "Blessed are the", "For God so loved the", "Jesus"]
    requests = [_request(text, options, i) for i, text in enumerate(contexts)]
    cached = MeshformerLM(model=model, tokenizer=tokenizer, batch_size=2)
    step = WholePrefix(model)
    stepwise = MeshformerLM(tokenizer=tokenizer, scorer=lambda pairs: [], next_logits=step, batch_size=2,
                            max_length=model.cfg.max_seq_len)
    texts = cached.generate_until(requests)
    assert stepwise.generate_until(requests) == texts
    assert step.calls > 0 and any(texts)
    if options is SAMPLED:  # sampled: another seed draws other texts, the same seed the same ones in any order
        assert MeshformerLM(model=model, tokenizer=tokenizer, seed=7).generate_until(requests) != texts
        assert cached.generate_until(requests[::-1]) == texts[::-1]
