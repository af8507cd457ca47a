"""Conversions: sharded checkpoint <-> safetensors, Hugging Face import/export (GPT-2, BERT, Llama, T5, Mistral,
Qwen2, Qwen3, Mixtral, Qwen3-MoE)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import assert_bitwise
from safetensors.torch import load_file

from meshformer.checkpointing import (
    Checkpointable,
    CheckpointManager,
    ConversionError,
    SchedulerState,
    TrainState,
    dcp_io,
    read_checkpoint_model,
    write_weights_checkpoint,
)
from meshformer.checkpointing.directory import step_dir_name
from meshformer.checkpointing.weights import read_weights, write_weights
from meshformer.cli import main
from meshformer.config import AttentionConfig, FfnConfig, ModelConfig, MoeConfig, NormConfig, load_config
from meshformer.model import Transformer

transformers = pytest.importorskip("transformers")


def _training_checkpoint(tmp_path: Path) -> tuple[Path, Transformer]:
    """A checkpoint as the trainer writes it (model, AdamW state, scheduler), made without a training run."""
    cfg = load_config(None, ["model.d_model=32", "model.attention.n_heads=2", "model.n_layers=2", "model.ffn.d_ff=64",
                             "model.vocab_size=128", "checkpoint.interval=1", f'checkpoint.dir="{tmp_path / "ck"}"'])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 128, (2, 8))).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    run = Checkpointable(TrainState(step=1), [model], optimizer, {"scheduler": SchedulerState(scheduler)}, cfg)
    manager = CheckpointManager.from_config(cfg, tmp_path)
    manager.save(run, blocking=True)
    manager.close()
    return tmp_path / "ck", model


def test_checkpoint_to_safetensors_and_back(tmp_path):
    root, model = _training_checkpoint(tmp_path)
    main(["convert", "to-safetensors", str(root), str(tmp_path / "weights")])
    cfg, state = read_weights(tmp_path / "weights")
    assert cfg == model.cfg
    assert_bitwise(state, {k: v.detach() for k, v in model.state_dict().items()})

    main(["convert", "to-checkpoint", str(tmp_path / "weights"), str(tmp_path / "ck2")])
    cfg2, state2 = read_checkpoint_model(tmp_path / "ck2")
    assert cfg2 == cfg and (tmp_path / "ck2" / step_dir_name(0) / "manifest.json").is_file()
    assert_bitwise(state2, state)


def test_reading_a_checkpoint_tensor_by_tensor_unpickles_its_index_once(tmp_path, monkeypatch):
    root, model = _training_checkpoint(tmp_path)
    loads = []
    unpickle = dcp_io._MetadataUnpickler.load
    monkeypatch.setattr(dcp_io._MetadataUnpickler, "load", lambda self: loads.append(1) or unpickle(self))
    _, state = read_checkpoint_model(root)
    assert_bitwise({k: state[k] for k in state}, {k: v.detach() for k, v in model.state_dict().items()})
    assert len(state) > 3 and len(loads) == 1


def test_weights_only_checkpoints_always_start_at_step_0(tmp_path):
    """A weights-only checkpoint carries no step: no --step option that would promise a resume at step N."""
    _, model = _training_checkpoint(tmp_path)
    write_weights(model.state_dict(), model.cfg, tmp_path / "weights")
    with pytest.raises(SystemExit):
        main(["convert", "to-checkpoint", str(tmp_path / "weights"), str(tmp_path / "ck2"), "--step", "5"])
    assert not (tmp_path / "ck2").exists()
    with pytest.raises(TypeError):
        write_weights_checkpoint(model.state_dict(), model.cfg, tmp_path / "ck3", step=5)
    folder = write_weights_checkpoint(model.state_dict(), model.cfg, tmp_path / "ck3")
    assert folder.name == step_dir_name(0)


def test_verify_reports_corruption(tmp_path, capsys):
    root, _ = _training_checkpoint(tmp_path)
    main(["convert", "verify", str(root)])
    shard = root / step_dir_name(1) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    with pytest.raises(SystemExit, match="failed verification"):
        main(["convert", "verify", str(root)])
    assert "CORRUPT" in capsys.readouterr().out


# ----------------------------------------------------------------------------- Hugging Face


def _nonzero_norms(model: torch.nn.Module) -> None:
    """Zero-centred norms (1 + weight) start at zero: nonzero ones show where each lands."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)


