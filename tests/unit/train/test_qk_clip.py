"""MuonClip's QK-clip (train/qk_clip.py): each head's largest attention logit recorded in the forward (math and
blockwise paths) equals the amax of explicitly computed scores, and the clip bounds the heads above the threshold
while leaving the others alone."""

from __future__ import annotations

import pytest
import torch

from meshformer.config import ModelConfig, OptimConfig, ScheduleConfig
from meshformer.config.migrate import model_from_flat
from meshformer.loss.cross_entropy import cross_entropy_sum
from meshformer.model import Transformer
from meshformer.model.attention import Attention
from meshformer.model.masks import AttentionMask
from meshformer.optim import AdamWConfig, MuonConfig
from meshformer.parallel.parallel_model import ParallelModel
from meshformer.train.qk_clip import QKClip
from meshformer.train.step import TrainStep


def _cfg(backend: str, kv_heads: int | None = None, **extra) -> ModelConfig:
    return model_from_flat(family="decoder", vocab_size=64, d_model=32, n_heads=4, n_kv_heads=kv_heads, d_ff=64,
                           max_seq_len=80, n_layers=1, attention_backend=backend, position="rope", bias=True, **extra)


def _explicit_max(attn: Attention, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """max over batch, queries and allowed keys of q·k·scale per query head, written out."""
    batch, length, _ = x.shape
    q = attn.q_proj(x).view(batch, length, -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(batch, length, -1, attn.head_dim).transpose(1, 2)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-2, -1)) * attn.scale
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("backend", ["math", "blockwise", "auto"])
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_recorded_max_logit_equals_amax_of_scores(backend, kv_heads):
    torch.manual_seed(0)
    attn = Attention(_cfg(backend, kv_heads), causal=True).double()
    attn.record_max_logit = True
    # 136 tokens: beyond `auto`'s CPU rule for blockwise (16 x head_dim 8), over two blocks: recording picks it
    x = torch.randn(2, 136, 32, dtype=torch.float64) * 3
    causal = torch.ones(136, 136, dtype=torch.bool).tril()
    attn(x, AttentionMask(None, is_causal=True))
    torch.testing.assert_close(attn.max_logit, _explicit_max(attn, x, causal), rtol=1e-12, atol=0)
    # a running max over the step's calls: a second, smaller input keeps the first's maxima
    attn(x[:, :8] * 0.1, AttentionMask(None, is_causal=True))
    torch.testing.assert_close(attn.max_logit, _explicit_max(attn, x, causal), rtol=1e-12, atol=0)
    attn.eval()  # evaluation and generation do not record
    attn.max_logit.fill_(float("-inf"))
    attn(x, AttentionMask(None, is_causal=True))
    assert torch.isinf(attn.max_logit).all()


def test_recorded_max_logit_with_a_padding_mask_and_softcap():
    """The math path: keys the mask hides do not count, and the logit is taken before the soft-cap."""
    torch.manual_seed(1)
    attn = Attention(_cfg("auto", attention_softcap=2.0), causal=True).double()
    attn.record_max_logit = True
    x = torch.randn(2, 12, 32, dtype=torch.float64) * 3
    allowed = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    allowed[0, :, :, :5] = False  # sample 0's first keys are padding
    allowed[0, :, :5, 0] = True  # every row keeps a key
    attn(x, AttentionMask(allowed))
    expected = _explicit_max(attn, x, allowed)
    assert expected.max() > 2.0  # above the cap: a capped logit would read below 2
    torch.testing.assert_close(attn.max_logit, expected, rtol=1e-12, atol=0)


def test_recording_picks_a_kernel_that_sees_the_scores():
    from meshformer.model.blockwise_attention import picks_blockwise

    # auto: blockwise on any device and length while recording (else SDPA there); calls it cannot take go to math
    assert picks_blockwise("auto", "cuda", 4096, 64, plain=True, recording=True)
    assert not picks_blockwise("auto", "cuda", 4096, 64, plain=True)
    assert not picks_blockwise("auto", "cuda", 4096, 64, plain=False, recording=True)


