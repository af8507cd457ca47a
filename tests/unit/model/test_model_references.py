"""meshformer models against torch.nn.Transformer and Hugging Face GPT-2 / BERT / Llama (3.x rotary scaling) / T5 /
Mistral / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE / OLMo 2 / Gemma 2 / Gemma 3 given the same weights.

HF models are built from small configs with random init (no download). Every parameter, norms and biases
included, is perturbed first so that swapping any two tensors of the same shape would be caught.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from helpers.torch_nn import config_from_torch_transformer, load_torch_transformer, to_torch_transformer_state_dict
from torch import nn

from meshformer.checkpointing.hf import (
    check_compatible,
    config_from_hf,
    from_hf_model,
    from_hf_state_dict,
    infer_arch,
    to_hf_model,
    to_hf_state_dict,
)
from meshformer.config import AttentionConfig, FfnConfig, MlaConfig, ModelConfig, NormConfig
from meshformer.config.migrate import model_from_flat
from meshformer.model import Transformer
from meshformer.model.config import LinearAttentionConfig

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")



@torch.no_grad()
def perturb(module: nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


# ----------------------------------------------------------------------------- torch.nn.Transformer


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_decoder_equals_torch_nn_transformer(norm_first):
    torch.manual_seed(0)
    ref = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
                         dropout=0.0, batch_first=True, norm_first=norm_first, dtype=torch.float64)
    perturb(ref)
    ref.train()  # dropout is 0; train mode keeps nn.Transformer off its nested-tensor fast path
    cfg = config_from_torch_transformer(ref, vocab_size=8)
    assert (cfg.norm.position, cfg.ffn.activation, cfg.use_final_norm) == ("pre" if norm_first else "post", "relu",
                                                                           True)
    ours = Transformer(cfg).double().eval()
    load_torch_transformer(ours, ref)
    ours.tok_embeddings = None  # embedding-free: both stacks take the same embedded tensors

    src, tgt = torch.randn(3, 9, 32, dtype=torch.float64), torch.randn(3, 6, 32, dtype=torch.float64)
    src_real = torch.ones(3, 9, dtype=torch.bool)
    src_real[0, 5:] = False
    src_real[2, 2:] = False
    tgt_real = torch.ones(3, 6, dtype=torch.bool)
    tgt_real[1, 4:] = False
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # nn.Transformer: True = may NOT attend
    expected = ref(src, tgt, tgt_mask=causal, src_key_padding_mask=~src_real, tgt_key_padding_mask=~tgt_real,
                   memory_key_padding_mask=~src_real)
    expected_memory = ref.encoder(src, src_key_padding_mask=~src_real)
    memory, memory_padding = ours.encode(src, src_real)
    hidden = ours.decode(tgt, tgt_real, memory=memory, memory_padding=memory_padding)
    torch.testing.assert_close(memory[src_real], expected_memory[src_real], rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden[tgt_real], expected[tgt_real], rtol=0, atol=1e-5)
    assert (hidden[tgt_real] - expected[tgt_real]).abs().max() < 1e-10  # float64: agreement to rounding
    back = to_torch_transformer_state_dict(ours)
    assert back.keys() == ref.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ref.state_dict().items())


# ----------------------------------------------------------------------------- Hugging Face


def with_selection_bias(hf: nn.Module) -> nn.Module:
    """A non-zero router selection bias (`e_score_correction_bias`, a buffer transformers initialises to zero)."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    return hf


def _hf_gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None))


def _hf_bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32))


def _hf_llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, rope_parameters={"rope_type": "default",
        "rope_theta": 500.0}, bos_token_id=None, eos_token_id=None, pad_token_id=None))


def _hf_llama3():
    # Llama 3.1's scaling with an 8-token original context: head_dim 8's four frequencies fall in all three bands
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8}, bos_token_id=None, eos_token_id=None, pad_token_id=None))


def _hf_mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=32, sliding_window=4, bos_token_id=None,
        eos_token_id=None))


def _hf_qwen2():
    # the window in every block (max_window_layers=0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_sliding_window=True, sliding_window=5,
        max_window_layers=0, tie_word_embeddings=True))


def _hf_qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=32, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8}))


def _hf_mixtral(**extra):
    # a 5-token sliding window on 12-token sequences: the window's boundary is crossed
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "max_position_embeddings": 32, "sliding_window": 5, "bos_token_id": None, "eos_token_id": None, **extra}))


def _hf_qwen3_moe(**extra):
    # head_dim 16 != 32 / 4, block 0 dense (mlp_only_layers), top-k weights not renormalised (Qwen3's default)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 24,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0], "max_position_embeddings": 32,
        "norm_topk_prob": False, **extra}))


def _hf_qwen3_next(**extra):
    # 3 Gated DeltaNet blocks then a gated attention block rotating half of each 16-wide head; block 0 dense, the
    # others 4 experts of width 16, top-2, with a gated shared expert twice as wide; grouped value heads (2 per key
    # head) and a chunk size (64) longer than the batch's sequences
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 6, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [0], "max_position_embeddings": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, **extra}))


def _hf_qwen3_5(**extra):
    # Qwen3.5's language model: 3 Gated DeltaNet blocks (split input projections) then a gated attention block
    # rotating half of each 16-wide head through the multimodal rotary embedding (text positions), dense blocks;
    # grouped value heads (2 per key head)
    return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 6,
        "max_position_embeddings": 32, "rope_parameters": {
            "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
            "mrope_interleaved": True}, **extra}))


def _hf_qwen3_5_moe(**extra):
    # Qwen3.5-MoE's language model: Qwen3.5's blocks, every feed-forward 4 experts of width 16, top-2 (renormalised)
    # beside a gated shared expert twice as wide
    return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**{
        "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 6, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "max_position_embeddings": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True}, **extra}))


def _hf_olmoe(**extra):
    # QK-norm over the whole q / k projections in pre-norm blocks, grouped-query heads, 4 experts of width 24, top-2
    # not renormalised (OLMoE's default)
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
        "max_position_embeddings": 32, "pad_token_id": None, "eos_token_id": None, **extra}))


