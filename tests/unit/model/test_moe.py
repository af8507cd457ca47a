"""The mixture-of-experts feed-forward (model/moe.py): routing against hand-computed examples, every compute path
equal, capacity dropping, shared experts, balance quantities against their formulas, bias balancing, counts and
FLOPs, and a tiny MoE decoder that trains."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from meshformer.config import ConfigError, config_from_dict, load_config
from meshformer.config.migrate import with_dotted
from meshformer.loss.cross_entropy import plain_loss_fn
from meshformer.loss.layer_terms import bind_layer_terms
from meshformer.model import Transformer
from meshformer.model.config import AttentionConfig, FfnConfig, ModelConfig, MoeConfig, moe_pattern
from meshformer.model.flops import count_params, flops_per_token
from meshformer.model.init import init_buffers, init_weights
from meshformer.model.layers import FeedForward
from meshformer.model.moe import (
    BACKENDS,
    MoEFeedForward,
    grouped_mm_runs,
    is_moe_block,
    moe_layers,
    route,
    update_expert_bias,
)
from meshformer.model.parallel_context import StageSpan
from meshformer.parallel.parallel_model import ParallelModel

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ModelConfig(vocab_size=101, d_model=32, n_layers=3, max_seq_len=16, attention=AttentionConfig(n_heads=4),
                    ffn=FfnConfig(d_ff=48, activation="swiglu"),
                    moe=MoeConfig(n_experts=4, experts_per_token=2, d_ff=24))


def layer(cfg: ModelConfig, seed: int = 0) -> MoEFeedForward:
    moe = MoEFeedForward(cfg)
    init_weights(moe.named_parameters(), cfg, seed)
    return moe


def log_probs(*p: float) -> torch.Tensor:
    return torch.tensor([p]).log()


# ------------------------------------------------------------------------------------------------------ routing


def test_softmax_top_k_with_and_without_renormalisation():
    logits = log_probs(0.1, 0.2, 0.3, 0.4)  # softmax gives these back
    plain = route(logits, 2, renormalize=False)
    assert plain.experts.tolist() == [[3, 2]]
    torch.testing.assert_close(plain.weights, torch.tensor([[0.4, 0.3]]))
    torch.testing.assert_close(route(logits, 2).weights, torch.tensor([[0.4 / 0.7, 0.3 / 0.7]]))


def test_sigmoid_scores_pick_and_weight():
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    r = route(logits, 2, score="sigmoid", renormalize=False)
    assert r.experts.tolist() == [[3, 1]]
    s = torch.sigmoid(torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(r.weights, s.unsqueeze(0))
    torch.testing.assert_close(route(logits, 2, score="sigmoid").weights, (s / s.sum()).unsqueeze(0))


def test_group_limited_routing_picks_the_best_group_first():
    # groups {0, 1} and {2, 3}: expert 0 is the best single expert, but group {2, 3} has the larger top-2 sum
    logits = log_probs(0.35, 0.0001, 0.33, 0.3199)
    assert route(logits, 2).experts.tolist() == [[0, 2]]
    assert route(logits, 2, groups=2, groups_per_token=1).experts.tolist() == [[2, 3]]
    assert sorted(route(logits, 2, groups=2, groups_per_token=2).experts.tolist()[0]) == [0, 2]


def test_expert_bias_changes_selection_but_not_weighting():
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    r = route(logits, 2, renormalize=False, bias=torch.tensor([0.0, 0.0, 0.5, 0.0]))
    assert r.experts.tolist() == [[2, 0]]
    torch.testing.assert_close(r.weights, torch.tensor([[0.2, 0.4]]))  # the unbiased scores


# ------------------------------------------------------------------------------------------------------ compute


def backends() -> list[str]:
    return [b for b in BACKENDS if b != "grouped_mm" or grouped_mm_runs("cpu")]


@pytest.mark.parametrize("extra", [{}, {"ffn.activation": "gelu"}, {"moe.capacity_factor": 1.0},
                                   {"moe.n_shared_experts": 1, "moe.router_score": "sigmoid", "moe.n_experts": 8,
                                    "moe.experts_per_token": 3, "moe.router_groups": 4,
                                    "moe.router_groups_per_token": 2}],
                         ids=["swiglu", "gelu", "capacity", "shared-sigmoid-groups"])
def test_every_compute_path_gives_the_same_output_and_gradients(extra):
    cfg = with_dotted(SMALL, extra)
    x = torch.randn(3, 7, cfg.d_model, generator=torch.Generator().manual_seed(1))
    results = {}
    for backend in backends():
        moe = layer(replace(cfg, moe=replace(cfg.moe, backend=backend)))
        xb = x.clone().requires_grad_()
        out = moe(xb)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results[backend] = (out, xb.grad, {n: p.grad for n, p in moe.named_parameters()})
    ref_out, ref_dx, ref_grads = results["loop"]
    for out, dx, grads in results.values():
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(dx, ref_dx)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], msg=name)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_layer_equals_a_per_token_sum_of_its_experts_forward_and_backward(k):
    """Against the definition, token by token: the permutation around the experts (a gather whose backward
    gathers too) must neither lose nor double any token's gradient."""
    cfg = replace(SMALL, moe=replace(SMALL.moe, experts_per_token=k, router_renormalize=False))
    moe = layer(cfg)
    reference = copy.deepcopy(moe)
    x = torch.randn(2, 5, cfg.d_model, generator=torch.Generator().manual_seed(3))
    probe = torch.randn(2, 5, cfg.d_model, generator=torch.Generator().manual_seed(4))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (moe(xa) * probe).sum().backward()
    e, flat = reference.experts, xb.view(-1, cfg.d_model)
    routing = route(reference.router(flat), k, renormalize=False)
    rows = []
    for t in range(flat.shape[0]):
        rows.append(sum(w * (F.silu(flat[t] @ e.gate_proj[i]) * (flat[t] @ e.up_proj[i])) @ e.down_proj[i]
                        for i, w in zip(routing.experts[t].tolist(), routing.weights[t], strict=True)))
    (torch.stack(rows).view_as(x) * probe).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad)
    for (name, p), q in zip(moe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)