def test_blockwise_kernel_returns_each_heads_max_without_changing_its_output():
    from meshformer.model.blockwise_attention import blockwise_attention, blockwise_attention_max

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 150, 8, generator=g, dtype=torch.float64) * 2 for _ in range(3))
    out, max_logit = blockwise_attention_max(q, k, v, scale=0.3, causal=True)
    assert torch.equal(out, blockwise_attention(q, k, v, scale=0.3, causal=True))
    scores = (q @ k.transpose(-2, -1)) * 0.3
    expected = scores.masked_fill(~torch.ones(150, 150, dtype=torch.bool).tril(), float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(max_logit, expected, rtol=1e-12, atol=0)


def _model(backend: str, kv_heads: int | None) -> Transformer:
    """One layer, so that clipping a layer does not change the next one's inputs."""
    torch.manual_seed(3)
    model = Transformer(_cfg(backend, kv_heads)).double()
    with torch.no_grad():  # large query/key weights: logits of tens, some heads above the threshold
        for layer in model.decoder_layers.values():
            layer.attn.q_proj.weight.mul_(torch.tensor([16.0, 4.0, 12.0, 2.0]).repeat_interleave(8)[:, None])
            layer.attn.k_proj.weight.mul_(6.0)
            layer.attn.q_proj.bias.normal_(0, 0.5)  # biases scale with their rows: nonzero to show it
            layer.attn.k_proj.bias.normal_(0, 0.5)
    return model


def _head_maxima(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    for layer in model.decoder_layers.values():
        layer.attn.max_logit.fill_(float("-inf"))
    model(ids)
    return torch.stack([layer.attn.max_logit.clone() for layer in model.decoder_layers.values()])


@pytest.mark.parametrize("backend", ["math", "blockwise"])
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_clip_brings_heads_above_the_threshold_to_it_and_leaves_the_others(backend, kv_heads):
    model = _model(backend, kv_heads)
    clip = QKClip([model], threshold=1.0)  # set after the maxima are known below
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(4))
    before = _head_maxima(model, ids)
    tau = float(before.median())
    clip.threshold = tau
    above = before > tau
    assert above.any() and (~above).any()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(ids)  # the step's forward records; the hook clips
    clip(torch.tensor(1.0))
    assert float(clip.last_clipped) == above.sum() and float(clip.last_max_logit) == before.max()
    after = _head_maxima(model, ids)
    torch.testing.assert_close(after[above], torch.full_like(after[above], tau), rtol=1e-10, atol=0)
    assert torch.equal(after[~above], before[~above])  # unclipped heads: bit for bit
    for i, layer in enumerate(model.decoder_layers.values()):
        rows = (~above[i]).repeat_interleave(8)
        for name in ("q_proj", "k_proj"):
            for kind in ("weight", "bias"):
                key = f"decoder_layers.{i}.attn.{name}.{kind}"
                new, old = getattr(getattr(layer.attn, name), kind), weights[key]
                if name == "q_proj":
                    assert torch.equal(new[rows], old[rows]) and not torch.equal(new[~rows], old[~rows])
                elif kv_heads is not None:  # grouped-query: the shared key heads stay as they are
                    assert torch.equal(new, old)
                else:  # each head its own key: sqrt(tau / S) on its rows
                    gamma = (tau / before[i]).clamp(max=1).sqrt().repeat_interleave(8)
                    expected = old * (gamma[:, None] if kind == "weight" else gamma)
                    torch.testing.assert_close(new, expected, rtol=1e-14, atol=0)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters() if ".q_proj." not in n
               and ".k_proj." not in n)  # values, output projection, everything else: untouched