def _hf_olmo2(**extra):
    # post-sublayer norms, QK-norm over the whole q / k projections, llama3 rope scaling
    return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
        "pad_token_id": None, "eos_token_id": None, **extra}))


def _hf_olmo3(**extra):
    # OLMo 2's blocks, 4 blocks with every 2nd global: windowed blocks (window 4 < 12 tokens) rotate with base 10k
    # unscaled, global ones with 500 and yarn scaling (as OLMo 3's long-context RoPE)
    return transformers.Olmo3ForCausalLM(transformers.Olmo3Config(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "rope_parameters": {
            "full_attention": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                               "original_max_position_embeddings": 8},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        "pad_token_id": None, "eos_token_id": None, **extra}))


def _hf_gpt_oss(**extra):
    # attention sinks, q/k/v/o biases, head_dim 16 != 32 / 4, 4 blocks alternating windowed (window 4 < 12 tokens)
    # and global, all rotating with untruncated yarn; 4 biased experts of width 24, top-2 of the biased router, the
    # clamped SwiGLU with a limit (0.5) the perturbed projections pass
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
        "num_experts_per_tok": 2, "max_position_embeddings": 32, "sliding_window": 4, "swiglu_limit": 0.5,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 8},
        "pad_token_id": None, "eos_token_id": None, "bos_token_id": None, **extra}))


def _hf_deepseek_v3(**extra):
    # multi-head latent attention (low-rank queries, interleaved RoPE, yarn with DeepSeek's mscale), block 0 dense,
    # 8 experts in 2 groups of which each token keeps 1, top-2 of sigmoid scores renormalised and scaled by 2.5, one
    # shared expert, and a nonzero selection bias (e_score_correction_bias, a buffer perturb() leaves alone)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 16,
        "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "n_routed_experts": 8,
        "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5, "max_position_embeddings": 32, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 8,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.8},
        "pad_token_id": None, "eos_token_id": None, "bos_token_id": None, **extra}))
    return with_selection_bias(hf)


def _hf_deepseek_v2_lite_shaped(**extra):
    # DeepSeek-V2-Lite's shape: queries through one projection (q_lora_rank None), half-split RoPE, unscaled, no
    # groups, weights not renormalised
    return _hf_deepseek_v3(**{"q_lora_rank": None, "rope_interleave": False, "n_group": 1, "topk_group": 1,
                              "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, **extra})


def _hf_deepseek_v2(**extra):
    # DeepSeek-V2: multi-head latent attention (low-rank queries, interleaved RoPE, yarn with DeepSeek's mscale),
    # block 0 dense, 8 experts in 4 groups scored by their best expert, 2 groups kept per token, top-2 of softmax
    # scores (not renormalised) scaled by 2, one shared expert
    return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 16,
        "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "n_routed_experts": 8,
        "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.0,
        "max_position_embeddings": 32, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 8,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.8},
        "pad_token_id": None, "eos_token_id": None, "bos_token_id": None, **extra}))


def _hf_deepseek_v2_lite(**extra):
    # DeepSeek-V2-Lite's shape: queries through one projection (q_lora_rank None), greedy top-k over all experts,
    # unscaled RoPE
    return _hf_deepseek_v2(**{"q_lora_rank": None, "topk_method": "greedy", "n_group": None, "topk_group": None,
                              "routed_scaling_factor": 1.0,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, **extra})


def _hf_glm4_moe(**extra):
    # GLM-4.5: grouped-query heads of width 16 (!= 32 / 4) rotating their first half, q/k/v biases, per-head QK-norm,
    # block 0 dense, 8 experts in 2 groups of which each token keeps 1, top-2 of sigmoid scores renormalised and
    # scaled by 2.5, one shared expert, a nonzero selection bias (a buffer perturb() leaves alone)
    hf = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "attention_bias": True, "use_qk_norm": True,
        "max_position_embeddings": 32, "num_nextn_predict_layers": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
        "pad_token_id": None, "eos_token_id": None, "bos_token_id": None, **extra}))
    return with_selection_bias(hf)


def _hf_gemma2(**extra):
    # every 2nd block global (Gemma 2's default layer_types), attention- and final-logit soft-capping with caps
    # below the scores' and logits' ranges (so they bend them), yarn rope scaling for every block
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 32,
        "sliding_window": 4, "query_pre_attn_scalar": 8, "attn_logit_softcapping": 0.5,
        "final_logit_softcapping": 2.0, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                            "original_max_position_embeddings": 8},
        "pad_token_id": None, "eos_token_id": None, "bos_token_id": None, **extra}))


def _hf_gemma3(**extra):
    # 4 blocks, every 2nd global: windowed blocks (window 4 < 12 tokens) rotate with base 10k unscaled, global ones
    # with 1M and linear scaling; head_dim 16 != 32 / 4, a query_pre_attn_scalar other than head_dim, final-logit
    # soft-capping (3 < the logits' range, so it bends them)
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 32,
        "sliding_window": 4, "sliding_window_pattern": 2, "query_pre_attn_scalar": 12, "final_logit_softcapping": 3.0,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        "pad_token_id": None, "eos_token_id": None, "bos_token_id": None, **extra}))


def _hf_t5(**extra):
    # Few buckets and a short max distance, so 12-token sequences reach the log-spaced and the clipped buckets.
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=10, **extra))


def _random_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (3, 12), generator=gen)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:] = 0  # right padding
    mask[2, 3:] = 0
    return ids, mask


_SINGLE_STACK = [_hf_gpt2, _hf_bert, _hf_llama, _hf_llama3, _hf_mistral, _hf_qwen2, _hf_qwen3, _hf_mixtral,
                 _hf_qwen3_moe, _hf_olmoe, _hf_olmo2, _hf_olmo3, _hf_gemma2, _hf_gemma3, _hf_gpt_oss, _hf_deepseek_v3,
                 _hf_deepseek_v2_lite_shaped, _hf_qwen3_next, _hf_qwen3_5,
                 _hf_qwen3_5_moe, _hf_glm4_moe, _hf_deepseek_v2, _hf_deepseek_v2_lite]