def _hf_model(arch: str):
    torch.manual_seed(0)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32,
                                                                     n_layer=2, n_head=4))
    elif arch == "bert":
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32))
        with torch.no_grad():  # we fold token type 0 into the positions; a zero table makes the round trip exact
            model.bert.embeddings.token_type_embeddings.weight.zero_()
    elif arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))
    elif arch == "llama3":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, rope_parameters={
                "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}))
    elif arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, sliding_window=5))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True))
    elif arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=32, use_sliding_window=True,
            sliding_window=6, max_window_layers=0))
    elif arch == "mixtral":  # a window shorter than the 12-token test sequences
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
            sliding_window=6))
    elif arch == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            mlp_only_layers=[0], max_position_embeddings=32))
    elif arch == "olmoe":
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
            pad_token_id=None, eos_token_id=None))
    elif arch == "olmo2":
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, pad_token_id=None, eos_token_id=None))
    elif arch == "olmo3":  # a windowed block (window 5 < 12 tokens, its own RoPE base) then a global one
        model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, sliding_window=5, pad_token_id=None, eos_token_id=None,
            layer_types=["sliding_attention", "full_attention"], rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 5e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    elif arch == "gpt_oss":  # sinks, biases, a windowed block (window 5 < 12 tokens) then a global one, yarn
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
            max_position_embeddings=32, pad_token_id=None, eos_token_id=None, bos_token_id=None))
        with torch.no_grad():  # the experts' biases start at zero: nonzero ones show where each lands
            for name, param in model.named_parameters():
                if name.endswith("_bias"):
                    param.normal_(0.0, 0.5)
    elif arch == "deepseek_v3":  # mla, block 0 dense, grouped sigmoid routing, a shared expert, a selection bias
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
            first_k_dense_replace=1, max_position_embeddings=32, pad_token_id=None, eos_token_id=None,
            bos_token_id=None))
        with torch.no_grad():
            model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    elif arch == "deepseek_v2":  # mla, block 0 dense, softmax routing in groups scored by their best expert
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
            vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, topk_method="group_limited_greedy", n_group=2,
            topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=32,
            pad_token_id=None, eos_token_id=None, bos_token_id=None))
    elif arch == "glm4_moe":  # partial rotary, q/k/v biases, QK-norm, block 0 dense, grouped sigmoid routing
        model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4, n_group=2, topk_group=1,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, attention_bias=True,
            use_qk_norm=True, num_nextn_predict_layers=0, max_position_embeddings=32, pad_token_id=None,
            eos_token_id=None, bos_token_id=None))
        with torch.no_grad():
            model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    elif arch == "qwen3_next":  # a Gated DeltaNet block, then a gated attention block; MoE with a gated shared expert
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            max_position_embeddings=32))
        _nonzero_norms(model)
    elif arch == "qwen3_5_text":  # a Gated DeltaNet block (split projections), then a gated attention block
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            max_position_embeddings=32))
        _nonzero_norms(model)
    elif arch == "qwen3_5_moe_text":  # the same two blocks, each with 4 experts and a gated shared expert
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            max_position_embeddings=32))
        with torch.no_grad():  # nonzero norms show where each lands; transformers leaves stacked experts unset
            for name, param in model.named_parameters():
                if "norm" in name or "experts" in name:
                    param.normal_(0.0, 0.5 if "norm" in name else 0.1)
    elif arch == "kimi_linear":  # a KDA block, then latent attention without RoPE; block 1 with 4 experts
        model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=6, num_local_experts=4, num_experts_per_tok=2, linear_num_heads=2,
            linear_head_dim=8, layer_types=["linear_attention", "full_attention"], max_position_embeddings=32,
            pad_token_id=None, eos_token_id=None, bos_token_id=None))
        with torch.no_grad():  # transformers leaves A_log and dt_bias for its init, the stacked experts unset
            for name, param in model.named_parameters():
                if "experts" in name or name.endswith(("A_log", "dt_bias")):
                    param.normal_(0.0, 0.1)
            model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    elif arch in ("gemma2", "gemma3"):  # 4 blocks, every 2nd global; a window shorter than the sequences
        config = transformers.Gemma2Config if arch == "gemma2" else transformers.Gemma3TextConfig
        model = (transformers.Gemma2ForCausalLM if arch == "gemma2" else transformers.Gemma3ForCausalLM)(config(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=32, sliding_window=5, layer_types=[
                "sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=8, final_logit_softcapping=3.0))
    else:
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            feed_forward_proj="gated-silu"))
        assert model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.abs().min() > 0
    return model.eval()


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama", "t5", "llama3", "mistral", "qwen2", "qwen3", "mixtral",
                                  "qwen3_moe", "olmoe", "olmo2", "olmo3", "gemma2", "gemma3", "gpt_oss",
                                  "deepseek_v3", "deepseek_v2", "glm4_moe", "qwen3_next", "qwen3_5_text",
                                  "qwen3_5_moe_text", "kimi_linear"])
