"""Kimi Delta Attention (meshformer/model/kda.py) against transformers' KimiLinearDeltaAttention with copied weights,
in fp32: a padded batch, a cached prefill then decoding steps; packed documents equal the documents run one by one;
context parallel's pieces equal the whole sequence (values and gradients); initialisation; config refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.recurrent_mixer import (
    assert_cached_steps_match_transformers,
    assert_context_parallel_pieces_equal_the_whole,
    assert_gradients_reach_every_parameter,
    assert_matches_transformers_on_a_padded_batch,
    assert_packed_documents_equal_one_by_one,
)

from meshformer.config.migrate import model_from_flat
from meshformer.errors import ConfigError
from meshformer.model.config import LinearAttentionConfig, ModelConfig
from meshformer.model.kda import KimiDeltaAttention

transformers = pytest.importorskip("transformers")
from transformers.models.kimi_linear import modeling_kimi_linear as hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

D, HEADS, DIM = 32, 4, 8


def hf_config(**extra: Any) -> Any:
    fields: dict[str, Any] = dict(
        vocab_size=40, hidden_size=D, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, linear_num_heads=HEADS, linear_head_dim=DIM, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 2, rms_norm_eps=1e-6)
    return transformers.KimiLinearConfig(**{**fields, **extra})


def ours(chunk_size: int = 4, **extra: Any) -> ModelConfig:
    return model_from_flat(d_model=D, norm="rmsnorm", norm_eps=1e-6, bias=False, layer_types=["kda"],
                           linear_attention=LinearAttentionConfig(n_heads=HEADS, key_head_dim=DIM,
                                                                  value_head_dim=DIM, conv_width=4,
                                                                  chunk_size=chunk_size), **extra)


def state_dict_from(theirs: Any) -> dict[str, torch.Tensor]:
    """Their module's names to ours: the forget gate's pieces at the top, A_log (1, 1, H, 1) -> (H,), o_* ->
    norm / out_proj, the [q | k | v] convolution as the checkpoints' three."""
    renames = {"forget_gate.": "", "o_norm.": "norm.", "o_proj.": "out_proj."}
    out = {}
    for name, tensor in theirs.state_dict().items():
        for old, new in renames.items():
            if name.startswith(old):
                name = new + name[len(old):]
        if name == "conv1d.weight":
            out.update(zip(["q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"], tensor.chunk(3)))
            continue
        out[name] = tensor.flatten() if name == "A_log" else tensor
    return out


def pair(chunk_size: int = 4, seed: int = 0) -> tuple[KimiDeltaAttention, Any]:
    torch.manual_seed(seed)
    theirs = hf.KimiLinearDeltaAttention(hf_config(), layer_idx=0).eval()
    with torch.no_grad():
        for p in theirs.parameters():  # every weight random (transformers leaves A_log and dt_bias empty)
            p.copy_(torch.randn_like(p) * 0.3)
        theirs.forget_gate.A_log.copy_(torch.rand(1, 1, HEADS, 1) * 2 - 1)
    mine = KimiDeltaAttention(ours(chunk_size))
    loaded = mine.load_state_dict(state_dict_from(theirs), strict=True)
    assert not loaded.missing_keys and not loaded.unexpected_keys
    return mine.eval(), theirs


@pytest.mark.parametrize("chunk_size", [3, 64])
def test_matches_transformers_on_a_padded_batch(chunk_size: int) -> None:
    mine, theirs = pair(chunk_size)
    assert_matches_transformers_on_a_padded_batch(mine, theirs, D)


def test_cached_prefill_and_steps_match_transformers_cache() -> None:
    mine, theirs = pair()
    cache_hf = transformers.DynamicCache(config=hf_config())
    cache = assert_cached_steps_match_transformers(mine, theirs, cache_hf, D)
    assert cache.state.shape == (2, HEADS, DIM, DIM) and cache.conv.shape == (2, 3, 3 * HEADS * DIM)


