"""The `hash_moe` channel mixer (model/moe.py's HashRoutedMoE, DeepSeek-V4's first blocks): its experts and weights
equal transformers 5.24's DeepseekV4HashRouter's with the same gate and table, its output the weighted sum of those
experts computed one by one; inside a model the block hands it the token ids (the table steers the output); a missing
id is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

from meshformer.config.migrate import model_from_flat
from meshformer.model.config import ModelConfig, MoeConfig
from meshformer.model.moe import HashRoutedMoE

pytestmark = pytest.mark.usefixtures("one_thread")

D, VOCAB, EXPERTS, K, SCALE = 16, 40, 6, 2, 1.5


def ours() -> ModelConfig:
    return model_from_flat(vocab_size=VOCAB, d_model=D, n_layers=2, n_heads=2, norm="rmsnorm", bias=False,
                           d_ff=24, activation="swiglu", mlp_types=["hash_moe", "moe"],
                           moe=MoeConfig(n_experts=EXPERTS, experts_per_token=K, d_ff=12, router_score="sigmoid",
                                         router_scale=SCALE))


def table() -> torch.Tensor:
    return torch.stack([torch.randperm(EXPERTS)[:K] for _ in range(VOCAB)])


@torch.no_grad()
def test_routing_equals_transformers_and_output_is_the_weighted_experts() -> None:
    torch.manual_seed(0)
    from meshformer.model import Transformer

    model = Transformer(ours(), init_seed=1)
    moe = model.decoder_layers["0"].ffn
    assert isinstance(moe, HashRoutedMoE) and not isinstance(model.decoder_layers["1"].ffn, HashRoutedMoE)
    for p in moe.parameters():
        p.normal_(std=0.3)
    moe.experts_of_token.copy_(table())
    hf = DeepseekV4Config(hidden_size=D, vocab_size=VOCAB, n_routed_experts=EXPERTS, num_experts_per_tok=K,
                          routed_scaling_factor=SCALE, num_hidden_layers=1)
    theirs = DeepseekV4HashRouter(hf)
    theirs.weight.copy_(moe.router.weight), theirs.tid2eid.copy_(moe.experts_of_token)
    x, ids = torch.randn(2, 7, D), torch.randint(0, VOCAB, (2, 7))
    _, expected_weights, expected_experts = theirs(x, ids)
    _, routing = moe._route(x.flatten(0, 1), ids)
    assert torch.equal(routing.experts, expected_experts)
    torch.testing.assert_close(routing.weights, expected_weights, rtol=0, atol=1e-6)
    e = moe.experts
    expected = torch.zeros(14, D)
    for row, (token, experts, weights) in enumerate(zip(x.flatten(0, 1), expected_experts, expected_weights,
                                                        strict=True)):
        for expert, weight in zip(experts.tolist(), weights, strict=True):
            hidden = F.silu(token @ e.gate_proj[expert]) * (token @ e.up_proj[expert])
            expected[row] += weight * (hidden @ e.down_proj[expert])
    torch.testing.assert_close(moe(x, token_ids=ids), expected.view(2, 7, D), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="need each of their tokens. ids"):
        moe(x)


@torch.no_grad()
def test_the_block_hands_the_ids_to_the_mixer() -> None:
    """The model's logits follow the table: another table, other logits; the same table, the same logits."""
    from meshformer.model import Transformer

    torch.manual_seed(1)
    from meshformer.model.flops import count_params

    model = Transformer(ours(), init_seed=2).eval()
    assert count_params(ours())["total"] == sum(p.numel() for p in model.parameters())  # the table is a buffer
    moe = model.decoder_layers["0"].ffn
    ids = torch.randint(0, VOCAB, (2, 5))
    moe.experts_of_token.copy_(table())
    first = model(ids)
    assert torch.equal(model(ids), first)
    moe.experts_of_token.copy_((moe.experts_of_token + 1) % EXPERTS)
    assert not torch.allclose(model(ids), first)


def test_export_refuses_hash_routing() -> None:
    """No adapter writes the table: exporting as DeepSeek-V3 (MoE with dense first blocks) names it."""
    from meshformer.checkpointing.hf import incompatibilities

    refused = "kind 'hash_moe' (no declaration lets a deepseek_v3 export write it)"
    assert refused in incompatibilities(ours(), "deepseek_v3")


@torch.no_grad()
def test_sqrt_softplus_routing_equals_transformers_learned_router() -> None:
    """V4's other MoE blocks: top-k of the sqrt-softplus scores plus the selection bias, weighted by the scores
    alone, normalised and scaled."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    from meshformer.model.moe import route

    torch.manual_seed(3)
    hf = DeepseekV4Config(hidden_size=D, vocab_size=VOCAB, n_routed_experts=EXPERTS, num_experts_per_tok=K,
                          routed_scaling_factor=SCALE, num_hidden_layers=1)
    theirs = DeepseekV4TopKRouter(hf)
    theirs.weight.normal_(std=0.5), theirs.e_score_correction_bias.normal_(std=0.3)
    x = torch.randn(20, D)
    _, expected_weights, expected_experts = theirs(x)
    routing = route(F.linear(x, theirs.weight), K, score="sqrt_softplus", bias=theirs.e_score_correction_bias,
                    scale=SCALE)
    order, expected_order = routing.experts.argsort(-1), expected_experts.argsort(-1)
    assert torch.equal(routing.experts.gather(1, order), expected_experts.gather(1, expected_order))
    torch.testing.assert_close(routing.weights.gather(1, order), expected_weights.gather(1, expected_order),
                               rtol=0, atol=1e-6)