def test_hugging_face_import_export(arch, tmp_path):
    original = tmp_path / "hf"
    _hf_model(arch).save_pretrained(str(original))
    main(["convert", "import-hf", str(original), str(tmp_path / "ours")])
    main(["convert", "export-hf", str(tmp_path / "ours"), str(tmp_path / "exported")])
    if arch == "llama3":  # export writes the rotary scaling back
        hf_config = json.loads((tmp_path / "exported" / "config.json").read_text())
        assert hf_config["rope_parameters"]["rope_type"] == "llama3"
    # import -> export is bitwise, tensor for tensor
    assert_bitwise(load_file(str(tmp_path / "exported" / "model.safetensors")),
                   load_file(str(original / "model.safetensors")))
    # the exported folder loads in transformers and computes our logits
    cls = {"gpt2": transformers.GPT2LMHeadModel, "bert": transformers.BertForMaskedLM,
           "llama": transformers.LlamaForCausalLM, "t5": transformers.T5ForConditionalGeneration,
           "llama3": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
           "mixtral": transformers.MixtralForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
           "olmoe": transformers.OlmoeForCausalLM, "olmo2": transformers.Olmo2ForCausalLM,
           "olmo3": transformers.Olmo3ForCausalLM, "gpt_oss": transformers.GptOssForCausalLM,
           "gemma2": transformers.Gemma2ForCausalLM, "gemma3": transformers.Gemma3ForCausalLM,
           "deepseek_v3": transformers.DeepseekV3ForCausalLM,
           "glm4_moe": transformers.Glm4MoeForCausalLM,
           "deepseek_v2": transformers.DeepseekV2ForCausalLM,
           "qwen3_next": transformers.Qwen3NextForCausalLM,
           "qwen3_5_text": transformers.Qwen3_5ForCausalLM,
           "qwen3_5_moe_text": transformers.Qwen3_5MoeForCausalLM,
           "kimi_linear": transformers.KimiLinearForCausalLM}[arch]
    hf_model = cls.from_pretrained(str(tmp_path / "exported")).eval()
    cfg, state = read_weights(tmp_path / "ours")
    ours = Transformer(cfg).eval()
    ours.load_state_dict(state)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if arch == "t5":
            target = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(2))
            expected = hf_model(input_ids=ids, decoder_input_ids=target).logits
            got = ours(ids, decoder_input_ids=target)
        else:
            expected, got = hf_model(input_ids=ids).logits, ours(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_hugging_face_errors_name_the_mismatch(tmp_path):
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, feed_forward_proj="gated-gelu"))
    model.save_pretrained(str(tmp_path / "t5"))
    with pytest.raises(SystemExit, match="gated-gelu"):
        main(["convert", "import-hf", str(tmp_path / "t5"), str(tmp_path / "out")])

    from meshformer.checkpointing.hf_folder import export_hf
    from meshformer.checkpointing.weights import write_weights

    cfg = ModelConfig(family="decoder", vocab_size=64, d_model=32, n_layers=1, position="alibi",
                      attention=AttentionConfig(n_heads=4), ffn=FfnConfig(d_ff=64))
    write_weights(Transformer(cfg).state_dict(), cfg, tmp_path / "alibi")
    with pytest.raises(SystemExit, match="no Hugging Face architecture matches"):
        main(["convert", "export-hf", str(tmp_path / "alibi"), str(tmp_path / "out2")])
    with pytest.raises(ConversionError, match="position='alibi'"):
        export_hf(Transformer(cfg).state_dict(), cfg, tmp_path / "out3", arch="gpt2")