_SINGLE_IDS = ["gpt2", "bert", "llama", "llama3", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "olmoe", "olmo2",
               "olmo3", "gemma2", "gemma3", "gpt_oss", "deepseek_v3", "deepseek_v2_lite_shaped", "qwen3_next",
               "qwen3_5", "qwen3_5_moe", "glm4_moe", "deepseek_v2", "deepseek_v2_lite"]


@pytest.mark.parametrize("make", _SINGLE_STACK, ids=_SINGLE_IDS)
def test_hf_single_stack_logits_match(make):
    torch.manual_seed(0)
    hf = make()
    perturb(hf)
    hf.eval()
    ours = from_hf_model(hf).eval()
    ids, mask = _random_batch()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, mask.bool())
    real = mask.bool()  # padded positions are don't-care outputs
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-4)
    assert expected.std() > 0.1  # logits are not trivially small, so 1e-4 is a real bound


def test_hf_t5_with_relative_bias_matches():
    torch.manual_seed(0)
    hf = _hf_t5()
    perturb(hf)
    hf.eval()
    ours = from_hf_model(hf).eval()
    cfg = ours.cfg
    assert (cfg.position, cfg.attention.relative_buckets, cfg.attention.relative_max_distance) == ("t5_relative", 8, 10)
    assert (cfg.attention.scale, cfg.scale_output) == (1.0, True)
    ids, mask = _random_batch()
    target, target_mask = _random_batch(seed=2)  # 12 target tokens: causal distances up to 11 > max distance 10
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=target,
                      decoder_attention_mask=target_mask).logits
        got = ours(ids, mask.bool(), target, target_mask.bool())
    real = target_mask.bool()  # padded target positions are don't-care outputs
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-4)
    assert expected.std() > 0.1
    # export: HF computes the same logits from our weights (the bias is real, not zero: a dropped table would show)
    assert ours.encoder_relative_bias.relative_bias.weight.abs().min() > 0
    exported = to_hf_model(ours).eval()
    with torch.no_grad():
        back = exported(input_ids=ids, attention_mask=mask, decoder_input_ids=target,
                        decoder_attention_mask=target_mask).logits
    torch.testing.assert_close(back[real], got[real], rtol=0, atol=1e-4)


@pytest.mark.parametrize("make", [*_SINGLE_STACK, _hf_t5], ids=[*_SINGLE_IDS, "t5"])
def test_hf_state_dict_round_trip(make):
    torch.manual_seed(0)
    hf = make()
    perturb(hf)
    ours = from_hf_model(hf)
    assert infer_arch(ours.cfg) == hf.config.model_type
    back = to_hf_model(ours).state_dict()
    original = hf.state_dict()
    assert back.keys() == original.keys()
    for key, value in original.items():
        if "token_type_embeddings" in key or "position_embeddings" in key:
            continue  # BERT: token type 0 is folded into the positions (checked below)
        assert torch.equal(back[key], value), key
    if hf.config.model_type == "bert":
        folded = original["bert.embeddings.position_embeddings.weight"]
        folded = folded + original["bert.embeddings.token_type_embeddings.weight"][0]
        torch.testing.assert_close(back["bert.embeddings.position_embeddings.weight"], folded)


def test_gpt2_conv1d_transpose_and_qkv_packing():
    torch.manual_seed(0)
    hf = _hf_gpt2()
    ours = from_hf_model(hf)
    c_attn = hf.transformer.h[1].attn.c_attn.weight  # (in, 3 * out): y = x @ W
    torch.testing.assert_close(ours.decoder_layers["1"].attn.k_proj.weight, c_attn[:, 32:64].T)
    assert ours.cfg.ffn.activation == "gelu_tanh" and ours.output.weight is ours.tok_embeddings.weight


def test_incompatible_configs_and_stray_tensors_are_refused():
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, position="rope", attention=AttentionConfig(n_heads=4),
                      ffn=FfnConfig(d_ff=64))
    with pytest.raises(ValueError, match="position='rope'"):
        check_compatible(cfg, "gpt2")
    with pytest.raises(ValueError, match="no Hugging Face architecture"):
        infer_arch(ModelConfig(position="alibi"))
    hf = _hf_llama()
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="no meshformer counterpart"):
        from_hf_state_dict(state, config_from_hf(hf.config), "llama")
    with pytest.raises(ValueError, match="gated-gelu"):  # T5 v1.1's gelu_new gate is not our silu gate
        from_hf_model(_hf_t5(feed_forward_proj="gated-gelu"))


def test_llama_export_runs_in_hf_with_gqa():
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, position="rope", tie_embeddings=False, bias=False,
                      max_seq_len=32, attention=AttentionConfig(n_heads=4, n_kv_heads=1),
                      ffn=FfnConfig(d_ff=48, activation="swiglu"), norm=NormConfig(kind="rmsnorm"))
    torch.manual_seed(0)
    ours = Transformer(cfg).eval()
    perturb(ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = to_hf_model(ours).eval()
    ids = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, rtol=0, atol=1e-4)
    assert to_hf_state_dict(ours)["model.layers.0.self_attn.k_proj.weight"].shape == (8, 32)