def test_a_skipped_step_clips_nothing():
    model = _model("math", None)
    clip = QKClip([model], threshold=1e-3)
    weights = [p.detach().clone() for p in model.parameters()]
    model(torch.randint(0, 64, (2, 24)))
    clip(torch.tensor(0.0))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert float(clip.last_clipped) == 0 and clip.scalars()["optim/max_attention_logit"] > 1e-3


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_training_step_clips_after_the_update(optimizer):
    """Through TrainStep: the hook runs after the optimizer step, on the logits of the step's forward; with a tiny
    lr the clipped heads' next logits are at the threshold."""
    model = _model("auto", None)
    plan = ParallelModel(model, cross_entropy_sum, torch.device("cpu"))
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(5))
    optim = OptimConfig(name=optimizer, lr=1e-9, muon=MuonConfig(lr=1e-9, weight_decay=0.0), weight_decay=0.0,
                        adamw=AdamWConfig(implementation="foreach"), qk_clip_threshold=100.0)
    training = TrainStep(plan, optim, ScheduleConfig(name="constant", warmup_steps=0), 2, d_model=1)
    assert training.qk_clip is not None  # it set the attention layers recording
    before = _head_maxima(model, ids)
    tau = float(before.median())
    training.qk_clip.threshold = tau
    training.step([{"input_ids": ids, "labels": ids}])
    scalars = training.qk_clip.scalars()
    assert scalars == {"optim/max_attention_logit": pytest.approx(float(before.max())),
                       "optim/qk_clip_heads": float((before > tau).sum())}
    after = _head_maxima(model, ids)
    above = before > tau
    torch.testing.assert_close(after[above], torch.full_like(after[above], tau), rtol=1e-6, atol=0)
    torch.testing.assert_close(after[~above], before[~above], rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- multi-head latent attention

NOPE, ROPE, V = 8, 4, 6


def _mla_model() -> Transformer:
    """One mla block (queries through one projection), heads whose logits range from a few to tens."""
    from meshformer.config import MlaConfig

    torch.manual_seed(6)
    cfg = model_from_flat(family="decoder", vocab_size=64, d_model=32, n_heads=4, d_ff=64, max_seq_len=80,
                          n_layers=1, position="rope", bias=False, layer_types=["mla"], mla=MlaConfig(
                              kv_lora_rank=12, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V))
    model = Transformer(cfg).double()
    attn = model.decoder_layers["0"].attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(torch.tensor([16.0, 4.0, 12.0, 2.0]).repeat_interleave(NOPE + ROPE)[:, None])
        attn.kv_b_proj.weight.mul_(6.0)
        attn.kv_a_proj.weight.mul_(6.0)
    return model


def test_mla_records_the_max_of_the_scores_it_attends_with():
    """The recorded per-head maximum equals the amax of q·k·scale over the keys each query sees, from the queries
    and keys the attention is given (recording runs the math path whatever the backend)."""
    model = _mla_model()
    attn = model.decoder_layers["0"].attn
    seen: list[torch.Tensor] = []
    math = attn._math

    def spy(q, k, v, mask, dropout_p):
        allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        seen.append(((q @ k.transpose(-2, -1)) * attn.scale).masked_fill(~allowed, float("-inf")).amax((0, 2, 3)))
        return math(q, k, v, mask, dropout_p)

    attn._math = spy
    attn.record_max_logit = True
    model(torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(7)))
    assert len(seen) == 1
    torch.testing.assert_close(attn.max_logit, seen[0], rtol=1e-12, atol=0)
    model.eval()  # generation and evaluation do not record
    attn.max_logit.fill_(float("-inf"))
    model(torch.randint(0, 64, (2, 24)))
    assert torch.isinf(attn.max_logit).all()


def test_mla_clip_brings_heads_above_the_threshold_to_it_with_kimi_k2s_rule():
    """Clipped heads: position-free query and key rows by sqrt(gamma), rotary query rows by gamma, values and the
    shared rotary key untouched; the head's largest logit then equals the threshold. Other heads bit for bit."""
    model = _mla_model()
    attn = model.decoder_layers["0"].attn
    clip = QKClip([model], threshold=1.0)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(8))
    before = _head_maxima(model, ids)[0]
    tau = float(before.median())
    clip.threshold = tau
    above = before > tau
    assert above.any() and (~above).any()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(ids)
    clip(torch.tensor(1.0))
    after = _head_maxima(model, ids)[0]
    torch.testing.assert_close(after[above], torch.full_like(after[above], tau), rtol=1e-10, atol=0)
    assert torch.equal(after[~above], before[~above])
    gamma = (tau / before).clamp(max=1)
    q_old = weights["decoder_layers.0.attn.q_proj.weight"].view(4, NOPE + ROPE, -1)
    q_new = attn.q_proj.weight.view(4, NOPE + ROPE, -1)
    torch.testing.assert_close(q_new[:, :NOPE], q_old[:, :NOPE] * gamma.sqrt()[:, None, None], rtol=1e-14, atol=0)
    torch.testing.assert_close(q_new[:, NOPE:], q_old[:, NOPE:] * gamma[:, None, None], rtol=1e-14, atol=0)
    kv_old = weights["decoder_layers.0.attn.kv_b_proj.weight"].view(4, NOPE + V, -1)
    kv_new = attn.kv_b_proj.weight.view(4, NOPE + V, -1)
    torch.testing.assert_close(kv_new[:, :NOPE], kv_old[:, :NOPE] * gamma.sqrt()[:, None, None], rtol=1e-14, atol=0)
    assert torch.equal(kv_new[:, NOPE:], kv_old[:, NOPE:])  # values
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters()
               if ".q_proj." not in n and ".kv_b_proj." not in n)  # kv_a_proj (the shared rotary key) and the rest
