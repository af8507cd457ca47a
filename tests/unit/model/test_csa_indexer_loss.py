"""The csa indexer's training objective (model/compressed_attention.py `index_kl`): the blockwise loss against a
hand-written per-query reference (sparse stage and warm-up), its gradient reaching the indexer only and leaving the
main parameters' gradients as they are, a few steps on it alone lowering it, tensor parallel's target (half the
heads with the other half's mass summed in), the objective's wiring and logging, and the config refusals."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

from meshformer.errors import ConfigError
from meshformer.model.compressed_attention import INDEX_LOSS, CompressedAttention, rotary_tables, rotate_tail
from meshformer.model.config import CompressedAttentionConfig, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

D, HEADS, HEAD_DIM, ROPE, WINDOW, RATE, TOPK = 32, 4, 16, 4, 3, 2, 2
INDEX_HEADS, INDEX_DIM, T = 2, 8, 13


def _module(dense: bool = False, seed: int = 0) -> CompressedAttention:
    torch.manual_seed(seed)
    m = CompressedAttention(D, HEADS, HEAD_DIM, 16, ROPE, WINDOW, 2, 8, 1e-6, 1e4, 1.6e5, compress_rate=RATE,
                            index=(INDEX_HEADS, INDEX_DIM, TOPK), dense=dense)
    for p in m.parameters():
        nn.init.normal_(p, std=0.3)
    m.query_block = 4  # 13 queries in 4 blocks: the loss is summed over blocks
    m.loss_terms.weights = {INDEX_LOSS: 1.0}
    return m.train()


def _reference(m: CompressedAttention, x: torch.Tensor, real: torch.Tensor | None = None
               ) -> tuple[float, int]:
    """(summed KL, counted queries), one query and one head at a time in float64, from the module's projections."""
    assert m.compressor is not None and m.indexer is not None
    batch, length, _ = x.shape
    pos = torch.arange(length)
    with torch.no_grad():
        cos, sin = rotary_tables(pos, m.rope_dim, m.theta, m.scaling)
        latent, q, kv = m._project(x, cos, sin)
        entries = m.compressor.entries(x, [(0, length, 0)], None)
        ikeys = m.indexer.entries(x, [(0, length, 0)], None)
        picks = m.indexer.chosen(x, latent, pos, ikeys)[0]
        icos, isin = rotary_tables(pos, ROPE, m.indexer.rope_theta, m.indexer.scaling)
        iq = rotate_tail(m.indexer.q_b_proj(latent).unflatten(-1, (INDEX_HEADS, INDEX_DIM)), icos[:, None],
                         isin[:, None]).double()
        gates = m.indexer.weights_proj(x).double() / math.sqrt(INDEX_HEADS)
        q, kv, entries, ikeys = q.double(), kv.double(), entries.double(), ikeys.double()
    total, count = 0.0, 0
    for b in range(batch):
        for t in range(length):
            visible = (t + 1) // RATE
            if not visible or (real is not None and not bool(real[b, t])):
                continue
            kept = list(range(visible)) if m.dense else [int(w) for w in picks[b, t] if int(w) < visible]
            index = torch.stack([sum(gates[b, t, h] * torch.relu(iq[b, t, h] @ ikeys[b, w]) / math.sqrt(INDEX_DIM)
                                     for h in range(INDEX_HEADS)) for w in kept])
            mass = torch.zeros(len(kept), dtype=torch.float64)
            for h in range(HEADS):
                window = kv[b, max(0, t - WINDOW + 1):t + 1]
                logits = torch.cat([window @ q[b, h, t], entries[b, kept] @ q[b, h, t]]) / math.sqrt(HEAD_DIM)
                probs = torch.cat([logits, m.sinks[h].double().view(1)]).softmax(0)
                mass += probs[len(window):-1]
            p = mass / mass.sum()
            total += float((p * (p.log() - index.log_softmax(0))).sum().detach())
            count += 1
    return total, count


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "warmup"])
def test_loss_equals_a_hand_written_reference(dense: bool) -> None:
    m = _module(dense)
    x = torch.randn(2, T, D)
    real = torch.ones(2, T, dtype=torch.bool)
    real[1, 10:] = False  # right padding: those queries are not counted
    m(x, torch.arange(T), real=real)
    total, count = _reference(m, x, real)
    assert m._loss_count is not None and m._loss_sum is not None
    assert int(m._loss_count) == count == 2 * (T - 1) - 3  # queries 0 and 1 see no entry yet
    assert abs(float(m._loss_sum) - total) < 1e-6, (float(m._loss_sum), total)  # summed over the 21 queries
    assert float(m.term_values()[INDEX_LOSS]) == pytest.approx(total / count, abs=1e-6)
    assert total > 0


