"""Analytic parameter counts equal built models; FLOPs and counts reproduce published figures."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.common import CONFIGS

from meshformer.config import AttentionConfig, FfnConfig, ModelConfig, MtpConfig, RopeConfig, load_config
from meshformer.config.migrate import model_from_flat
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
    # Gemma's sandwich norms (4 per block, 6 with cross-attention), GeGLU's gate; OLMo 2's whole-projection QK-norm
    "gemma-sandwich-geglu": dict(family="decoder", activation="geglu", norm="rmsnorm", norm_position="sandwich",
                                 norm_weight_offset=1.0, qk_norm=True, position="rope", bias=False),
    "seq2seq-sandwich": dict(family="encoder_decoder", norm_position="sandwich"),
    "olmo2-projection-qk-norm": dict(family="decoder", activation="swiglu", norm="rmsnorm", n_kv_heads=2,
                                     norm_position="post_sublayer", qk_norm=True, qk_norm_scope="projection"),
}


@pytest.mark.parametrize("name", list(SMALL))
def test_count_params_equals_built_model(name):
    cfg = model_from_flat(vocab_size=101, d_model=48, n_heads=6, n_layers=3, d_ff=80, max_seq_len=33, **SMALL[name])
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
    "mistral-7b": (7.24e9, 0.01),  # Jiang et al. 2023 ("7.24B")
    "qwen3-0.6b": (0.6e9, 0.01),  # Qwen3 Technical Report, Table 1 ("0.6B")
    "qwen3-8b": (8.2e9, 0.01),  # ("8.2B")
    "llama3.2-1b": (1_235_814_400, 0.0),  # HF meta-llama/Llama-3.2-1B, "1.24B"
    "llama3.1-8b": (8_030_261_248, 0.0),  # HF meta-llama/Llama-3.1-8B, "8.03B"
    "olmo2-7b": (7.3e9, 0.01),  # HF allenai/OLMo-2-1124-7B ("7.3B")
    "olmo3-7b": (7_298_011_136, 0.0),  # Olmo3ForCausalLM of allenai/Olmo-3-1025-7B's config (test_model_references)
    "gpt-oss-20b": (20_914_757_184, 0.0),  # GptOssForCausalLM of openai/gpt-oss-20b's config, "20.9B"
    "gpt-oss-120b": (116_829_156_672, 0.0),  # GptOssForCausalLM of openai/gpt-oss-120b's config, "116.8B"
    "deepseek-v3": (671_026_404_352, 0.0),  # DeepseekV3ForCausalLM of deepseek-ai/DeepSeek-V3's config, "671B"
    # DeepseekV32ForCausalLM of deepseek-ai/DeepSeek-V3.2's config (671,877,929,216) and its MTP module, "685B"
    "deepseek-v3.2": (683_501_956_608, 0.0),
    "kimi-k2": (1_026_408_209_408, 0.0),  # DeepseekV3ForCausalLM of moonshotai/Kimi-K2-Base's config
    "deepseek-v2-lite": (15_706_484_224, 0.0),  # DeepseekV2ForCausalLM of deepseek-ai/DeepSeek-V2-Lite's, "15.7B"
    "glm-4.5-air": (106_852_245_504, 0.0),  # Glm4MoeForCausalLM of zai-org/GLM-4.5-Air's config, "106B"
    # Qwen3NextForCausalLM of Qwen/Qwen3-Next-80B-A3B's config (test_model_references), "80B" (without its MTP block)
    "qwen3-next-80b-a3b": (79_674_391_296, 0.0),
    # Qwen3_5ForCausalLM of Qwen/Qwen3.5-9B's language model (test_model_references), "9B"
    "qwen3.5-9b": (8_953_803_264, 0.0),
    # KimiLinearForCausalLM of moonshotai/Kimi-Linear-48B-A3B-Instruct's config (test_kimi_linear), "48B"
    "kimi-linear-48b-a3b": (49_122_675_072, 0.0),
    # Mistral4ForCausalLM of transformers' Mistral4Config defaults, mistralai/Mistral-Small-4-119B-2603 (test_mistral4)
    "mistral-small-4": (118_972_826_624, 0.0),
    # NemotronHForCausalLM of nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's config (test_nemotron_h), "31.6B"
    "nemotron-3-nano-30b-a3b": (31_577_937_344, 0.0),
    # DeepseekV4ForCausalLM of deepseek-ai/DeepSeek-V4-Flash's and -Pro's configs (test_deepseek_v4), "284B", "1.6T"
    "deepseek-v4-flash": (284_332_230_231, 0.0),
    "deepseek-v4-pro": (1_572_973_188_067, 0.0),
}

# gpt-oss's active counts as its model card gives them (3.6B / 5.1B): every parameter a token uses but the input
# embedding table
GPT_OSS_ACTIVE = {"gpt-oss-20b": (4_187_440_704, 3.6e9), "gpt-oss-120b": (5_711_982_912, 5.1e9)}


@pytest.mark.parametrize("name", list(GPT_OSS_ACTIVE))
def test_gpt_oss_active_counts(name):
    counts = count_params(load_config(name).model)
    active, published = GPT_OSS_ACTIVE[name]
    assert counts["active"] == active
    assert abs(counts["active"] - counts["embedding"] - published) < 0.05e9, f"{counts['active']:,}"

# MoE configs: (published total, published active). Totals within 1%; the active counts are published with one
# decimal (Qwen3-30B-A3B's 3,353,032,704 is "3.3B", OLMoE's 1,281,955,840 "1.3B"), so within 0.1B of the figure,
# and exactly what the Hugging Face model's experts give (test_new_configs_count_...).
PUBLISHED_MOE = {
    "mixtral-8x7b": (46.7e9, 12.9e9),  # Jiang et al. 2024, "Mixtral of Experts"
    "qwen3-30b-a3b": (30.5e9, 3.3e9),  # Qwen3 Technical Report, Table 2
    "olmoe-1b-7b": (6.9e9, 1.3e9),  # Muennighoff et al. 2024, "OLMoE" (6.9B total, 1.3B active)
}


@pytest.mark.parametrize("name", list(PUBLISHED_MOE))
def test_moe_configs_reproduce_published_total_and_active(name):
    cfg = load_config(name)  # by bundled name: the shipped file is found without a path
    counts = count_params(cfg.model)
    total, active = PUBLISHED_MOE[name]
    assert counts["total"] == pytest.approx(total, rel=0.01), f"{counts['total']:,}"
    assert abs(counts["active"] - active) < 0.1e9, f"{counts['active']:,}"
    assert counts["total"] == built_params(cfg.model)


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


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "mistral-7b", "qwen3-0.6b",
                                  "qwen3-8b", "llama3.2-1b", "llama3.1-8b", "olmo2-7b", "olmo3-7b", "gpt-oss-20b",
                                  "gpt-oss-120b", "deepseek-v3", "kimi-k2", "tiny-deepseek", "glm-4.5-air",
                                  "deepseek-v3.2", "tiny-dsa",
                                  "deepseek-v2-lite", "qwen3-next-80b-a3b", "tiny-qwen3-next", "qwen3.5-9b",
                                  "kimi-linear-48b-a3b", "tiny-kimi-linear", "mistral-small-4", "tiny-v4"])
def test_new_configs_count_what_their_hugging_face_export_builds(name):
    """The exported architecture (config_to_hf), built on the meta device, has exactly our parameter count."""
    transformers = pytest.importorskip("transformers")
    from meshformer.checkpointing.hf import _MODEL_CLASSES, config_to_hf, infer_arch

    # transformers builds no multi-token prediction modules (their count: tests/unit/model/test_mtp.py)
    cfg = dataclasses.replace(load_config(name).model, mtp=MtpConfig())
    arch = infer_arch(cfg)
    with torch.device("meta"):
        hf = getattr(transformers, _MODEL_CLASSES[arch])(config_to_hf(cfg, arch))
    counts = count_params(cfg)
    assert counts["total"] == sum(p.numel() for p in hf.parameters())
    if cfg.moe.n_experts:  # active: every block's experts but experts_per_token of them left out, per their shapes
        experts = [layer.mlp.experts for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
        unused = sum((cfg.moe.n_experts - cfg.moe.experts_per_token) * sum(p[0].numel() for p in e.parameters())
                     for e in experts)  # one expert's slice of each stacked tensor (weights, and biases if any)
        assert counts["active"] == counts["total"] - unused


def test_olmoe_count_equals_hugging_face():
    """OLMoE's published shape built by transformers (QK-norm weights over the whole projections, 2 x 2048 a block)."""
    transformers = pytest.importorskip("transformers")
    cfg = load_config("olmoe-1b-7b").model
    with torch.device("meta"):
        hf = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
            num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, tie_word_embeddings=False))
    theirs = sum(p.numel() for p in hf.parameters())
    assert theirs == 6_919_161_856  # allenai/OLMoE-1B-7B-0924
    assert count_params(cfg)["total"] == theirs


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
    cfg = ModelConfig(family="encoder_decoder", vocab_size=100, d_model=64, n_encoder_layers=2, n_decoder_layers=3,
                      bias=False, tie_embeddings=True, attention=AttentionConfig(n_heads=4), ffn=FfnConfig(d_ff=128))
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
    cfg = ModelConfig(d_model=64, n_layers=2, attention=AttentionConfig(n_heads=4))
    windowed = ModelConfig(d_model=64, n_layers=2, layer_types=["sliding_attention"],
                           attention=AttentionConfig(n_heads=4, window=16))
    gap = flops_per_token(cfg, 256) - flops_per_token(windowed, 256)
    assert gap == 12 * 2 * (256 - 16) * 64


