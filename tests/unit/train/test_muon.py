"""Muon (optim/muon.py): Newton–Schulz, the parameter groups by rule, one step against a hand-written reference, and
the training step's clipping and inf/nan skipping with it."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.optim_reference import matrix_names, step_beside_reference
from torch import nn

from meshformer.config import (
    AttentionConfig,
    ConfigError,
    FfnConfig,
    ModelConfig,
    MoeConfig,
    OptimConfig,
    ScheduleConfig,
    config_from_dict,
)
from meshformer.loss.cross_entropy import cross_entropy_sum
from meshformer.model import Transformer
from meshformer.optim import build_optimizer
from meshformer.optim.muon import Muon, MuonConfig, newton_schulz, update_scale
from meshformer.parallel.parallel_model import ParallelModel
from meshformer.train.step import TrainStep


@pytest.mark.parametrize("shape", [(32, 32), (16, 48), (48, 16), (3, 24, 40)])
def test_newton_schulz_pushes_singular_values_towards_one(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    k = min(shape[-2:])
    spectrum = torch.logspace(0, -1.5, k, dtype=torch.float64)  # condition number ~30: one direction dominates
    s = torch.linalg.svdvals(newton_schulz((u * spectrum) @ vh))
    assert s.min() > 0.6 and s.max() < 1.25  # the quintic's band, whatever the input's spectrum


def test_newton_schulz_keeps_the_singular_vectors():
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    ortho = newton_schulz(g).double()
    # o = U·diag(f(s))·Vᵀ: rotated back into g's singular bases it is diagonal
    inner = u.T @ ortho @ vh.T
    assert (inner - torch.diag(torch.diagonal(inner))).abs().max() < 1e-5


def test_stacked_expert_weights_are_orthogonalised_one_matrix_each():
    experts = torch.randn(4, 16, 24, generator=torch.Generator().manual_seed(2))
    experts[1] *= 1e3  # a joint normalisation would shrink the others to nothing
    stacked = newton_schulz(experts)
    for e in range(4):
        assert torch.allclose(stacked[e], newton_schulz(experts[e]), atol=1e-6)


def test_update_scale():
    assert update_scale(torch.Size([64, 16]), "moonlight") == pytest.approx(0.2 * 8)
    assert update_scale(torch.Size([64, 16]), "shape") == pytest.approx(2.0)  # Linear [out, in]
    assert update_scale(torch.Size([16, 64]), "shape") == 1.0
    assert update_scale(torch.Size([4, 16, 64]), "shape") == pytest.approx(2.0)  # experts [E, in, out]


def _moe_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(family="decoder", vocab_size=64, d_model=16, max_seq_len=16, n_layers=2,
                                   mlp_types=["dense", "moe"], tie_embeddings=False, bias=True,
                                   attention=AttentionConfig(n_heads=2), ffn=FfnConfig(d_ff=32, activation="swiglu"),
                                   moe=MoeConfig(n_experts=4, experts_per_token=2, d_ff=8, n_shared_experts=1)))


def test_parameter_groups_by_rule():
    model = _moe_model()
    opt, _ = build_optimizer([model], OptimConfig(name="muon", lr=1e-3, weight_decay=0.1,
                                                  muon=MuonConfig(lr=0.02, weight_decay=0.05)))
    names = {id(p): n for n, p in model.named_parameters()}
    by_update = {(g["update"], g["weight_decay"]): sorted(names[id(p)] for p in g["params"]) for g in opt.param_groups}
    muon = by_update[("muon", 0.05)]
    assert "decoder_layers.0.attn.q_proj.weight" in muon and "decoder_layers.0.ffn.gate_proj.weight" in muon
    assert "decoder_layers.1.ffn.experts.up_proj" in muon  # [experts, d, f]
    assert "decoder_layers.1.ffn.shared_experts.down_proj.weight" in muon
    assert by_update[("adamw", 0.1)] == ["decoder_layers.1.ffn.router.weight", "output.weight",
                                       "pos_embeddings.weight", "tok_embeddings.weight"]
    assert all(names[id(p)].endswith(("bias", "norm.weight")) for p in opt.param_groups[1]["params"])
    assert len(muon) + len(by_update[("adamw", 0.1)]) + len(opt.param_groups[1]["params"]) == len(names)
    assert {g["update"]: g["lr"] for g in opt.param_groups} == {"adamw": 1e-3, "muon": 0.02}


def test_weights_with_a_single_row_or_column_go_to_adamw():
    from meshformer.optim.muon import is_muon_parameter

    conv = torch.zeros(96, 1, 4)  # a depthwise convolution: 96 one-by-four "matrices" would only be normalised
    gate = torch.zeros(1, 32)  # a shared expert's sigmoid gate
    assert not is_muon_parameter("decoder_layers.0.attn.conv1d.weight", conv)
    assert not is_muon_parameter("decoder_layers.0.ffn.shared_expert_gate.weight", gate)
    assert is_muon_parameter("decoder_layers.0.attn.in_proj_qkvz.weight", torch.zeros(64, 32))


def _reference_muon(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, lr: float, wd: float, mu: float,
                    scale: str) -> None:
    """Muon written out for one parameter, one matrix at a time (expert weights [E, in, out] one expert each)."""
    buf.mul_(mu).add_(g)
    u = g + mu * buf
    matrices = [u] if u.ndim == 2 else list(u)
    out = []
    for m in matrices:
        x = m / (m.norm() + 1e-7)
        tall = x.shape[0] > x.shape[1]
        x = x.T if tall else x
        for _ in range(5):
            a = x @ x.T
            x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
        out.append(x.T if tall else x)
    o = out[0] if u.ndim == 2 else torch.stack(out)
    rows, cols = o.shape[-2:]
    if scale == "moonlight":
        factor = 0.2 * math.sqrt(max(rows, cols))
    else:
        fan_out, fan_in = (cols, rows) if u.ndim == 3 else (rows, cols)
        factor = math.sqrt(max(1.0, fan_out / fan_in))
    p.mul_(1 - lr * wd).add_(o, alpha=-lr * factor)


@pytest.mark.parametrize("scale", ["moonlight", "shape"])
def test_two_steps_equal_a_hand_written_reference(scale):
    model, ref = _moe_model(), _moe_model()
    cfg = OptimConfig(name="muon", lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1,
                      muon=MuonConfig(lr=0.03, weight_decay=0.2, momentum=0.9, scale=scale))
    opt, _ = build_optimizer([model], cfg)
    muon_names = matrix_names(model, opt)
    ref_params = dict(ref.named_parameters())
    bufs = {n: torch.zeros_like(ref_params[n]) for n in muon_names}
    step_beside_reference(model, ref, opt, muon_names, lambda name: _reference_muon(
        ref_params[name], ref_params[name].grad, bufs[name], 0.03, 0.2, 0.9, scale))
    assert muon_names and all(torch.equal(opt.state[p]["momentum_buffer"], bufs[n])
                              for n, p in model.named_parameters() if n in muon_names)


class _GivenGradients(ParallelModel):
    """One block matrix (Muon) and its bias (AdamW) whose backward sets random gradients, `bad` in one element."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        block = nn.ModuleDict({"decoder_layers": nn.ModuleList([nn.Linear(6, 4)])})
        super().__init__(block, cross_entropy_sum, torch.device("cpu"))
        self.block, self.bad = block, None

    def global_token_count(self, micro_batches):
        return torch.tensor(1.0)

    def forward_backward(self, batch, global_tokens, last_micro_batch=True):
        for p in self.block.parameters():
            p.grad = 10 * torch.randn_like(p)
        if self.bad is not None:
            self.block["decoder_layers"][0].weight.grad[0, 0] = self.bad
        return torch.zeros(())