def test_base_model_checkpoint_names_are_accepted():
    """Hub-style files: GPT2Model names without "transformer.", TF-era BERT gamma/beta plus pooler and NSP head."""
    torch.manual_seed(0)
    gpt2 = _hf_gpt2()
    base = {k.removeprefix("transformer."): v for k, v in gpt2.state_dict().items() if k != "lm_head.weight"}
    base["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)  # the causal-mask buffer old checkpoints carry
    cfg = config_from_hf(gpt2.config)
    expected = from_hf_state_dict(gpt2.state_dict(), cfg, "gpt2")
    got = from_hf_state_dict(base, cfg, "gpt2")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)

    bert = _hf_bert()
    old = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
           for k, v in bert.state_dict().items()}
    old["bert.pooler.dense.weight"] = torch.zeros(32, 32)
    old["cls.seq_relationship.weight"] = torch.zeros(2, 32)
    cfg = config_from_hf(bert.config)
    got, expected = from_hf_state_dict(old, cfg, "bert"), from_hf_state_dict(bert.state_dict(), cfg, "bert")
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def _llama_config(**extra) -> ModelConfig:
    return model_from_flat(**{"vocab_size": 97, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2, "d_ff": 48,
                          "activation": "swiglu", "norm": "rmsnorm", "position": "rope", "tie_embeddings": False,
                          "bias": False, "max_seq_len": 32, **extra})


def _moe_config(**extra) -> ModelConfig:
    return _llama_config(**{"n_experts": 4, "experts_per_token": 2, **extra})


def _qwen3_next_config(**extra) -> ModelConfig:
    """Qwen3-Next's pieces: a linear_attention block then a gated attention block rotating a quarter of each head,
    (1 + weight) RMSNorms, per-head QK-norm, MoE blocks with a gated shared expert."""
    cfg = _moe_config(**{"n_layers": 4, "head_dim": 16, "qk_norm": True, "norm_weight_offset": 1.0, "moe_d_ff": 16,
                         "n_shared_experts": 2, "moe_first_dense": 1,
                         "layer_types": ["linear_attention", "full_attention"], **extra})
    cfg.linear_attention = LinearAttentionConfig(n_heads=4, n_key_heads=2, key_head_dim=8, value_head_dim=6)
    cfg.attention.output_gate, cfg.rope.partial_factor, cfg.moe.shared_expert_gate = True, 0.25, True
    return cfg


def _qwen3_5_config(**extra) -> ModelConfig:
    """Qwen3.5's pieces: Qwen3-Next's blocks with the split Gated DeltaNet projections and dense MLPs."""
    cfg = _llama_config(**{"n_layers": 4, "head_dim": 16, "qk_norm": True, "norm_weight_offset": 1.0,
                           "layer_types": ["linear_attention", "full_attention"], **extra})
    cfg.linear_attention = LinearAttentionConfig(n_heads=4, n_key_heads=2, key_head_dim=8, value_head_dim=6,
                                                 projections="split")
    cfg.attention.output_gate, cfg.rope.partial_factor = True, 0.25
    return cfg


def _qwen3_5_moe_config(**extra) -> ModelConfig:
    """Qwen3.5-MoE's pieces: Qwen3.5's blocks, every feed-forward experts beside a gated shared expert (the unused
    dense width as moe_d_ff, as import sets it)."""
    cfg = _qwen3_5_config(**{"n_experts": 4, "experts_per_token": 2, "moe_d_ff": 16, "d_ff": 16,
                             "n_shared_experts": 2, **extra})
    cfg.moe.shared_expert_gate = True
    return cfg


_LLAMA3_ROPE = {"rope_scaling": "llama3", "rope_scaling_factor": 8.0, "rope_original_max_seq_len": 8,
                "rope_theta": 500.0}
_YARN_ROPE = {"rope_scaling": "yarn", "rope_scaling_factor": 4.0, "rope_original_max_seq_len": 8,
              "rope_attention_factor": 1.2}
# Gemma 3's options: sandwich (1 + weight) RMSNorms, per-head QK-norm, scaled embeddings, GeGLU, every 3rd of 4 blocks
# global with its own RoPE base, a query_pre_attn_scalar of 8, final-logit soft-capping
_GEMMA3 = {"n_layers": 4, "head_dim": 16, "activation": "geglu", "norm_position": "sandwich", "norm_weight_offset": 1.0,
           "qk_norm": True, "scale_embeddings": True, "tie_embeddings": True, "attention_window": 4,
           "full_attention_every": 3, "rope_theta": 1e6, "rope_local_theta": 1e4, "attention_scale": 8**-0.5,
           "logit_softcap": 4.0, **_YARN_ROPE}
# OLMo 3's options: OLMo 2's blocks, every 3rd of 4 blocks global with yarn, the windowed ones with their own base
_OLMO3 = {"n_layers": 4, "norm_position": "post_sublayer", "qk_norm": True, "qk_norm_scope": "projection",
          "attention_window": 4, "full_attention_every": 3, "rope_theta": 500.0, "rope_local_theta": 1e4, **_YARN_ROPE}

# gpt-oss's options: q/k/v/o biases, sinks, every 2nd of 4 blocks global, untruncated yarn in every block, biased
# experts and router, the clamped SwiGLU
_GPT_OSS = {"n_layers": 4, "head_dim": 16, "bias": True, "attention_sinks": True, "attention_window": 4,
            "full_attention_every": 2, "activation": "swiglu_clamped", "swiglu_limit": 0.5, "router_bias": True,
            "expert_bias_terms": True, "rope_truncate": False, **_YARN_ROPE}


# DeepSeek-V3's options: mla blocks (low-rank queries, yarn with mscale), block 0 dense, grouped sigmoid routing scaled
# by 2.5, one shared expert
_DEEPSEEK_V3 = {"n_layers": 3, "n_kv_heads": None, "layer_types": ["mla"], "n_experts": 8, "moe_d_ff": 16,
                "moe_first_dense": 1, "n_shared_experts": 1, "router_score": "sigmoid", "router_groups": 2,
                "router_groups_per_token": 1, "router_scale": 2.5, "mla": MlaConfig(
                    q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                    mscale_all_dim=0.7), **_YARN_ROPE}

# DeepSeek-V2's options: DeepSeek-V3's mla blocks and experts with softmax scores, not renormalised, in 4 groups
# scored by their best expert
_DEEPSEEK_V2 = {**_DEEPSEEK_V3, "router_score": "softmax", "router_renormalize": False, "router_groups": 4,
                "router_groups_per_token": 2, "router_group_score": "max", "router_scale": 2.0}