@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_a_micro_batch_of_no_tokens_gives_an_empty_output_and_zero_gradients(k, capacity_factor):
    """No rows (e.g. an empty batch dimension): the k-way view and the gather's backward have no -1 to infer."""
    moe = layer(replace(SMALL,
                        moe=replace(SMALL.moe, experts_per_token=k, capacity_factor=capacity_factor, aux_loss=0.0,
                                    router_z_loss=0.0)))
    x = torch.zeros(0, 4, SMALL.d_model, requires_grad=True)
    out = moe(x)
    assert out.shape == x.shape
    out.sum().backward()
    assert x.grad.shape == x.shape
    assert all(p.grad is None or not p.grad.any() for p in moe.parameters())

def test_capacity_drops_tokens_beyond_it_and_counts_them():
    cfg = replace(SMALL, ffn=replace(SMALL.ffn, activation="gelu"),
                  moe=replace(SMALL.moe, experts_per_token=1, capacity_factor=1.0))
    moe = layer(cfg)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.expert_bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0]))  # every token chooses expert 0
    x = torch.randn(1, 8, cfg.d_model)
    out = moe(x)  # capacity = ceil(1.0 * 8 tokens * 1 / 4 experts) = 2: tokens 0 and 1 kept
    stats = moe.last_stats
    assert stats is not None
    assert stats.tokens_per_expert.tolist() == [8.0, 0.0, 0.0, 0.0]
    assert stats.dropped_fraction.item() == pytest.approx(6 / 8)
    assert out[0, 2:].abs().max() == 0
    e = moe.experts
    expected = F.gelu(x[0, :2] @ e.up_proj[0]) @ e.down_proj[0]  # weight 1: one expert, renormalised
    torch.testing.assert_close(out[0, :2], expected)


def test_shared_experts_add_a_dense_ffn_of_their_total_width():
    cfg = replace(SMALL, moe=replace(SMALL.moe, n_shared_experts=2))
    moe = layer(cfg)
    assert moe.shared_experts is not None and moe.shared_experts.up_proj.out_features == 2 * cfg.expert_d_ff
    x = torch.randn(2, 5, cfg.d_model)
    routed_only = copy.deepcopy(moe)
    routed_only.shared_experts = None
    torch.testing.assert_close(moe(x), routed_only(x) + moe.shared_experts(x))
    # one FFN of width 2f is the sum of two experts of width f (its halves)
    f, ffn = cfg.expert_d_ff, moe.shared_experts
    halves = []
    for part in (slice(0, f), slice(f, 2 * f)):
        half = FeedForward(replace(cfg, ffn=replace(cfg.ffn, d_ff=f)))
        with torch.no_grad():
            for name in ("gate_proj", "up_proj"):
                getattr(half, name).weight.copy_(getattr(ffn, name).weight[part])
                getattr(half, name).bias.copy_(getattr(ffn, name).bias[part])
            half.down_proj.weight.copy_(ffn.down_proj.weight[:, part])
            half.down_proj.bias.copy_(ffn.down_proj.bias / 2)
        halves.append(half(x))
    torch.testing.assert_close(ffn(x), halves[0] + halves[1])