def test_global_blocks_of_a_window_pattern_count_every_key():
    """Gemma 3's pattern: 1 of every 3 blocks global, so 2 of 6 blocks see all 256 keys and 4 see 16."""
    windowed = ModelConfig(d_model=64, n_layers=6, layer_types=["sliding_attention"],
                           attention=AttentionConfig(n_heads=4, window=16))
    pattern = dataclasses.replace(windowed, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                  position="rope", rope=RopeConfig(local_theta=1e4))
    gap = flops_per_token(pattern, 256) - flops_per_token(windowed, 256)
    assert gap == 12 * 2 * (256 - 16) * 64


def test_qwen3_next_active_count_and_linear_flops():
    """Qwen3-Next-80B-A3B's "A3B": 3,874,929,408 active per token (3.6B without the input embedding table); its
    linear_attention blocks cost the chunked delta rule, not attention's T keys per query."""
    cfg = load_config("qwen3-next-80b-a3b").model
    counts = count_params(cfg)
    assert counts["active"] == 3_874_929_408
    assert abs(counts["active"] - counts["embedding"] - 3.56e9) < 0.01e9
    from meshformer.model.components.linear_attention import delta_rule_flops
    from meshformer.model.flops import flops_per_token

    la = cfg.linear_attention
    per_chunk = 64 * 64 * (3 * 128 + 2 * 128) + 64**3 // 2 + 3 * 64 * 128 * 128
    assert delta_rule_flops(cfg) == 2 * per_chunk * la.n_heads // 64
    short, long = flops_per_token(cfg, 4096), flops_per_token(cfg, 8192)
    # doubling the context adds attention's 4096 more keys per query in the 12 full_attention blocks only:
    # 3 (training) x 4 (QK^T and AV) x 12 blocks x 4096 keys x d_attn (16 heads x 256) per token
    assert long - short == pytest.approx(3 * 4 * 12 * 4096 * 16 * 256, rel=1e-12)