# GLM-4.5's options: grouped-query heads of width 16 rotating their first half, q/k/v biases, per-head QK-norm, block 0
# dense, grouped sigmoid routing scaled by 2.5, one shared expert
_GLM4_MOE = {"n_layers": 3, "head_dim": 16, "qkv_bias": True, "qk_norm": True, "n_experts": 8, "moe_d_ff": 16,
             "moe_first_dense": 1, "n_shared_experts": 1, "router_score": "sigmoid", "router_groups": 2,
             "router_groups_per_token": 1, "router_scale": 2.5}


def _glm4_moe_config(**extra) -> ModelConfig:
    cfg = _moe_config(**{**_GLM4_MOE, **extra})
    cfg.rope.partial_factor = 0.5
    return cfg


@pytest.mark.parametrize(("arch", "cfg"), [
    ("llama", _llama_config(**_LLAMA3_ROPE)),
    ("llama", _llama_config(rope_scaling="linear", rope_scaling_factor=2.0, head_dim=16)),
    ("mistral", _llama_config(attention_window=4, head_dim=16)),
    ("qwen2", _llama_config(qkv_bias=True, attention_window=5, tie_embeddings=True)),
    ("qwen3", _llama_config(qk_norm=True, head_dim=16, **_YARN_ROPE)),
    ("mixtral", _moe_config(attention_window=4)),
    ("qwen3_moe", _moe_config(qk_norm=True, head_dim=16, n_layers=4, moe_every=2, moe_first_dense=2, moe_d_ff=16,
                              router_renormalize=False)),
    ("olmoe", _moe_config(qk_norm=True, qk_norm_scope="projection", router_renormalize=False, d_ff=24)),
    ("olmo2", _llama_config(norm_position="post_sublayer", qk_norm=True, qk_norm_scope="projection", **_LLAMA3_ROPE)),
    ("olmo3", _llama_config(**_OLMO3)),
    ("gemma2", _llama_config(**{**_GEMMA3, "qk_norm": False, "rope_local_theta": None, "attention_softcap": 1.0})),
    ("gemma3_text", _llama_config(**_GEMMA3)),
    ("gpt_oss", _moe_config(**_GPT_OSS)),
    ("deepseek_v3", _moe_config(**_DEEPSEEK_V3)),
    ("deepseek_v3", _moe_config(**{**_DEEPSEEK_V3, "mla": MlaConfig(kv_lora_rank=12, qk_nope_head_dim=8,
                                                                    qk_rope_head_dim=4, v_head_dim=6)})),
    ("deepseek_v2", _moe_config(**_DEEPSEEK_V2)),
    ("deepseek_v2", _moe_config(**{**_DEEPSEEK_V2, "router_groups": 1, "router_groups_per_token": 1,
                                   "router_group_score": "top2_sum", "mla": MlaConfig(
                                       kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)})),
    ("glm4_moe", _glm4_moe_config()),
    ("glm4_moe", _glm4_moe_config(qkv_bias=False, qk_norm=False, router_groups=1, router_renormalize=False,
                                  n_kv_heads=None)),
    ("qwen3_next", _qwen3_next_config()),
    ("qwen3_5_text", _qwen3_5_config()),
    ("qwen3_5_moe_text", _qwen3_5_moe_config()),
], ids=["llama3", "llama-linear", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "olmoe", "olmo2", "olmo3",
        "gemma2", "gemma3", "gpt_oss", "deepseek_v3", "deepseek_v3-direct-queries", "deepseek_v2",
        "deepseek_v2-lite", "glm4_moe", "glm4_moe-plain",
        "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
def test_export_logits_and_round_trip(arch, cfg):
    """Ours -> HF computes our logits (padded batch, sequences longer than the window) and comes back bitwise."""
    torch.manual_seed(0)
    ours = Transformer(cfg).eval()
    perturb(ours)
    assert infer_arch(ours.cfg) == arch
    hf = to_hf_model(ours).eval()
    ids, mask = _random_batch()
    with torch.no_grad():
        got, expected = ours(ids, mask.bool()), hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(expected[real], got[real], rtol=0, atol=1e-4)
    assert expected.std() > 0.1
    back = from_hf_model(hf)
    assert back.cfg == ours.cfg
    mine = ours.state_dict()
    assert back.state_dict().keys() == mine.keys()
    assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())


def test_moe_expert_layout():
    """Expert j of Mixtral's w1 (out, in) is slice j of our stacked gate_proj (in, out), transposed."""
    torch.manual_seed(0)
    hf = _hf_mixtral()
    perturb(hf)
    ours = from_hf_model(hf)
    state = to_hf_state_dict(ours)
    gate = ours.decoder_layers["1"].ffn.experts.gate_proj
    torch.testing.assert_close(state["model.layers.1.block_sparse_moe.experts.2.w1.weight"], gate[2].T, rtol=0,
                               atol=0)
    fused = hf.model.layers[1].mlp.experts.gate_up_proj  # transformers 5 keeps [gate; up] fused in memory
    torch.testing.assert_close(fused[2, :48], gate[2].T, rtol=0, atol=0)


def test_nonzero_expert_bias_is_refused_on_export():
    ours = Transformer(_moe_config())
    bias = ours.decoder_layers["0"].ffn.router.expert_bias
    state = {**ours.state_dict(), "decoder_layers.0.ffn.router.expert_bias": bias}  # persistent or not
    from meshformer.checkpointing.hf import check_exportable

    check_exportable(state, "mixtral")  # zeros: nothing to refuse
    state["decoder_layers.0.ffn.router.expert_bias"] = bias + torch.arange(4.0)
    with pytest.raises(ValueError, match=r"decoder_layers\.0\.ffn\.router\.expert_bias is nonzero"):
        check_exportable(state, "mixtral")


@pytest.mark.parametrize(("extra", "named"), [
    ({"n_shared_experts": 1}, "n_shared_experts=1"),
    ({"router_score": "sigmoid"}, "router_score='sigmoid'"),
    ({"router_groups": 2, "router_groups_per_token": 1}, "router_groups=2"),
    ({"capacity_factor": 1.25}, "capacity_factor=1.25"),
    ({"moe_every": 2}, "moe_blocks='some'"),
    ({"router_renormalize": False}, "router_renormalize=False"),
    ({"qk_norm": True}, "qk_norm=True"),
])
def test_mixtral_refuses_what_it_cannot_express(extra, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        check_compatible(_moe_config(**extra), "mixtral")


def test_gemma3_refuses_scaled_rope_in_its_windowed_blocks():
    """Without rope_local_theta our windowed blocks rotate with the scaled global RoPE; Gemma 3's sliding blocks
    rotate unscaled, so such a model cannot be exported as it computes (with a local base it can)."""
    cfg = _llama_config(**{**_GEMMA3, "rope_local_theta": None})
    with pytest.raises(ValueError, match=re.escape("windowed_blocks_rope='scaled")):
        check_compatible(cfg, "gemma3_text")
    check_compatible(_llama_config(**{**_GEMMA3, "rope_local_theta": None, "rope_scaling": "none"}), "gemma3_text")


def test_olmo3_export_refuses_what_it_lacks():
    """OLMo 3's sliding blocks rotate unscaled (so a windowed model whose windowed blocks share the scaled global
    RoPE is refused), its QK-norm spans the whole projection, and head_dim is hidden_size / heads."""
    for extra, named in [({"rope_local_theta": None}, "windowed_blocks_rope='scaled"),
                         ({"qk_norm_scope": "head"}, "qk_norm_scope='head'"), ({"head_dim": 16}, "head_dim=16")]:
        with pytest.raises(ValueError, match=re.escape(named)):
            check_compatible(_llama_config(**{**_OLMO3, **extra}), "olmo3")
    # an OLMo 2 model (no window) is exported as OLMo 2, though OLMo 3 could hold it too
    assert infer_arch(_llama_config(**{**_OLMO3, "attention_window": None, "full_attention_every": None,
                                       "rope_local_theta": None})) == "olmo2"


def test_olmo3_7b_published_config_maps_both_ways():
    """OLMo 3 7B's published config.json values (no download): every 4th of 32 blocks global, a 4096-token window,
    yarn in the global blocks only; it gives the bundled olmo3-7b model, the model built from it on the meta device
    has our parameter count, and the config comes back."""
    from meshformer.checkpointing.hf import config_to_hf
    from meshformer.config import load_config
    from meshformer.model.flops import count_params

    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
            "attention_factor": 1.2079441541679836, "beta_fast": 32.0, "beta_slow": 1.0}
    published = transformers.Olmo3Config(
        vocab_size=100278, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=65536, rms_norm_eps=1e-6, sliding_window=4096,
        rope_theta=500000.0, rope_scaling=yarn, pad_token_id=100277, eos_token_id=100257)
    assert published.layer_types[:4] == ["sliding_attention"] * 3 + ["full_attention"]  # transformers' default
    cfg = config_from_hf(published)
    assert (cfg.attention.window, cfg.rope.local_theta) == (4096, 500000.0)
    assert cfg.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert cfg == load_config("olmo3-7b").model
    with torch.device("meta"):
        hf = transformers.Olmo3ForCausalLM(published)
    assert count_params(cfg)["total"] == sum(p.numel() for p in hf.parameters()) == 7_298_011_136
    back = config_to_hf(cfg)
    assert back.layer_types == published.layer_types and back.rope_parameters == published.rope_parameters


def test_gpt_oss_expert_layout():
    """gpt-oss's gate_up_proj (E, d, 2f) holds expert j's gate in its even columns and up in its odd ones, (in,
    out) as our stacked gate_proj / up_proj; its bias likewise."""
    torch.manual_seed(0)
    hf = _hf_gpt_oss()
    perturb(hf)
    ours = from_hf_model(hf)
    experts = ours.decoder_layers["1"].ffn.experts
    fused = hf.model.layers[1].mlp.experts
    for ours_name, column in (("gate", 0), ("up", 1)):
        torch.testing.assert_close(getattr(experts, f"{ours_name}_proj"), fused.gate_up_proj[..., column::2],
                                   rtol=0, atol=0)
        torch.testing.assert_close(getattr(experts, f"{ours_name}_bias"), fused.gate_up_proj_bias[..., column::2],
                                   rtol=0, atol=0)
    state = to_hf_state_dict(ours)
    assert torch.equal(state["model.layers.1.mlp.experts.gate_up_proj"], fused.gate_up_proj)
    assert torch.equal(state["model.layers.1.self_attn.sinks"], hf.model.layers[1].self_attn.sinks)


def test_gpt_oss_ignores_hidden_act_as_transformers_does():
    """gpt-oss's experts apply the clamped SwiGLU whatever hidden_act says: another value imports as the same model."""
    assert config_from_hf(_hf_gpt_oss(hidden_act="gelu").config) == config_from_hf(_hf_gpt_oss().config)


def test_gpt_oss_export_refuses_what_it_lacks():
    """gpt-oss always has sinks, a router bias and expert biases, and gates with the clamped SwiGLU."""
    for extra, named in [({"attention_sinks": False}, "attention_sinks=False"),
                         ({"router_bias": False}, "router_bias=False"),
                         ({"expert_bias_terms": False}, "expert_linear_bias=False"),
                         ({"activation": "swiglu"}, "activation='swiglu'"), ({"qk_norm": True}, "qk_norm=True")]:
        with pytest.raises(ValueError, match=re.escape(named)):
            check_compatible(_moe_config(**{**_GPT_OSS, **extra}), "gpt_oss")


def test_gpt_oss_quantized_experts_are_refused():
    """The Hub's MXFP4 layout (experts as *_blocks / *_scales) is refused naming the fix, before any rule misses
    gate_up_proj."""
    hf = _hf_gpt_oss()
    cfg = config_from_hf(hf.config)
    state = dict(hf.state_dict())
    for name in [k for k in state if ".mlp.experts." in k and "bias" not in k]:
        weight = state.pop(name)
        state[f"{name}_blocks"], state[f"{name}_scales"] = weight.to(torch.uint8), weight[..., 0].to(torch.uint8)
    with pytest.raises(ValueError, match=r"gpt_oss: model\.layers\.0\.mlp\.experts\.\w+_(blocks|scales): the "
                       r"experts are stored quantized .* quantization_config"):
        from_hf_state_dict(state, cfg, "gpt_oss")


@pytest.mark.parametrize(("name", "layers", "experts"), [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)])
def test_gpt_oss_published_configs_map_both_ways(name, layers, experts):
    """transformers' GptOssConfig defaults are gpt-oss-120b's published config (20b: 24 blocks of 32 experts): they
    give the bundled config (block 0 windowed, every 2nd global, untruncated yarn), whose parameter count the model
    transformers builds on the meta device has, and come back."""
    from meshformer.checkpointing.hf import config_to_hf
    from meshformer.config import load_config
    from meshformer.model.flops import count_params

    published = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts)
    assert published.layer_types[:2] == ["sliding_attention", "full_attention"]
    cfg = config_from_hf(published)
    assert (cfg.attention.window, cfg.rope.truncate) == (128, False)
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    assert [cfg.window(i) for i in range(4)] == [128, None, 128, None]
    assert cfg == load_config(name).model
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(published)
    assert count_params(cfg)["total"] == sum(p.numel() for p in hf.parameters())
    back = config_to_hf(cfg)
    assert back.layer_types == published.layer_types and back.rope_parameters == published.rope_parameters