def test_gradient_reaches_only_the_indexer_and_leaves_the_main_gradients() -> None:
    x = torch.randn(2, T, D)
    grads: list[dict[str, torch.Tensor | None]] = []
    for weight in (0.0, 1.0):
        m = _module()
        m.loss_terms.weights = {INDEX_LOSS: weight}
        m(x, torch.arange(T)).square().mean().backward()
        grads.append({name: p.grad for name, p in m.named_parameters()})
    for name, without in grads[0].items():
        if name.startswith("indexer."):
            assert without is None, name
            assert grads[1][name] is not None and grads[1][name].abs().sum() > 0, name  # type: ignore[union-attr]
        else:
            assert without is not None and torch.equal(without, grads[1][name]), name  # type: ignore[arg-type]
    # the term alone: nothing but the indexer receives a gradient, the input neither
    m, xg = _module(), x.clone().requires_grad_()
    (m(xg, torch.arange(T)) * 0).sum().backward()
    for name, p in m.named_parameters():
        if name.startswith("indexer."):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None or not p.grad.any(), name
    assert xg.grad is not None and not xg.grad.any()


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "warmup"])
def test_training_on_the_term_alone_lowers_it(dense: bool) -> None:
    m = _module(dense)
    assert m.indexer is not None
    x = torch.randn(2, T, D)
    optimizer = torch.optim.Adam(m.indexer.parameters(), lr=3e-2)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        m.start_forward()
        (m(x, torch.arange(T)) * 0).sum().backward()
        losses.append(float(m.term_values()[INDEX_LOSS]))
        optimizer.step()
    assert losses[-1] < 0.5 * losses[0], losses


def test_off_by_default_and_under_eval() -> None:
    m = _module()
    m.loss_terms.weights = {}
    m(torch.randn(1, T, D), torch.arange(T))
    assert m.term_values() == {}
    m = _module().eval()
    m(torch.randn(1, T, D), torch.arange(T))
    assert m.term_values() == {}


def _head_share(m: CompressedAttention, rank: int) -> CompressedAttention:
    """Tensor-parallel rank `rank` of 2's module (`shard_heads`), its heads' rows and groups cut as the styles do."""
    share = copy.deepcopy(m)
    share.shard_heads(2, rank, lambda t: t)
    heads, groups = slice(rank * HEADS // 2, (rank + 1) * HEADS // 2), slice(rank * 8, (rank + 1) * 8)
    with torch.no_grad():
        share.sinks = nn.Parameter(m.sinks[heads].clone())
        share.q_b_proj.weight = nn.Parameter(m.q_b_proj.weight.unflatten(0, (HEADS, -1))[heads].flatten(0, 1).clone())
        share.output.o_a_proj = nn.Parameter(m.output.o_a_proj[groups].clone())
        share.output.o_b_proj.weight = nn.Parameter(m.output.o_b_proj.weight[:, groups].clone())
    return share


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "warmup"])
def test_tensor_parallel_target_sums_every_heads_mass(dense: bool) -> None:
    """A rank holding half the heads, with the other rank's mass summed in (`sum_heads`, as tensor parallel's
    all-reduce), computes the whole module's loss and indexer gradients; without the sum it does not."""
    x = torch.randn(2, T, D)

    def loss_and_grads(m: CompressedAttention) -> tuple[float, dict[str, torch.Tensor]]:
        (m(x, torch.arange(T)) * 0).sum().backward()  # the term alone
        assert m._loss_sum is not None and m.indexer is not None
        return float(m._loss_sum), {n: p.grad for n, p in m.indexer.named_parameters() if p.grad is not None}

    whole, whole_grads = loss_and_grads(_module(dense))
    other, masses = _head_share(_module(dense), 1), []

    def kept(mass: torch.Tensor) -> torch.Tensor:  # rank 1's share of each query block's mass
        masses.append(mass.clone())
        return mass

    other.sum_heads = kept
    loss_and_grads(other)
    share = _head_share(_module(dense), 0)
    share.sum_heads = lambda t: t + masses.pop(0)
    summed, grads = loss_and_grads(share)
    assert not masses and abs(summed - whole) < 1e-6, (summed, whole)  # as the float64 reference above
    assert grads.keys() == whole_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert (grad - whole_grads[name]).abs().max() < 1e-5 * whole_grads[name].abs().max(), name
    alone, _ = loss_and_grads(_head_share(_module(dense), 0))  # its own heads' mass only: another target
    assert abs(alone - whole) > 0.1 * whole, (alone, whole)


