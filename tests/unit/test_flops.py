"""Analytic parameter counts equal built models; FLOPs and counts reproduce published figures."""

from __future__ import annotations

import pytest
import torch
from helpers.common import CONFIGS

from meshformer.config import ModelConfig, load_config
from meshformer.model import Transformer
from meshformer.model.flops import count_params, flops_per_token, training_flops

pytestmark = pytest.mark.usefixtures("one_thread")



def built_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):  # shapes only: no memory, even for 175B
        return sum(p.numel() for p in Transformer(cfg).parameters())  # tied tensors counted once


SMALL = {
    "gpt-tied-bias": dict(family="decoder", activation="gelu_tanh"),
    "llama-gqa-untied-nobias": dict(family="decoder", activation="swiglu", norm="rmsnorm", position="rope",
                                    n_kv_heads=2, tie_embeddings=False, bias=False),
    "mqa-alibi-layernorm-nobias": dict(family="decoder", n_kv_heads=1, position="alibi", bias=False),
    "bert": dict(family="encoder", norm_position="post", embedding_norm=True, head_transform=True, output_bias=True),
    "bert-untied-rmsnorm": dict(family="encoder", head_transform=True, tie_embeddings=False, norm="rmsnorm"),
    "seq2seq-shared": dict(family="encoder_decoder", n_encoder_layers=3, n_decoder_layers=1, position="sinusoidal"),
    "seq2seq-separate-untied": dict(family="encoder_decoder", share_embeddings=False, tie_embeddings=False,
                                    activation="swiglu", final_norm=False, norm_position="post"),
    "seq2seq-pooled-gqa": dict(family="encoder_decoder", cross_downsample=4, n_kv_heads=2, output_bias=True),
    "t5-relative": dict(family="encoder_decoder", position="t5_relative", relative_buckets=16, norm="rmsnorm",
                        bias=False),
    "encoder-t5-relative": dict(family="encoder", position="t5_relative"),
}


@pytest.mark.parametrize("name", list(SMALL))
def test_count_params_equals_built_model(name):
    cfg = ModelConfig(vocab_size=101, d_model=48, n_heads=6, n_layers=3, d_ff=80, max_seq_len=33, **SMALL[name])
    counts = count_params(cfg)
    assert counts["total"] == built_params(cfg)
    assert counts["embedding"] + counts["non_embedding"] == counts["total"]
    parts = ("embedding", "attention", "feed_forward", "norms", "head")
    assert sum(counts[k] for k in parts) == counts["total"]