def test_qwen3_next_published_config_maps_both_ways():
    """Qwen/Qwen3-Next-80B-A3B's config.json values (no download) give the bundled config (three linear_attention
    blocks then a full one, a quarter of each head rotating), whose parameter count the model transformers builds on
    the meta device has, and come back."""
    from meshformer.checkpointing.hf import config_to_hf
    from meshformer.config import load_config
    from meshformer.model.flops import count_params

    published = transformers.Qwen3NextConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=0.001, tie_word_embeddings=False)
    cfg = config_from_hf(published)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] and cfg.rope_dim == 64
    assert cfg == load_config("qwen3-next-80b-a3b").model
    with torch.device("meta"):
        hf = transformers.Qwen3NextForCausalLM(published)
    assert count_params(cfg)["total"] == sum(p.numel() for p in hf.parameters()) == 79_674_391_296
    back = config_to_hf(cfg)
    assert back.layer_types == published.layer_types and back.rope_parameters == published.rope_parameters


@pytest.mark.parametrize(("extra", "named"), [
    ({"attention_bias": True}, "attention_bias=True"),
    ({"shared_expert_intermediate_size": 24}, "shared_expert_intermediate_size=24"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"mlp_only_layers": [2]}, r"mlp_only_layers=\[2\]"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='dynamic'"),
])
def test_qwen3_next_refuses_what_it_cannot_express(extra, named):
    with pytest.raises(ValueError, match=f"qwen3_next: {named}"):
        config_from_hf(_hf_qwen3_next(**extra).config)