def _model_cfg(**table: Any) -> ModelConfig:
    from meshformer.config.migrate import model_from_flat

    cfg = model_from_flat(vocab_size=50, d_model=D, n_layers=2, n_heads=HEADS, head_dim=HEAD_DIM, norm="rmsnorm",
                          norm_eps=1e-6, bias=False, position="none", d_ff=48, activation="swiglu",
                          layer_types=["sliding_mqa", "csa"])
    cfg.compressed_attention = CompressedAttentionConfig(q_rank=16, rope_dim=ROPE, window=WINDOW, o_groups=2,
                                                         o_rank=8, csa_rate=RATE, index_heads=INDEX_HEADS,
                                                         index_dim=INDEX_DIM, index_topk=TOPK, **table)
    return cfg


def test_the_objective_weighs_and_logs_it_per_layer() -> None:
    from meshformer.loss.cross_entropy import cross_entropy_sum
    from meshformer.model import Transformer
    from meshformer.parallel.parallel_model import ParallelModel

    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, T + 1))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    plan = ParallelModel(Transformer(_model_cfg(index_loss_weight=0.5), init_seed=1), cross_entropy_sum,
                         torch.device("cpu"))
    assert plan.loss.layer_weights == {INDEX_LOSS: 0.5}
    plan.forward_backward(batch, torch.tensor(float(2 * T)))
    scalars = plan.moe_scalars()
    assert set(scalars) == {"csa/decoder_layers.1/indexer_loss"} and scalars["csa/decoder_layers.1/indexer_loss"] > 0
    indexer = plan.model.decoder_layers["1"].attn.indexer
    assert all(p.grad is not None and p.grad.any() for p in indexer.parameters())
    # the default weight 0: no term, the indexer gets no gradient, nothing logged
    plain = ParallelModel(Transformer(_model_cfg(), init_seed=1), cross_entropy_sum, torch.device("cpu"))
    plain.forward_backward(batch, torch.tensor(float(2 * T)))
    assert plain.moe_scalars() == {}
    assert all(p.grad is None for p in plain.model.decoder_layers["1"].attn.indexer.parameters())


def test_warmup_attends_densely_and_trains_only_the_indexers() -> None:
    from meshformer.model import Transformer

    cfg = _model_cfg(index_loss_weight=1.0)
    cfg.dsa.stage = "warmup"
    model = Transformer(cfg, init_seed=1)
    mixer = model.decoder_layers["1"].attn
    assert mixer.dense
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".indexer." in name for name in trained)


@pytest.mark.parametrize(("table", "stage", "message"), [
    ({"index_loss_weight": -1.0}, "sparse", "index_loss_weight=-1.0 must be at least 0"),
    ({}, "warmup", "trains only the csa indexers, but their loss is off"),
])
def test_config_refusals(table: dict[str, Any], stage: str, message: str) -> None:
    from meshformer.config.validate import validate_model

    cfg = _model_cfg(**table)
    cfg.dsa.stage = stage  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=message):
        validate_model(cfg, "hf:x")
    cfg.dsa.stage = "sparse"
    cfg.compressed_attention.index_loss_weight = 1.0
    validate_model(cfg, "hf:x")


def test_a_pipeline_stage_without_a_csa_block_still_weighs_the_term() -> None:
    """Every stage binds the last stage's objective: it declares the term from the config, not its own blocks."""
    from meshformer.loss.cross_entropy import cross_entropy_sum
    from meshformer.model import Transformer
    from meshformer.model.parallel_context import StageSpan
    from meshformer.parallel.parallel_model import objective_for

    cfg = _model_cfg(index_loss_weight=0.5)
    cfg.layer_types = ["csa", "sliding_mqa"]
    last = Transformer(cfg, init_seed=1, span=StageSpan(1, 2, 1, 2))
    assert not any(name.startswith("decoder_layers.0") for name, _ in last.named_parameters())
    assert objective_for(last, cross_entropy_sum).layer_weights == {INDEX_LOSS: 0.5}