PUBLISHED = {  # config: (published parameter count, relative tolerance)
    "transformer-base": (65e6, 0.03),  # Vaswani et al. Table 3
    "transformer-big": (213e6, 0.03),
    "gpt2-small": (124_439_808, 0.0),  # HF GPT2LMHeadModel("gpt2")
    "gpt3-175b": (175e9, 0.01),  # Brown et al. Table 2.1
    "llama-7b": (6_738_415_616, 0.0),  # HF LlamaForCausalLM("huggyllama/llama-7b"); 6.7B in Touvron et al.
    "llama-1b": (1_235_814_400, 0.0),  # Llama 3.2 1B
    "llama-8b": (8_030_261_248, 0.0),  # Llama 3.1 8B (HF LlamaForCausalLM), "8B"
    "llama-70b": (70_553_706_496, 0.0),  # Llama 3.1 70B, "70.6B"
    "llama-405b": (405_853_388_800, 0.0),  # Llama 3.1 405B, "405.9B"
    "bert-base": (109_514_298 - 1_536, 0.0),  # BertForMaskedLM minus the token-type table we fold away
    "t5-small": (60_506_624, 0.0),  # HF T5ForConditionalGeneration("t5-small")
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_shipped_configs_reproduce_published_counts(name):
    cfg = load_config(CONFIGS / f"{name}.toml")  # validates the whole file
    published, tolerance = PUBLISHED[name]
    total = count_params(cfg.model)["total"]
    assert abs(total - published) <= tolerance * published, f"{name}: {total:,} vs {published:,.0f}"
    assert total == built_params(cfg.model)


@pytest.mark.parametrize(("name", "cls", "config", "kwargs"), [
    ("gpt2-small", "GPT2LMHeadModel", "GPT2Config", {}),
    ("llama-7b", "LlamaForCausalLM", "LlamaConfig", {}),
    ("llama-1b", "LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=8, rope_parameters={
        "rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=True, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, vocab_size=128256)),
    ("bert-base", "BertForMaskedLM", "BertConfig", {}),
])
def test_counts_equal_hugging_face_models(name, cls, config, kwargs):
    """Their model of the same shape, built on the meta device from transformers' own defaults (no download)."""
    transformers = pytest.importorskip("transformers")
    cfg = load_config(CONFIGS / f"{name}.toml").model
    with torch.device("meta"):
        hf = getattr(transformers, cls)(getattr(transformers, config)(**kwargs))
    theirs = sum(p.numel() for p in hf.parameters())
    folded = 1_536 if name == "bert-base" else 0  # token-type embeddings (2 x 768)
    assert count_params(cfg)["total"] == theirs - folded


def test_gpt3_flops_match_megatron_and_the_gpt3_paper():
    cfg = load_config(CONFIGS / "gpt3-175b.toml").model
    s, h, layers, vocab = 2048, 12288, 96, 50304  # padded GPT-2 vocabulary
    # Narayanan et al. 2021 (no recomputation): 72 B s l h^2 (1 + s/6h + V/12lh) per batch of B sequences.
    megatron = 72 * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * layers * h))
    assert training_flops(cfg, s) == pytest.approx(megatron, rel=1e-12)
    # GPT-3 paper, Table D.1: 3.14e23 FLOPs for 300B tokens with C = 6 N D (attention ignored).
    assert 6 * count_params(cfg)["total"] == pytest.approx(3.14e23 / 300e9, rel=0.01)
    attention_share = 12 * layers * s * h / flops_per_token(cfg, s)
    assert 0.02 < attention_share < 0.04  # the ~3% the 6N rule leaves out at 2k context


def test_llama_flops_per_token_is_6n_plus_attention():
    cfg = load_config(CONFIGS / "llama-7b.toml").model
    counts = count_params(cfg)
    matmul = counts["non_embedding"] - 65 * 4096  # untied head counted; the 65 RMSNorm weights are not matmuls
    assert flops_per_token(cfg, 2048) == 6 * matmul + 12 * 32 * 2048 * 4096


def test_encoder_decoder_flops_account_for_each_stack():
    cfg = ModelConfig(family="encoder_decoder", vocab_size=100, d_model=64, n_heads=4, n_encoder_layers=2,
                      n_decoder_layers=3, d_ff=128, bias=False, tie_embeddings=True)
    d, ff, v, src, tgt = 64, 128, 100, 40, 10
    # Forward: 2 FLOPs per weight per token it reads, plus 4 * queries * keys * d for QK^T and AV.
    encoder_layer = 2 * (4 * d * d + 2 * d * ff) * src + 4 * src * src * d
    decoder_layer = (2 * (4 * d * d + 2 * d * d + 2 * d * ff) * tgt  # self q/k/v/o, cross q/o, FFN
                     + 2 * (2 * d * d) * src  # cross k/v over the encoder output
                     + 4 * tgt * tgt * d + 4 * tgt * src * d)
    expected = 3 * (2 * encoder_layer + 3 * decoder_layer + 2 * d * v * tgt)
    assert training_flops(cfg, src, tgt) == expected
    assert flops_per_token(cfg, src, tgt) == expected / (src + tgt)
    pooled = ModelConfig(**{**cfg.__dict__, "cross_downsample": 4})
    assert training_flops(pooled, src, tgt) < expected  # cross-attention reads 10 pooled memory positions


def test_sliding_window_reduces_attention_flops():
    cfg = ModelConfig(d_model=64, n_heads=4, n_layers=2)
    windowed = ModelConfig(d_model=64, n_heads=4, n_layers=2, attention_window=16)
    gap = flops_per_token(cfg, 256) - flops_per_token(windowed, 256)
    assert gap == 12 * 2 * (256 - 16) * 64