def test_qwen3_next_export_refuses_what_it_lacks():
    import dataclasses

    cfg = _qwen3_next_config()
    for changed, named in ((dataclasses.replace(cfg, bias=True), "bias"),
                           (dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, output_gate=False)),
                            "attention_output_gate"),
                           (dataclasses.replace(cfg, norm=dataclasses.replace(cfg.norm, weight_offset=0.0)),
                            "norm_weight_offset"),
                           (dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, shared_expert_gate=False)),
                            "gated_shared_expert")):
        with pytest.raises(ValueError, match=named):
            check_compatible(changed, "qwen3_next")
    with pytest.raises(ValueError, match="linear_attention"):  # no other architecture has linear_attention blocks
        check_compatible(_qwen3_next_config(), "qwen3_moe")


def test_qwen3_next_mtp_weights_are_left_unread():
    torch.manual_seed(0)
    model = from_hf_model(_hf_qwen3_next())
    state = {**to_hf_state_dict(model), "mtp.fc.weight": torch.zeros(2, 2)}  # the names save_pretrained writes
    ours = from_hf_state_dict(state, model.cfg, "qwen3_next")
    assert ours.keys() == model.state_dict().keys()


def test_qwen3_5_published_config_maps_both_ways():
    """Qwen/Qwen3.5-9B's language model (transformers' Qwen3_5TextConfig defaults, the model card's context and RoPE
    base; multimodal rope sections as published) gives the bundled config, whose parameter count the model transformers
    builds on the meta device has, and comes back."""
    from meshformer.checkpointing.hf import config_to_hf
    from meshformer.config import load_config
    from meshformer.model.flops import count_params

    rope = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    published = transformers.Qwen3_5TextConfig(max_position_embeddings=262144, rope_parameters=rope)
    cfg = config_from_hf(published)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] and cfg.rope_dim == 64
    assert cfg.linear_attention.projections == "split"
    assert cfg == load_config("qwen3.5-9b").model
    with torch.device("meta"):
        hf = transformers.Qwen3_5ForCausalLM(published)
    assert count_params(cfg)["total"] == sum(p.numel() for p in hf.parameters()) == 8_953_803_264
    back = config_to_hf(cfg)
    assert back.model_type == "qwen3_5_text" and back.layer_types == published.layer_types
    assert back.rope_parameters["rope_theta"] == 1e7 and back.rope_parameters["partial_rotary_factor"] == 0.25


@pytest.mark.parametrize(("extra", "named"), [
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='dynamic'"),
])
def test_qwen3_5_refuses_what_it_cannot_express(extra, named):
    with pytest.raises(ValueError, match=f"qwen3_5_text: {named}"):
        config_from_hf(_hf_qwen3_5(**extra).config)