def test_training_step_clips_and_skips_inf_nan_with_muon():
    plan = _GivenGradients()
    training = TrainStep(plan, OptimConfig(name="muon", grad_clip=1.0, max_nonfinite_in_a_row=5),
                         ScheduleConfig(name="constant", warmup_steps=0), 10, d_model=1)
    assert isinstance(training.optimizer, Muon) and not training.clip_in_update
    weight = plan.block["decoder_layers"][0].weight
    seen_norms: list[float] = []  # the gradients the update used (zero_grad comes after the hooks)
    training.add_post_step_hook(lambda applied: seen_norms.append(
        float(torch.cat([p.grad.flatten() for p in plan.block.parameters()]).norm())))
    stats = training.step([{}])
    assert float(stats.grad_norm) > 1.0 and seen_norms[0] == pytest.approx(1.0, rel=1e-4)  # clipped before the step
    weights = [p.detach().clone() for p in plan.block.parameters()]
    state = [t.clone() for s in training.optimizer.state.values() for t in s.values()]
    for bad in (float("nan"), float("inf")):
        plan.bad = bad
        training.step([{}])
        assert all(torch.equal(p, w) for p, w in zip(plan.block.parameters(), weights))
        assert all(torch.equal(a, b) for a, b in zip(
            [t for s in training.optimizer.state.values() for t in s.values()], state))
    assert training.skipped_updates.check(step=3) == 2
    plan.bad = None
    training.step([{}])
    assert not torch.equal(weight, weights[0])


