"""Tiny random-initialised Hugging Face models (built from their config classes, nothing downloaded), saved as
folders with the bundled tokenizer beside them: what `checkpoint.init_from` and `generate` tests start from."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from meshformer.data.tokenizer import BUNDLED_DIR

VOCAB = 4096  # the bundled tokenizer's size
SHARED = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=None,
              pad_token_id=0)
ARCHS: dict[str, dict[str, Any]] = {
    # Llama 3.1-style rotary scaling, untied head
    "llama": dict(config="LlamaConfig", model="LlamaForCausalLM", tie_word_embeddings=False,
                  rope_parameters={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                   "rope_theta": 10000.0}),
    # no sliding window: the function of a Llama, so only a run's note says to export it as Mistral again
    "mistral": dict(config="MistralConfig", model="MistralForCausalLM", tie_word_embeddings=False,
                    sliding_window=None),
    # Q/K/V biases only
    "qwen2": dict(config="Qwen2Config", model="Qwen2ForCausalLM", tie_word_embeddings=False),
    # head_dim != hidden_size / heads, QK-norm, tied embeddings
    "qwen3": dict(config="Qwen3Config", model="Qwen3ForCausalLM", tie_word_embeddings=True, head_dim=16),
    # post-sublayer norms, QK-norm over the whole projections
    "olmo2": dict(config="Olmo2Config", model="Olmo2ForCausalLM", tie_word_embeddings=False),
    # OLMo 2's blocks: a windowed block (window 4, RoPE base 10k) then a global one (base 500k)
    "olmo3": dict(config="Olmo3Config", model="Olmo3ForCausalLM", tie_word_embeddings=False, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"], rope_parameters={
                      "full_attention": {"rope_type": "default", "rope_theta": 5e5},
                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # a windowed block (window 4, RoPE base 10k) then a global one (base 1M), sandwich norms, final-logit soft-capping
    "gemma3": dict(config="Gemma3TextConfig", model="Gemma3ForCausalLM", tie_word_embeddings=True, head_dim=16,
                   sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                   final_logit_softcapping=30.0),
    # sinks, q/k/v/o biases, a windowed block (window 4) then a global one, untruncated yarn; 4 biased experts of
    # width intermediate_size, top-2, the clamped SwiGLU
    "gpt_oss": dict(config="GptOssConfig", model="GptOssForCausalLM", tie_word_embeddings=False, head_dim=8,
                    sliding_window=4, num_local_experts=4, num_experts_per_tok=2, rope_parameters={
                        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}),
    # a Gated DeltaNet block then a gated attention block rotating a quarter of each head; 4 experts of width 16,
    # top-2, with a gated shared expert of width 32
    "qwen3_next": dict(config="Qwen3NextConfig", model="Qwen3NextForCausalLM", tie_word_embeddings=False,
                       head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32),
    # Qwen3.5's language model: a Gated DeltaNet block (split projections) then a gated attention block rotating a
    # quarter of each head through the multimodal rotary embedding; dense blocks
    "qwen3_5_text": dict(config="Qwen3_5TextConfig", model="Qwen3_5ForCausalLM", tie_word_embeddings=False,
                         head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8),
    # Qwen3.5-MoE's language model: the same blocks, every feed-forward 4 experts of width 16, top-2, with a gated
    # shared expert of width 32
    "qwen3_5_moe_text": dict(config="Qwen3_5MoeTextConfig", model="Qwen3_5MoeForCausalLM", tie_word_embeddings=False,
                             head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32),
    # Kimi Linear: a KDA block (2 heads of width 8) then latent attention without RoPE; block 0 dense, then 4
    # experts in 2 groups (1 kept per token), top-2 sigmoid scores, one shared expert
    "kimi_linear": dict(config="KimiLinearConfig", model="KimiLinearForCausalLM", tie_word_embeddings=False,
                        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, moe_intermediate_size=32, num_local_experts=4, n_group=2,
                        topk_group=1, num_experts_per_tok=2, n_shared_experts=1, linear_num_heads=2,
                        linear_head_dim=8, layer_types=["linear_attention", "full_attention"]),
    # Nemotron-H: one mixer per layer (Mamba-2 of 4 heads of width 8 in 2 groups, attention without positions,
    # squared-ReLU MLP), a chunk (4) shorter than the prompts
    "nemotron_h": dict(config="NemotronHConfig", model="NemotronHForCausalLM", tie_word_embeddings=False,
                       num_key_value_heads=2, head_dim=8, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
                       n_groups=2, chunk_size=4, layers_block_type=["linear_attention", "moe", "full_attention",
                                                                    "mlp"],
                       # the E layer: 4 squared-ReLU experts in 2 groups (1 kept per token), top-2 sigmoid scores
                       # scaled by 2.5, a shared MLP as wide as 2 experts
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=32, n_group=2, topk_group=1, routed_scaling_factor=2.5),
    # a Gated DeltaNet block (separate projections, beta doubled, pre-norm) then an OLMo 3 attention block
    # (post-sub-layer norms); value width = key width, as transformers' in-memory q/k/v convolution split assumes
    "olmo_hybrid": dict(config="OlmoHybridConfig", model="OlmoHybridForCausalLM", tie_word_embeddings=False,
                        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=4),
    # 4 experts of width intermediate_size, top-2
    "mixtral": dict(config="MixtralConfig", model="MixtralForCausalLM", tie_word_embeddings=False,
                    num_local_experts=4, num_experts_per_tok=2),
    # 4 experts of width intermediate_size, top-2 not renormalised, QK-norm over the whole projections
    "olmoe": dict(config="OlmoeConfig", model="OlmoeForCausalLM", tie_word_embeddings=False, num_experts=4,
                  num_experts_per_tok=2),
    # multi-head latent attention (low-rank queries, interleaved RoPE, yarn with mscale), block 0 dense, then 4
    # experts in 2 groups (1 kept per token), top-2 sigmoid scores scaled by 2.5, one shared expert
    "deepseek_v3": dict(config="DeepseekV3Config", model="DeepseekV3ForCausalLM", tie_word_embeddings=False,
                        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, moe_intermediate_size=32, n_routed_experts=4, n_group=2,
                        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 16, "mscale": 1.0,
                                         "mscale_all_dim": 1.0}),
    # DeepSeek-V2: multi-head latent attention (low-rank queries, interleaved RoPE), block 0 dense, then 8 experts in
    # 4 groups scored by their best expert (2 kept per token), top-2 softmax scores scaled by 2, one shared expert
    "deepseek_v2": dict(config="DeepseekV2Config", model="DeepseekV2ForCausalLM", tie_word_embeddings=False,
                        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, moe_intermediate_size=32, n_routed_experts=8,
                        topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.0),
    # GLM-4.5: grouped-query heads of width 16 rotating their first half, q/k/v biases, per-head QK-norm, block 0
    # dense, then 4 experts in 2 groups (1 kept per token), top-2 sigmoid scores scaled by 2.5, one shared expert
    "glm4_moe": dict(config="Glm4MoeConfig", model="Glm4MoeForCausalLM", tie_word_embeddings=False, head_dim=16,
                     attention_bias=True, use_qk_norm=True, moe_intermediate_size=32, n_routed_experts=4, n_group=2,
                     topk_group=1, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                     routed_scaling_factor=2.5, num_nextn_predict_layers=0,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # Gemma 2: a windowed block then a global one, attention and final-logit soft-capping
    "gemma2": dict(config="Gemma2Config", model="Gemma2ForCausalLM", tie_word_embeddings=True, head_dim=16,
                   sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16),
    # 4 experts of width 32, top-2, QK-norm
    "qwen3_moe": dict(config="Qwen3MoeConfig", model="Qwen3MoeForCausalLM", tie_word_embeddings=False, head_dim=16,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    # the families other than a Llama-style decoder, with their own config keys (SHARED's names do not apply)
    "gpt2": dict(config="GPT2Config", model="GPT2LMHeadModel", shared=False, vocab_size=VOCAB, n_positions=64,
                 n_embd=32, n_layer=2, n_head=4),
    "bert": dict(config="BertConfig", model="BertForMaskedLM", shared=False, vocab_size=VOCAB, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64),
    "t5": dict(config="T5Config", model="T5ForConditionalGeneration", shared=False, vocab_size=VOCAB, d_model=32,
               d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-silu"),
    # a Qwen3-MoE whose every block is dense (mlp_only_layers): imported with experts that no block uses
    # DeepSeek-V3.2: DeepSeek-V3's blocks (yarn, block 0 dense, grouped sigmoid routing) attending to the 6 keys of
    # each query its lightning indexer (8 heads, half-split rotary pairs) scores highest
    "deepseek_v32": dict(config="DeepseekV32Config", model="DeepseekV32ForCausalLM", tie_word_embeddings=False,
                         num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                         qk_rope_head_dim=4, v_head_dim=8, moe_intermediate_size=32, n_routed_experts=4, n_group=2,
                         topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                         index_n_heads=8, index_head_dim=8, index_topk=6,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 16, "mscale": 1.0,
                                          "mscale_all_dim": 1.0}),
    # GLM-5: the same shape, its indexer rotating interleaved pairs, no expert groups
    "glm_moe_dsa": dict(config="GlmMoeDsaConfig", model="GlmMoeDsaForCausalLM", tie_word_embeddings=False,
                        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, moe_intermediate_size=32, n_routed_experts=4,
                        num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5, index_n_heads=8,
                        index_head_dim=8, index_topk=6),
    # GLM-5 whose blocks 1 and 2 reuse block 0's key selection (indexer_types "shared"; no indexer of their own)
    "glm_moe_dsa_shared": dict(config="GlmMoeDsaConfig", model="GlmMoeDsaForCausalLM", tie_word_embeddings=False,
                               num_hidden_layers=4, indexer_types=["full", "shared", "shared", "full"],
                               num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                               qk_rope_head_dim=4, v_head_dim=8, moe_intermediate_size=32, n_routed_experts=4,
                               num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                               index_n_heads=8, index_head_dim=8, index_topk=6),
    # Mistral 4: DeepSeek-V3's latent attention with Llama 4's query scaling past position 4 (so a prompt crosses
    # several steps); block 0 dense, then 8 experts in 2 groups (1 kept per token), top-2 softmax scores renormalised
    # and scaled by 1.5, one shared expert
    "mistral4": dict(config="Mistral4Config", model="Mistral4ForCausalLM", tie_word_embeddings=False,
                     num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                     v_head_dim=8, moe_intermediate_size=32, n_routed_experts=8, n_group=2, topk_group=1,
                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 4, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "llama_4_scaling_beta": 0.5}),
    # DeepSeek-V4: a csa block (entries of 2 tokens, top-2) then an hca block (entries of 4), window 4, one shared
    # key/value head; hash routing then learned routing over 4 experts, top-2, one shared expert; 2 mHC streams
    "deepseek_v4": dict(config="DeepseekV4Config", model="DeepseekV4ForCausalLM", tie_word_embeddings=False,
                        num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.25, q_lora_rank=16, o_groups=2,
                        o_lora_rank=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                        hc_mult=2, sliding_window=4, index_n_heads=2, index_head_dim=8, index_topk=2,
                        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                        mlp_layer_types=["hash_moe", "moe"]),
    "qwen3_moe_dense": dict(config="Qwen3MoeConfig", model="Qwen3MoeForCausalLM", tie_word_embeddings=False,
                            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            mlp_only_layers=[0, 1]),
}


# model_type -> the entry of ARCHS that builds one (where the names differ)
MODEL_TYPES = {"gemma3_text": "gemma3"}


def arch_for(model_type: str) -> str:
    """The entry of ARCHS building a model of a registered architecture (tests parametrised over the registry)."""
    return MODEL_TYPES.get(model_type, model_type)


def hf_model(arch: str, seed: int = 0) -> Any:
    import transformers

    spec = dict(ARCHS[arch])
    config_class, model_class = spec.pop("config"), spec.pop("model")
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**({**SHARED, **spec} if spec.pop("shared", True) else spec))
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # sharper than the init's 0.02, so greedy choices are far from ties
        for param in model.parameters():
            if param.ndim > 1:
                param.normal_(0.0, 0.15)
    return model


def hf_folder(arch: str, folder: Path, seed: int = 0) -> tuple[Any, Path]:
    """(the HF model, its save_pretrained folder holding the bundled tokenizer as tokenizer.json)."""
    model = hf_model(arch, seed)
    model.save_pretrained(str(folder))
    shutil.copy(BUNDLED_DIR / "kjv-bpe-4k.json", folder / "tokenizer.json")
    return model, folder


def assert_batched_greedy_equals_generate(arch: str, new_tokens: int) -> None:
    """Left-padded prompts of 3, 9 and 6 tokens: meshformer's greedy decoding of the imported model, with and without
    its cache, equals transformers' `generate(do_sample=False)`, and the rows differ (none is one repeated)."""
    from meshformer.checkpointing.hf import from_hf_model
    from meshformer.model.generate import greedy_decode, pad_rows

    theirs = hf_model(arch)
    ours = from_hf_model(theirs).eval()
    generator = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, 4096, (n,), generator=generator).tolist() for n in (3, 9, 6)]
    ids, padding = pad_rows(rows, pad_id=0)
    expected = theirs.generate(input_ids=ids, attention_mask=padding.long(), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    for use_cache in (True, False):
        out = greedy_decode(ours, ids, new_tokens, prompt_padding=padding, use_cache=use_cache)
        assert out[:, ids.shape[1]:].tolist() == expected[:, ids.shape[1]:].tolist(), (arch, use_cache)
    assert len({tuple(row) for row in out[:, ids.shape[1]:].tolist()}) == 3  # rows of their own, not one repeated