def test_qwen3_5_and_qwen3_next_refuse_each_others_linear_projections():
    with pytest.raises(ValueError, match="grouped_linear_projections"):
        check_compatible(_qwen3_5_config(), "qwen3_next")
    with pytest.raises(ValueError, match="split_linear_projections"):
        check_compatible(_qwen3_next_config(n_experts=0), "qwen3_5_text")


def test_qwen3_5_multimodal_names_import_the_language_model():
    """A Qwen3_5ForConditionalGeneration checkpoint's language model (model.language_model.*) imports; its vision
    tower (model.visual.*) and MTP block are left unread."""
    torch.manual_seed(0)
    model = from_hf_model(_hf_qwen3_5())
    state = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
             for k, v in to_hf_state_dict(model).items()}
    state.update({"model.visual.patch_embed.proj.weight": torch.zeros(2, 2), "mtp.fc.weight": torch.zeros(2, 2)})
    ours = from_hf_state_dict(state, model.cfg, "qwen3_5_text")
    assert ours.keys() == model.state_dict().keys()
    assert all(torch.equal(ours[k], v) for k, v in model.state_dict().items())


def test_llama31_rope_parameters_map_both_ways():
    """Llama 3.1 8B's published config.json rope block (no download: its values) to our keys and back."""
    from meshformer.checkpointing.hf import config_to_hf

    published = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = config_from_hf(transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=published))
    assert (cfg.rope.scaling, cfg.rope.factor, cfg.rope.original_max_seq_len) == ("llama3", 8.0, 8192)
    assert (cfg.rope.low_freq_factor, cfg.rope.high_freq_factor, cfg.rope.theta) == (1.0, 4.0, 500000.0)
    assert config_to_hf(cfg).rope_parameters == published


@pytest.mark.parametrize(("make", "extra", "named"), [
    (_hf_olmo2, {"attention_bias": True}, "attention_bias=True"),
    (_hf_olmo2, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    (_hf_gemma3, {"layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]},
     "layer_types=["),
    (_hf_gemma3, {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention="),
    (_hf_gemma3, {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    (_hf_gemma3, {"attention_bias": True}, "attention_bias=True"),
    (_hf_gemma3, {"hidden_activation": "silu"}, "hidden_activation='silu'"),
    (_hf_olmoe, {"clip_qkv": 8.0}, "clip_qkv=8.0"),
    (_hf_olmoe, {"attention_bias": True}, "attention_bias=True"),
    # not every n-th block global: today's full_attention_every cannot express it
    (_hf_olmo3, {"layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]},
     "layer_types=['full_attention', 'sliding_attention', 'sliding_attention', 'full_attention'] is not every n-th"),
    (_hf_olmo3, {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500.0},
                                     "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention="),
    (_hf_olmo3, {"attention_bias": True}, "attention_bias=True"),
    (_hf_gpt_oss, {"layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]},
     "layer_types=['full_attention', 'sliding_attention', 'sliding_attention', 'full_attention'] is not every n-th"),
    (_hf_gpt_oss, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "mscale": 2.0,
                                       "original_max_position_embeddings": 8}}, "rope_parameters.mscale=2.0"),
], ids=["olmo2-attention-bias", "olmo2-act", "gemma3-layer-types", "gemma3-local-rope-scaling", "gemma3-bidirectional",
        "gemma3-attention-bias", "gemma3-act", "olmoe-clip-qkv", "olmoe-attention-bias", "olmo3-layer-types",
        "olmo3-local-rope-scaling", "olmo3-attention-bias", "gpt_oss-layer-types", "gpt_oss-yarn-mscale"])
def test_olmo2_gemma3_refuse_what_they_cannot_express(make, extra, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        config_from_hf(make(**extra).config)


@pytest.mark.parametrize(("cfg", "named"), [
    (_llama_config(**{**_GEMMA3, "attention_softcap": 20.0}), "attention_softcap=20.0"),  # Gemma 3 would ignore it
    (_llama_config(**{**_GEMMA3, "norm_weight_offset": 0.0}), "norm_weight_offset=0.0"),
    (_llama_config(**{**_GEMMA3, "attention_scale": 0.3}), "query_pre_attn_scalar='none'"),
    (_llama_config(norm_position="post_sublayer", qk_norm=True), "qk_norm_scope='head'"),
], ids=["gemma3-attention-softcap", "gemma3-offset", "gemma3-scale", "olmo2-per-head-qk-norm"])
def test_export_refuses_what_gemma3_and_olmo2_lack(cfg, named):
    arch = "gemma3_text" if cfg.norm.position == "sandwich" else "olmo2"
    with pytest.raises(ValueError, match=re.escape(named)):
        check_compatible(cfg, arch)


def test_gemma3_1b_published_config_maps_both_ways():
    """Gemma 3 1B's published config.json values (no download): 5 windowed blocks to 1 global, two RoPE bases; the
    model built from it on the meta device has our parameter count, and the config comes back."""
    from meshformer.checkpointing.hf import config_to_hf
    from meshformer.model.flops import count_params

    published = transformers.Gemma3TextConfig(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6, sliding_window=512,
        sliding_window_pattern=6, query_pre_attn_scalar=256, rope_theta=1e6, rope_local_base_freq=10000.0)
    cfg = config_from_hf(published)
    assert (cfg.attention.window, cfg.rope.theta, cfg.rope.local_theta) == (512, 1e6, 1e4)
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert [cfg.window(i) for i in range(6)] == [512] * 5 + [None] and cfg.attention.scale is None
    with torch.device("meta"):
        hf = transformers.Gemma3ForCausalLM(published)
    assert count_params(cfg)["total"] == sum(p.numel() for p in hf.parameters())  # 999,885,952
    back = config_to_hf(cfg)
    assert back.layer_types == published.layer_types and back.rope_parameters == published.rope_parameters
