"""NorMuon (optim/normuon.py): two steps against a hand-written reference (dense and stacked expert matrices), its
state, its config table and its planner bytes."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.optim_reference import matrix_names, step_beside_reference

from meshformer.config import (
    AttentionConfig,
    ConfigError,
    FfnConfig,
    ModelConfig,
    MoeConfig,
    OptimConfig,
    config_from_dict,
)
from meshformer.model import Transformer
from meshformer.optim import NorMuonConfig, build_optimizer, get_optimizer_spec
from meshformer.optim.normuon import NorMuon


def _moe_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(family="decoder", vocab_size=64, d_model=16, max_seq_len=16, n_layers=2,
                                   mlp_types=["dense", "moe"], tie_embeddings=False, bias=True,
                                   attention=AttentionConfig(n_heads=2), ffn=FfnConfig(d_ff=32, activation="swiglu"),
                                   moe=MoeConfig(n_experts=4, experts_per_token=2, d_ff=8, n_shared_experts=1)))


def _orthogonalise(m: torch.Tensor) -> torch.Tensor:
    x = m / (m.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if tall else x


def _reference_normuon(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, v: list[torch.Tensor], lr: float,
                       wd: float, mu: float, beta2: float, eps: float) -> None:
    """NorMuon written out for one parameter, one matrix and one neuron at a time: a Linear [out, in]'s neurons are
    its rows, a stacked expert [in, out]'s its columns."""
    buf.mul_(mu).add_(g)
    u = g + mu * buf
    matrices = [u] if u.ndim == 2 else list(u)
    out = []
    for i, m in enumerate(matrices):
        o = _orthogonalise(m)
        neurons = o if u.ndim == 2 else o.T
        for j, row in enumerate(neurons):
            v[i][j] = beta2 * v[i][j] + (1 - beta2) * (row * row).mean()
        scale = torch.stack([1 / (v[i][j].sqrt() + eps) for j in range(len(neurons))])
        normed = o * (scale[:, None] if u.ndim == 2 else scale[None, :])
        out.append(normed * 0.2 * math.sqrt(normed.numel()) / normed.norm())
    update = out[0] if u.ndim == 2 else torch.stack(out)
    p.mul_(1 - lr * wd).add_(update, alpha=-lr)


def test_two_steps_equal_a_hand_written_reference():
    model, ref = _moe_model(), _moe_model()
    cfg = OptimConfig(name="normuon", lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1,
                      normuon=NorMuonConfig(lr=0.03, weight_decay=0.2, momentum=0.9, beta2=0.9))
    opt, _ = build_optimizer([model], cfg)
    assert isinstance(opt, NorMuon)
    names = matrix_names(model, opt)
    assert "decoder_layers.1.ffn.experts.up_proj" in names and "decoder_layers.0.attn.q_proj.weight" in names
    ref_params = dict(ref.named_parameters())
    bufs = {n: torch.zeros_like(ref_params[n]) for n in names}
    seconds = {n: [[torch.tensor(0.0)] * (p.shape[0] if p.ndim == 2 else p.shape[-1])
                   for _ in range(1 if p.ndim == 2 else p.shape[0])] for n, p in ref_params.items() if n in names}
    step_beside_reference(model, ref, opt, names, lambda name: _reference_normuon(
        ref_params[name], ref_params[name].grad, bufs[name], seconds[name], 0.03, 0.2, 0.9, 0.9, 1e-8))
    params = dict(model.named_parameters())
    # the per-neuron state: one value per output neuron, the input dim kept as 1
    assert opt.state[params["decoder_layers.0.attn.q_proj.weight"]]["second_momentum"].shape == (16, 1)
    assert opt.state[params["decoder_layers.1.ffn.experts.up_proj"]]["second_momentum"].shape == (4, 1, 8)
    for name in names:
        v = opt.state[params[name]]["second_momentum"]
        want = torch.stack([torch.stack(row) for row in seconds[name]])
        assert torch.allclose(v.reshape(want.shape), want, rtol=1e-5, atol=0), name


def test_update_has_adamw_rms_whatever_the_gradient_scale():
    """The rescale to RMS 0.2 makes a matrix's step independent of its gradient's size (so optim.lr carries over)."""
    steps = []
    for size in (1e-3, 1e3):
        w = torch.nn.Parameter(torch.zeros(24, 40))
        opt = NorMuon([dict(update="muon", params=[w], lr=1.0, weight_decay=0.0, momentum=0.0, beta2=0.95,
                            eps=1e-8, ns_steps=5)])
        w.grad = size * torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
        opt.step()
        steps.append(w.detach().clone())
    assert steps[0].square().mean().sqrt().item() == pytest.approx(0.2, rel=1e-5)
    assert torch.allclose(steps[0], steps[1], rtol=0, atol=1e-5)  # fp32 Newton–Schulz of either scale


def test_normuon_keys_are_checked_and_planned():
    with pytest.raises(ConfigError, match=r"optim.normuon.beta2=1.0 must lie in \[0, 1\)"):
        config_from_dict({"optim": {"name": "normuon", "normuon": {"beta2": 1.0}}})
    with pytest.raises(ConfigError, match=r"optim.normuon.lr=-1.0"):
        config_from_dict({"optim": {"name": "normuon", "normuon": {"lr": -1.0}}})
    assert config_from_dict({"optim": {"name": "normuon", "normuon": {"lr": 0.02}}}).optim.normuon.lr == 0.02
    numel, matrices, largest = 1000, 768, 256
    adamw, muon, normuon = (get_optimizer_spec(n).state_bytes(numel, matrices, largest)
                            for n in ("adamw", "muon", "normuon"))
    assert adamw == (8 * numel, 0) and muon == (4 * (2 * numel - matrices), 20 * largest)
    # Muon's plus one fp32 per neuron (counted as 1/128 of the matrices) and one more whole-matrix buffer
    assert normuon == (muon[0] + 4 * matrices / 128, muon[1] + 4 * largest)