# ------------------------------------------------------------------------------------------------------ balance


def direct_aux(scores: torch.Tensor, experts: torch.Tensor) -> float:
    n, e = scores.shape
    k = experts.shape[1]
    total = 0.0
    for i in range(e):
        fraction = (experts == i).sum().item() / (n * k)
        mean_score = sum(scores[t, i].item() / scores[t].sum().item() for t in range(n)) / n
        total += fraction * mean_score
    return e * total


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_and_z_losses_follow_their_formulas(score):
    cfg = replace(SMALL, moe=replace(SMALL.moe, router_score=score, aux_per_sequence=False))
    moe = layer(cfg)
    x = torch.randn(2, 6, cfg.d_model)
    moe(x)
    stats = moe.last_stats
    assert stats is not None
    logits = x.reshape(-1, cfg.d_model) @ moe.router.weight.T
    r = route(logits, cfg.moe.experts_per_token, score=score)
    assert stats.aux_loss.item() == pytest.approx(direct_aux(r.scores, r.experts), rel=1e-5)
    z = sum(torch.logsumexp(row, 0).item() ** 2 for row in logits) / logits.shape[0]
    assert stats.z_loss.item() == pytest.approx(z, rel=1e-5)
    # per sequence: the formula on each sequence's tokens, averaged
    per_sequence = [direct_aux(r.scores[i * 6:(i + 1) * 6], r.experts[i * 6:(i + 1) * 6]) for i in range(2)]
    per_seq_layer = layer(replace(cfg, moe=replace(cfg.moe, aux_per_sequence=True)))
    per_seq_layer(x)
    assert per_seq_layer.last_stats is not None
    assert per_seq_layer.last_stats.aux_loss.item() == pytest.approx(sum(per_sequence) / 2, rel=1e-5)


@pytest.mark.parametrize("per_sequence", [False, True])
def test_the_backward_adds_the_weighted_balance_terms(per_sequence):
    cfg = replace(SMALL, moe=replace(SMALL.moe, aux_per_sequence=per_sequence))
    moe = layer(cfg)
    bind_layer_terms([moe], {"moe/aux_loss": 0.01, "moe/z_loss": 0.001})  # the objective's weights
    moe.loss_terms.scale = 0.25  # e.g. 4 micro-batches in the step
    x = torch.randn(2, 6, cfg.d_model)
    (moe(x) * 0).sum().backward()  # only the balance terms reach the router
    weight = moe.router.weight.detach().clone().requires_grad_()
    logits = x.reshape(-1, cfg.d_model) @ weight.T
    r = route(logits, cfg.moe.experts_per_token)
    probs = r.scores / r.scores.sum(-1, keepdim=True)
    slots = F.one_hot(r.experts, cfg.moe.n_experts).sum(1).float()
    pieces = 2 if per_sequence else 1
    aux = sum(cfg.moe.n_experts * (s.mean(0) / cfg.moe.experts_per_token * p.mean(0)).sum()
              for s, p in zip(slots.chunk(pieces), probs.chunk(pieces))) / pieces
    z = logits.logsumexp(-1).square().mean()
    (0.25 * (0.01 * aux + 0.001 * z)).backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    torch.testing.assert_close(moe.router.weight.grad, weight.grad)
    assert moe.last_stats is not None
    assert moe.last_stats.aux_loss.item() == pytest.approx(aux.item(), rel=1e-5)


def test_no_balance_terms_leave_the_router_without_a_gradient_from_them():
    moe = layer(SMALL)
    (moe(torch.randn(2, 6, SMALL.d_model)) * 0).sum().backward()
    assert moe.router.weight.grad is None or moe.router.weight.grad.abs().sum() == 0


