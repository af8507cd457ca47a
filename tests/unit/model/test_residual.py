"""The residual as a block component (model/residual.py): the plain join holds nothing and leaves the block as it
was; mHC's branch join and stack merge equal transformers' DeepSeek-V4 modules in fp32, its mixing matrices are
doubly stochastic, and a model built with it trains and counts its parameters as the kind declares."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

from meshformer.config import ConfigError, config_from_dict
from meshformer.model import Transformer
from meshformer.model.config import AttentionConfig, ModelConfig, NormConfig, ResidualConfig
from meshformer.model.flops import count_params
from meshformer.model.residual import RESIDUALS, HyperConnection, HyperMerge, PlainResidual, sinkhorn

pytestmark = pytest.mark.usefixtures("one_thread")

D, N = 16, 4


def mhc_config(**fields) -> ModelConfig:
    return ModelConfig(family="decoder", vocab_size=64, d_model=D, n_layers=2, max_seq_len=16, position="rope",
                       bias=False, attention=AttentionConfig(n_heads=4), norm=NormConfig(kind="rmsnorm", eps=1e-6),
                       residual=ResidualConfig(kind="mhc", streams=N, sinkhorn_iters=20), **fields)


def hf_config() -> DeepseekV4Config:
    return DeepseekV4Config(hidden_size=D, hc_mult=N, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                            num_hidden_layers=1, vocab_size=64)


def test_plain_residual_holds_no_parameters_and_adds_the_branch():
    """The plain join is parameter-free (checkpoints keep their names) and computes x + f(norm(x)) (pre-norm)."""
    cfg = ModelConfig(d_model=D, attention=AttentionConfig(n_heads=4))
    join = RESIDUALS["plain"].branch(cfg)
    assert isinstance(join, PlainResidual) and not list(join.parameters())
    norm, branch = nn.LayerNorm(D), nn.Linear(D, D)
    x = torch.randn(2, 3, D)
    torch.testing.assert_close(join(x, norm, None, branch), x + branch(norm(x)), rtol=0, atol=0)
    model = Transformer(cfg)
    assert not any("residual" in name or "merge" in name for name in model.state_dict())


@torch.no_grad()
def test_mhc_branch_join_equals_transformers_hyper_connection():
    """pre mix -> norm -> branch -> post x output + comb^T x streams, as DeepseekV4DecoderLayer joins its attention,
    with random (non-trivial) mixing weights: fp32 within 1e-5."""
    torch.manual_seed(0)
    theirs = DeepseekV4HyperConnection(hf_config())
    for p in (theirs.fn, theirs.base, theirs.scale):
        nn.init.normal_(p, std=0.5)
    ours = HyperConnection(mhc_config())
    ours.weight.copy_(theirs.fn), ours.bias.copy_(theirs.base), ours.gain.copy_(theirs.scale)
    norm, branch = nn.RMSNorm(D, eps=1e-6), nn.Linear(D, D)
    nn.init.normal_(norm.weight)
    x = torch.randn(2, 5, N, D)

    post, comb, collapsed = theirs(x)
    expected = post.unsqueeze(-1) * branch(norm(collapsed)).unsqueeze(-2) + comb.transpose(-1, -2) @ x
    torch.testing.assert_close(ours(x, norm, None, branch), expected, rtol=0, atol=1e-5)


@torch.no_grad()
def test_mhc_merge_equals_transformers_hyper_head():
    torch.manual_seed(1)
    theirs = DeepseekV4HyperHead(hf_config())
    for p in (theirs.hc_fn, theirs.hc_base, theirs.hc_scale):
        nn.init.normal_(p, std=0.5)
    ours = HyperMerge(mhc_config())
    ours.weight.copy_(theirs.hc_fn), ours.bias.copy_(theirs.hc_base), ours.gain.copy_(theirs.hc_scale)
    x = torch.randn(2, 5, N, D)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-5)


def test_sinkhorn_mix_is_doubly_stochastic():
    m = sinkhorn(torch.randn(3, N, N) * 2, iterations=20, eps=1e-6)
    ones = torch.ones(3, N)
    torch.testing.assert_close(m.sum(-1), ones, rtol=0, atol=1e-2)  # the last step normalises the columns
    torch.testing.assert_close(m.sum(-2), ones, rtol=0, atol=1e-5)


def test_mhc_model_trains_and_counts_its_parameters():
    """Every block's two joins and the stack's merge hold the declared parameters; all of them get gradients."""
    cfg = mhc_config()
    plain = sum(p.numel() for p in Transformer(ModelConfig(**{**cfg.__dict__, "residual": ResidualConfig()}))
                .parameters())
    model = Transformer(cfg)
    extra = sum(p.numel() for p in model.parameters()) - plain
    assert extra == RESIDUALS["mhc"].params(cfg, branches=2 * cfg.n_layers, stacks=1) > 0
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())
    assert count_params(cfg)["residual"] == extra
    assert model.decoder_layers["0"].ffn_residual.gain.tolist() == [1.0, 1.0, 1.0]  # type: ignore[index]
    ids = torch.randint(0, 64, (2, 6))
    logits = model(ids)
    assert logits.shape == (2, 6, 64)  # type: ignore[union-attr]
    logits.sum().backward()  # type: ignore[union-attr]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for name, p in model.named_parameters()
               if "residual" in name or "merge" in name)


def test_cached_decoding_with_mhc_equals_the_full_forward():
    cfg = mhc_config()
    model = Transformer(cfg).eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        full = model.head(model.decode(ids))
        cache = model.new_cache()
        steps = [model.head(model.decode(ids[:, :4], cache=cache))]
        steps += [model.head(model.decode(ids[:, t:t + 1], cache=cache)) for t in range(4, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model,key", [({"residual": {"streams": 0}}, "residual.streams"),
                                       ({"residual": {"sinkhorn_iters": 0}}, "residual.sinkhorn_iters"),
                                       ({"norm": {"position": "post"}}, "norm.position")])
def test_bad_mhc_tables_are_refused(model, key):
    residual = {"kind": "mhc", **model.pop("residual", {})}
    with pytest.raises(ConfigError, match=f"model.{key}"):
        config_from_dict({"model": {"residual": residual, **model}})


def test_the_bench_writes_its_table(tmp_path):
    """bench/mhc_cost.py's rows carry the times and counts given, and the docs' table loader accepts them."""
    from helpers.common import load_script

    bench, render = load_script("bench/mhc_cost.py"), load_script("bench/render_tables.py")
    result = {"step_time": {"plain": 0.5, "mhc": 0.75},
              "counts": {"plain": {"params": 1000, "flops": 2e9}, "mhc": {"params": 1100, "flops": 2.2e9}}}
    columns, rows = bench.table(result)
    load_script("bench/tables.py").write_table(tmp_path / "architectures-06-mhc.json", machine="a test machine",
                                               page="architectures", title="t", command="python bench/mhc_cost.py",
                                               columns=columns, rows=rows)
    cells = [cell for t in render.load_tables(tmp_path) for row in t["rows"] for cell in row]
    assert {"500 ms", "750 ms", "× 1.50", "1,100"} <= set(cells)
    assert bench.ratio(result, "flops") == pytest.approx(1.1)


def test_mhc_pipeline_stages_hand_on_the_streams():
    """A first pipeline stage hands the next its (B, T, streams, D) streams, the merge is the last stage's: the two
    stages chained compute the whole model's logits (tensor and pipeline parallel layouts: the parity rows
    deepseek_mhc/tp-ep and deepseek_mhc/pp)."""
    from meshformer.model.parallel_context import StageSpan

    cfg = mhc_config()
    torch.manual_seed(0)
    whole = Transformer(cfg).eval()
    first, last = (Transformer(cfg, span=StageSpan(i, 2, i, i + 1)).eval() for i in (0, 1))
    for stage in (first, last):
        stage.load_state_dict({k: v for k, v in whole.state_dict().items() if k in stage.state_dict()})
    assert first.decoder_merge is None and last.decoder_merge is not None
    ids = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        handed = first(ids)
        assert handed.decoder.shape == (2, 6, N, D)  # type: ignore[union-attr]
        torch.testing.assert_close(last(ids, streams=handed), whole(ids), rtol=0, atol=0)