def test_quantized_gpt_oss_folder_is_refused_naming_the_fix(tmp_path):
    """A folder holding the Hub's MXFP4 experts (gate_up_proj_blocks / _scales instead of gate_up_proj) but no
    quantization_config naming them: one line saying to add it, nothing written."""
    from helpers.convert import mxfp4_experts

    folder = tmp_path / "hf"
    _hf_model("gpt_oss").save_pretrained(str(folder))
    mxfp4_experts(folder)
    with pytest.raises(SystemExit, match=r"_(blocks|scales): the experts are stored quantized .*quant_method.*mxfp4"):
        main(["convert", "import-hf", str(folder), str(tmp_path / "ours")])
    assert not (tmp_path / "ours").exists()


def test_export_refuses_a_nonzero_expert_selection_bias(tmp_path):
    """DeepSeek-V3's selection bias has no place in Mixtral / Qwen3-MoE: refused by name, nothing written."""
    from meshformer.checkpointing.hf_folder import export_hf

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, position="rope", bias=False,
                      attention=AttentionConfig(n_heads=4), ffn=FfnConfig(d_ff=32, activation="swiglu"),
                      norm=NormConfig(kind="rmsnorm"), moe=MoeConfig(n_experts=4))
    state = dict(Transformer(cfg).state_dict())
    state["decoder_layers.0.ffn.router.expert_bias"] = torch.tensor([0.0, 0.5, 0.0, -0.5])
    with pytest.raises(ConversionError, match=r"decoder_layers\.0\.ffn\.router\.expert_bias is nonzero"):
        export_hf(state, cfg, tmp_path / "out", arch="mixtral")
    assert not (tmp_path / "out").exists()
    state["decoder_layers.0.ffn.router.expert_bias"] = torch.zeros(4)  # never trained with bias balancing: fine
    export_hf(state, cfg, tmp_path / "out", arch="mixtral")


def test_qwen3_5_multimodal_folder_imports_its_language_model(tmp_path):
    """A Qwen3_5ForConditionalGeneration folder (model_type qwen3_5, text_config qwen3_5_text) imports as the
    language model: the vision tower is left unread, and the export computes the original's text logits."""
    text = transformers.Qwen3_5TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        max_position_embeddings=32)
    vision = transformers.Qwen3_5VisionConfig(depth=1, hidden_size=16, num_heads=2, intermediate_size=16,
                                              out_hidden_size=32)
    torch.manual_seed(0)
    original = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision.to_dict())).eval()
    with torch.no_grad():
        for name, param in original.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    original.save_pretrained(str(tmp_path / "hf"))
    main(["convert", "import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")])
    main(["convert", "export-hf", str(tmp_path / "ours"), str(tmp_path / "exported")])
    exported = transformers.Qwen3_5ForCausalLM.from_pretrained(str(tmp_path / "exported")).eval()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = original(input_ids=ids).logits, exported(input_ids=ids).logits
    assert expected.std() > 0.1
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