def test_training_forwards_accumulate_the_load_that_the_bias_update_reads():
    cfg = replace(SMALL, moe=replace(SMALL.moe, router_bias_update_rate=0.1))
    moe = layer(cfg)
    x = torch.randn(2, 6, cfg.d_model)
    with torch.no_grad():
        moe(x)  # evaluation: not a training load
    assert moe.tokens_this_step.sum() == 0
    moe(x)
    moe(x)
    assert moe.last_stats is not None
    torch.testing.assert_close(moe.tokens_this_step, 2 * moe.last_stats.tokens_per_expert)
    assert moe.tokens_this_step.sum() == 2 * 12 * cfg.moe.experts_per_token
    moe.tokens_this_step.copy_(torch.tensor([3.0, 1.0, 0.0, 4.0]))  # mean 2
    update_expert_bias([moe])
    torch.testing.assert_close(moe.router.expert_bias, torch.tensor([-0.1, 0.1, 0.1, -0.1]))
    assert moe.tokens_this_step.sum() == 0  # the next step starts afresh
    moe.tokens_this_step.copy_(torch.tensor([3.0, 1.0, 0.0, 4.0]))
    update_expert_bias([moe], applied=torch.tensor(0.0))  # a skipped step (inf/nan norm): the bias stays too
    torch.testing.assert_close(moe.router.expert_bias, torch.tensor([-0.1, 0.1, 0.1, -0.1]))
    assert moe.tokens_this_step.sum() == 0