def test_packed_documents_equal_the_documents_one_by_one() -> None:
    assert_packed_documents_equal_one_by_one(pair(chunk_size=4)[0], D)


def test_context_parallel_pieces_equal_the_whole_sequence() -> None:
    """One rank holding both pieces: the first piece's per-channel state and window enter the second, except where
    the second starts a document."""
    mine, _ = pair(chunk_size=4)
    for lengths in ([7, 1, 5, 3], [16]):
        assert_context_parallel_pieces_equal_the_whole(mine, lengths, D)


def test_gradients_reach_every_parameter() -> None:
    assert_gradients_reach_every_parameter(pair()[0], D)


def test_initialisation_and_counts() -> None:
    """A_log = log(uniform(1, 16)), softplus(dt_bias) in [1e-3, 0.1] (flash-linear-attention's rule, as transformers
    initialises it), the gated norm's scale 1; the kind's parameter count is the module's."""
    from meshformer.model import Transformer
    from meshformer.model.components import TOKEN_MIXERS

    cfg = ours(vocab_size=50, n_layers=2, n_heads=4, position="none", d_ff=48, activation="swiglu",
               norm_weight_offset=1.0)
    cfg.layer_types = ["kda", "full_attention"]
    model = Transformer(cfg, init_seed=3)
    mixer = model.decoder_layers["0"].attn
    assert isinstance(mixer, KimiDeltaAttention) and model.decoder_layers["0"].mixers["attn"] == "kda"
    decay = mixer.A_log.exp()
    assert decay.min() >= 1 and decay.max() <= 16 and decay.std() > 0
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert dt.min() >= 1e-3 - 1e-7 and dt.max() <= 0.1 + 1e-7 and torch.equal(mixer.norm.weight, torch.ones(DIM))
    assert sum(p.numel() for p in mixer.parameters()) == TOKEN_MIXERS["kda"].params(cfg)


@pytest.mark.parametrize(("extra", "message"), [
    ({"n_key_heads": 2}, "n_key_heads=2 differs from n_heads=4"),
    ({"backend": "fla"}, r'backend = "fla" needs flash-linear-attention: pip install "meshformer\[fla\]"'),
])
def test_config_refusals(extra: dict[str, Any], message: str) -> None:
    from meshformer.config.validate import validate_model

    cfg = ours()
    for key, value in extra.items():
        setattr(cfg.linear_attention, key, value)
    with pytest.raises(ConfigError, match=message):
        validate_model(cfg, "test")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planner_bytes_follow_what_autograd_keeps(dtype: torch.dtype) -> None:
    """The kind's saved_bytes against the tensors the module's graph keeps (saved-tensor hooks, parameters
    excluded), in float32 and under bf16 autocast, at three shapes: within 12%."""
    from meshformer.model.components import TOKEN_MIXERS
    from meshformer.planner.activations import ActivationShape
    from meshformer.planner.measure import saved_activation_bytes

    half = dtype != torch.float32
    for heads, dim, chunk, batch, seq in [(4, 16, 8, 1, 50), (4, 32, 64, 2, 256), (2, 64, 32, 1, 300)]:
        cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, layer_types=["kda"],
                          linear_attention=LinearAttentionConfig(n_heads=heads, key_head_dim=dim, value_head_dim=dim,
                                                                 chunk_size=chunk))
        module = KimiDeltaAttention(cfg)
        x = torch.randn(batch, seq, cfg.d_model).to(dtype).requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=half):
            kept = saved_activation_bytes(module, lambda m=module, x=x: m(x))
        layout = ActivationShape(batch, seq, 1, 2 if half else 4, 4)
        predicted = TOKEN_MIXERS["kda"].saved_bytes(cfg, layout, memory_len=0, causal=True)
        assert abs(predicted / kept - 1) < 0.12, (heads, dim, chunk, predicted, kept)