def test_muon_keys_are_checked():
    with pytest.raises(ConfigError, match=r"optim.muon.lr=0.0.*lr > 0"):
        config_from_dict({"optim": {"name": "muon", "muon": {"lr": 0.0}}})
    with pytest.raises(ConfigError, match=r"optim.muon.lr=0.0.*lr > 0"):  # the flat key of an earlier release
        config_from_dict({"optim": {"name": "muon", "muon_lr": 0.0}})
    with pytest.raises(ConfigError, match="optim.name"):
        config_from_dict({"optim": {"name": "sgd"}})
    assert config_from_dict({"optim": {"name": "muon"}}).optim.muon.scale == "moonlight"


def test_newton_schulz_amplifies_noise_in_a_nearly_low_rank_update():
    """Why the parity rows compare Muon's matrices at 1e-4, not the 1e-5 of losses and gradients: a^5 ~ 480 is the
    iteration's gain near a zero singular value, so rounding-level differences in a nearly low-rank update grow."""
    g = torch.Generator().manual_seed(0)
    update = torch.randn(32, 4, generator=g) @ torch.randn(4, 64, generator=g) + 1e-4 * torch.randn(32, 64, generator=g)
    noisy = update * (1 + 1e-7 * torch.randn(32, 64, generator=g))
    a, b = newton_schulz(update), newton_schulz(noisy)
    rel = ((a - b).abs().max() / a.abs().max()).item()
    assert 1e-6 < rel < 1e-4


def test_a_group_keyed_by_kind_works_and_warns_once(monkeypatch):
    """`kind`, the update's key of earlier releases, in a caller's groups: read as `update` with one FutureWarning."""
    import warnings

    from meshformer import renamed

    monkeypatch.setattr(renamed, "_warned_attributes", set())
    w = torch.nn.Parameter(torch.zeros(8, 8))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opts = [Muon([dict(kind="muon", params=[w], lr=0.1)]) for _ in range(2)]
    assert [g["update"] for o in opts for g in o.param_groups] == ["muon", "muon"]
    assert all("kind" not in g for o in opts for g in o.param_groups)
    assert [x.category for x in seen] == [FutureWarning] and "'update'" in str(seen[0].message)
    v = torch.nn.Parameter(torch.zeros(8, 8))  # the same step under today's key (AdamW's would move it 0.1 a step)
    w.grad = v.grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    opts[0].step()
    Muon([dict(update="muon", params=[v], lr=0.1)]).step()
    assert torch.equal(w, v) and w.abs().max() < 0.05