def test_recomputation_in_backward_does_not_count_the_load_twice():
    from torch.utils.checkpoint import checkpoint

    moe = layer(SMALL)
    x = torch.randn(2, 6, SMALL.d_model, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.tokens_this_step.sum() == 12 * SMALL.moe.experts_per_token


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_a_compiled_moe_block_is_one_graph_that_counts_its_load_once(recompute):
    """torch.compile traces the MoE layer whole (fullgraph: any graph break fails). A break inside a recomputed block
    sends the whole block back to eager; one in the middle of the layer splits its graph, forward and backward. The
    compiled recomputation replays no buffer update, so the load is counted once, and the numbers are eager's."""
    from meshformer.parallel.fsdp import blocks_of
    from meshformer.parallel.recompute import apply_recompute

    cfg = replace(SMALL, n_layers=1,
                  moe=replace(SMALL.moe, backend="grouped_mm", router_bias_update_rate=0.1))  # the GPU's backend
    models = [Transformer(cfg, init_seed=0).to(torch.bfloat16) for _ in range(2)]
    apply_recompute(models[1], recompute)
    for block in blocks_of(models[1]):
        block.compile(backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    for model in models:
        model(ids).float().square().sum().backward()
    (_, eager), (_, compiled) = (next(moe_layers(model)) for model in models)
    assert compiled.tokens_this_step.sum() == 16 * cfg.moe.experts_per_token
    torch.testing.assert_close(compiled.tokens_this_step, eager.tokens_this_step)
    torch.testing.assert_close(compiled.latest, eager.latest)
    grads = [[p.grad.float() for p in model.parameters()] for model in models]
    scale = torch.stack([g.norm() for g in grads[0]]).max()
    for name, a, b in zip(dict(models[0].named_parameters()), *grads, strict=True):
        # bf16 (eps 7.8e-3): the compiled graph rounds elsewhere; a gradient that is zero in exact arithmetic (the
        # key bias's) is measured against the largest
        assert (b - a).norm() < 2e-2 * torch.maximum(a.norm(), 1e-2 * scale), name


@pytest.mark.parametrize("backend", ["auto", "loop"])
@torch._dynamo.config.patch(capture_scalar_outputs=False)  # restored after the test
def test_compiled_cpu_backends_match_eager(backend):
    """On CPU in fp32, "auto" compiles the padded backend (its padded size a traced symbolic size: one graph); an
    explicit loop runs eagerly inside the compiled block (its sizes are read on the host), with the same numbers."""
    from meshformer.parallel.fsdp import blocks_of
    from meshformer.parallel.kernels import trace_routed_sizes

    torch._dynamo.reset()
    cfg = replace(SMALL, n_layers=1, moe=replace(SMALL.moe, backend=backend))
    models = [Transformer(cfg, init_seed=0) for _ in range(2)]
    trace_routed_sizes(models[1])
    for block in blocks_of(models[1]):
        block.compile(backend="aot_eager", fullgraph=backend == "auto")
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    outs = [model(ids) for model in models]
    for out in outs:
        out.square().sum().backward()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("recompute", ["none", "selective"])
@torch._dynamo.config.patch(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False)  # restored after
def test_a_compiled_moe_block_with_a_capacity_is_one_graph(recompute):
    """capacity_factor > 0: the kept rows (a mask over routed sizes) are traced and the path taken does not depend on
    what was dropped, so the block stays one graph (fullgraph); drops, load and gradients are eager's."""
    from meshformer.parallel.fsdp import blocks_of
    from meshformer.parallel.kernels import trace_routed_sizes
    from meshformer.parallel.recompute import apply_recompute

    torch._dynamo.reset()
    cfg = replace(SMALL, n_layers=1, moe=replace(SMALL.moe, backend="padded", capacity_factor=1.0))
    models = [Transformer(cfg, init_seed=0) for _ in range(2)]
    apply_recompute(models[1], recompute)
    trace_routed_sizes(models[1])
    for block in blocks_of(models[1]):
        block.compile(backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    for model in models:
        model(ids).square().sum().backward()
    (_, eager), (_, compiled) = (next(moe_layers(model)) for model in models)
    assert eager.last_stats.dropped_fraction > 0  # the case it stands for: slots were dropped
    torch.testing.assert_close(compiled.tokens_this_step, eager.tokens_this_step)
    torch.testing.assert_close(compiled.latest, eager.latest)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------------------ model


def test_which_blocks_are_moe():
    cfg = replace(SMALL, n_layers=6, mlp_types=moe_pattern(moe_every=2, moe_first_dense=2, n_layers=6))
    assert [is_moe_block(cfg, i) for i in range(6)] == [False, False, False, True, False, True]
    assert not any(is_moe_block(replace(cfg, moe=replace(cfg.moe, n_experts=0)), i) for i in range(6))
    model = Transformer(cfg, init_seed=0)
    assert model.decoder_layers is not None
    assert [isinstance(b.ffn, MoEFeedForward) for b in model.decoder_layers.values()] == [is_moe_block(cfg, i)
                                                                                         for i in range(6)]


@pytest.mark.parametrize("change", [
    lambda c: c,
    lambda c: replace(c, bias=False, mlp_types=["dense", "moe", "moe"], moe=replace(c.moe, n_shared_experts=2)),
    lambda c: replace(c, family="encoder_decoder", mlp_types=["dense", "moe"], ffn=replace(c.ffn, activation="gelu")),
])
def test_total_and_active_params_and_flops(change):
    cfg = change(SMALL)
    counts = count_params(cfg)
    with torch.device("meta"):
        built = Transformer(cfg)
    assert counts["total"] == sum(p.numel() for p in built.parameters())
    moe_blocks = [m for _, m in moe_layers(built)]
    per_expert = sum(p[0].numel() for p in built.parameters() if p.dim() == 3) // len(moe_blocks)
    unused = cfg.moe.n_experts - cfg.moe.experts_per_token
    assert counts["active"] == counts["total"] - len(moe_blocks) * unused * per_expert
    # FLOPs: a dense model whose FFN is the active one, plus the router, where each MoE block's FFN is
    width = cfg.moe.experts_per_token * cfg.expert_d_ff
    if cfg.moe.n_shared_experts == 0 and not cfg.mlp_types and width == cfg.ffn.d_ff:
        dense = replace(cfg, moe=replace(cfg.moe, n_experts=0))
        routers = 6 * len(moe_blocks) * cfg.moe.n_experts * cfg.d_model
        assert flops_per_token(cfg, 16) == flops_per_token(dense, 16) + routers


def test_dense_config_counts_are_unchanged():
    cfg = replace(SMALL, moe=replace(SMALL.moe, n_experts=0))
    assert count_params(cfg)["active"] == count_params(cfg)["total"]


@pytest.mark.parametrize("family", ["decoder", "encoder", "encoder_decoder"])
def test_every_family_builds_and_trains_with_moe_blocks(family):
    cfg = replace(SMALL, family=family, moe=replace(SMALL.moe, n_shared_experts=1, aux_loss=0.01))
    model = Transformer(cfg, init_seed=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    extra = {"decoder_input_ids": ids} if family == "encoder_decoder" else {}
    logits = model(ids, **extra)
    assert isinstance(logits, torch.Tensor)
    F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()  # the balance term joins in the backward
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_initial_weights_do_not_depend_on_how_the_model_is_built():
    cfg = replace(SMALL, moe=replace(SMALL.moe, n_shared_experts=1), init=replace(SMALL.init, method="xavier"))
    eager = Transformer(cfg, init_seed=7)
    with torch.device("meta"):
        meta = Transformer(cfg, init_seed=7)
    meta.to_empty(device="cpu")
    meta.init_weights()
    init_buffers(meta)
    stage = Transformer(cfg, init_seed=7, span=StageSpan(index=1, n_stages=2, start=2, stop=3))
    whole = eager.state_dict()
    for name, value in meta.state_dict().items():
        assert torch.equal(value, whole[name]), name
    for name, value in stage.state_dict().items():
        assert torch.equal(value, whole[name]), name
    experts = eager.decoder_layers["0"].ffn.experts  # type: ignore[index]
    assert not torch.equal(experts.up_proj[0], experts.up_proj[1])  # each expert its own draw
    normal = Transformer(replace(cfg, d_model=64, moe=replace(cfg.moe, d_ff=64),
                                 init=replace(cfg.init, method="normal")), init_seed=7).decoder_layers
    experts = normal["0"].ffn.experts  # type: ignore[index]
    assert experts.up_proj.std().item() == pytest.approx(cfg.init.std, rel=0.05)
    residual = cfg.init.std / math.sqrt(2 * cfg.n_layers)  # scaled down as a residual output
    assert experts.down_proj.std().item() == pytest.approx(residual, rel=0.05)


def test_bad_moe_configs_fail_with_one_line():
    cases = [
        (dict(n_experts=4, experts_per_token=5), "experts_per_token=5"),
        (dict(n_experts=6, router_groups=4), "router_groups=4 does not divide"),
        (dict(n_experts=8, router_groups=4, router_groups_per_token=5), "router_groups_per_token=5"),
        (dict(n_experts=8, experts_per_token=4, router_groups=4, router_groups_per_token=1), "fewer than"),
        (dict(n_experts=4, capacity_factor=-1.0), "capacity_factor"),
        (dict(n_experts=4, moe_every=0), "moe_every"),
        (dict(moe={"n_experts": 4}, mlp_types=["expert"]), "model.mlp_types holds 'expert'"),
        (dict(mlp_types=["moe"]), "n_experts = 0"),
    ]
    for model, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            config_from_dict({"model": model})
        assert "\n" not in str(err.value)
    from meshformer.parallel_dims import validate_parallel

    layouts = [({"tp": 2}, 2, "set parallel.ep to a multiple of tp"),
               ({"ep": 3}, 4, "parallel.ep=3 does not divide model.moe.n_experts=4"),
               ({"ep": 2, "cp": 4}, 4, r"choose ep in \[4\]"),
               ({"ep": 4}, 2, r"choose ep in \[1, 2\]")]
    for parallel, world, message in layouts:
        cfg = config_from_dict({"model": {"n_experts": 4}, "parallel": parallel, "data": {"seq_len": 16}})
        with pytest.raises(ConfigError, match=message) as err:
            validate_parallel(cfg, world, "cpu")
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="the model has none"):
        validate_parallel(config_from_dict({"parallel": {"ep": 2}}), 2, "cpu")


def test_a_grouped_mm_backend_that_cannot_run_fails_at_validation_in_one_line(monkeypatch):
    from meshformer.model import moe
    from meshformer.parallel_dims import validate_parallel

    def grouped_mm(dtype: str) -> dict:
        return {"model": {"n_experts": 4, "moe_backend": "grouped_mm"}, "train": {"dtype": dtype}}

    with pytest.raises(ConfigError, match="runs bf16 rows on CUDA, but this run computes in fp32") as err:
        validate_parallel(config_from_dict(grouped_mm("fp32")), 1, "cuda", on_this_host=False)
    assert "\n" not in str(err.value) and "moe.backend='auto'" in err.value.one_line()
    validate_parallel(config_from_dict(grouped_mm("bf16")), 1, "cuda", on_this_host=False)  # not checked off-host
    monkeypatch.setattr(moe, "grouped_mm_runs", lambda device_type: False)  # e.g. an A100, or a CPU build without it
    with pytest.raises(ConfigError, match="torch._grouped_mm does not run on this cpu") as err:
        validate_parallel(config_from_dict(grouped_mm("fp32")), 1, "cpu")
    assert "\n" not in str(err.value) and "moe.backend='auto'" in err.value.one_line()
    validate_parallel(config_from_dict({"model": {"n_experts": 4, "moe_backend": "auto"}}), 1, "cpu")


def test_tiny_moe_trains_with_falling_loss():
    cfg = load_config("tiny-moe").model
    cfg = replace(cfg, d_model=64, n_layers=2, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(cfg)
    trainer = ParallelModel(model, plain_loss_fn(), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, cfg.vocab_size, (4, 33))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    tokens = torch.tensor(float(batch["labels"].numel()))
    losses = []
    for _ in range(8):
        losses.append(float(trainer.forward_backward(batch, tokens)) / tokens.item())
        optimizer.step()
        optimizer.zero_grad()
    assert losses[-1] < losses[0] - 0.5
    assert math.isfinite(losses[-1])
