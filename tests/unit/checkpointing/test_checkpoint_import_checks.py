"""Imports never build a different function in silence: foreign config flags are mapped or refused, and
`import-megatron --heads` is checked against the model config that export writes beside the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from meshformer.checkpointing import ConversionError
from meshformer.checkpointing.hf_folder import export_hf, import_hf
from meshformer.checkpointing.megatron import export_megatron, import_megatron
from meshformer.checkpointing.weights import read_weights
from meshformer.cli import main
from meshformer.config import AttentionConfig, FfnConfig, ModelConfig, MoeConfig, NormConfig
from meshformer.model import Transformer

transformers = pytest.importorskip("transformers")


def _gpt2(**flags):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, **flags)
    return transformers.GPT2LMHeadModel(config).eval()


def _logits_agree(hf_model, folder) -> None:
    cfg, state = import_hf(folder)
    ours = Transformer(cfg).eval()
    ours.load_state_dict(state, strict=True)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf_model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_gpt2_without_attention_scaling_is_mapped_both_ways(tmp_path):
    hf_model = _gpt2(scale_attn_weights=False)
    hf_model.save_pretrained(str(tmp_path / "hf"))
    _logits_agree(hf_model, tmp_path / "hf")
    cfg, _ = import_hf(tmp_path / "hf")
    assert cfg.attention.scale == 1.0
    main(["convert", "import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")])
    main(["convert", "export-hf", str(tmp_path / "ours"), str(tmp_path / "back")])
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "back")).eval()
    assert back.config.scale_attn_weights is False
    _logits_agree(back, tmp_path / "hf")


def test_gpt2_upcast_attention_is_the_same_function(tmp_path):
    hf_model = _gpt2(reorder_and_upcast_attn=True)
    hf_model.save_pretrained(str(tmp_path / "hf"))
    _logits_agree(hf_model, tmp_path / "hf")


def test_yarn_without_truncation_is_mapped_both_ways(tmp_path):
    torch.manual_seed(0)
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
            "truncate": False}
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=64, rope_parameters=rope)).eval()
    hf_model.save_pretrained(str(tmp_path / "hf"))
    _logits_agree(hf_model, tmp_path / "hf")
    cfg, state = import_hf(tmp_path / "hf")
    assert cfg.rope.truncate is False
    export_hf(state, cfg, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"]["truncate"] is False


@pytest.mark.parametrize(("arch", "flags", "named"), [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention=True"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type='dynamic'"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                   "rope_theta": 10000.0, "mscale": 0.707, "mscale_all_dim": 0.707}},
     "rope_parameters.mscale=0.707"),
    ("llama", {"attention_bias": True, "mlp_bias": False}, "attention_bias=True with mlp_bias=False"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("bert", {"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
    ("bert", {"hidden_act": "tanh"}, "activation 'tanh'"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("mixtral", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6,
                                     "partial_rotary_factor": 0.5}}, "rope_parameters.partial_rotary_factor=0.5"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
     "sliding_window=4 with max_window_layers=1"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias=True"),
])
def test_flags_that_change_the_function_are_refused(arch, flags, named, tmp_path):
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=1, n_head=4, **flags)
        model = transformers.GPT2LMHeadModel(config)
    elif arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=32, **flags))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32, **flags))
    elif arch == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32, **flags))
    elif arch == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=32, **flags))
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32, **flags))
    model.save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(ConversionError) as info:
        import_hf(tmp_path / "hf")
    message = str(info.value)
    assert named in message and " — " in message and "\n" not in message


def test_trained_selection_bias_is_refused_on_export_with_its_own_fix(tmp_path):
    """No architecture holds the bias: the line must not send the user to another --arch."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, position="rope", bias=False, max_seq_len=16,
                      attention=AttentionConfig(n_heads=4), ffn=FfnConfig(d_ff=32, activation="swiglu"),
                      norm=NormConfig(kind="rmsnorm"), moe=MoeConfig(n_experts=4, experts_per_token=2))
    state = Transformer(cfg).state_dict()
    state["decoder_layers.0.ffn.router.expert_bias"] = torch.tensor([0.1, 0.0, 0.0, -0.1])
    with pytest.raises(ConversionError) as info:
        export_hf(state, cfg, tmp_path / "hf", "mixtral")
    line = info.value.one_line()
    assert "decoder_layers.0.ffn.router.expert_bias is nonzero" in line and "\n" not in line
    assert "--arch" not in line and line.count(" — ") == 1 and line.endswith("trained without bias balancing can be "
                                                                           "converted")
    assert not (tmp_path / "hf").exists()  # refused before anything is written


# ----------------------------------------------------------------------------- Megatron head count

_CFG = ModelConfig(family="decoder", vocab_size=100, d_model=32, n_layers=2, position="learned", max_seq_len=16,
                   attention=AttentionConfig(n_heads=4), ffn=FfnConfig(d_ff=64, activation="relu"))


def _export(tmp_path):
    torch.manual_seed(0)
    model = Transformer(_CFG)
    export_megatron(model.state_dict(), _CFG, tmp_path / "mcore", pad_vocab_multiple=128)
    return model


def test_megatron_import_reads_the_saved_config_without_heads(tmp_path):
    model = _export(tmp_path)
    main(["convert", "import-megatron", str(tmp_path / "mcore"), str(tmp_path / "back")])
    cfg, state = read_weights(tmp_path / "back")
    assert cfg == _CFG  # heads, true vocabulary and the non-gated activation come from the saved config
    imported = Transformer(cfg).eval()
    imported.load_state_dict(state, strict=True)
    ids = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        assert torch.equal(imported(ids), model.eval()(ids))


def test_megatron_heads_that_contradict_the_checkpoint_are_refused(tmp_path):
    _export(tmp_path)
    # 8 heads of width 4 fit the tensors too (multi-head q/k/v is 3 x d_model rows for any head count)
    with pytest.raises(ConversionError) as info:
        import_megatron(tmp_path / "mcore", n_heads=8)
    message = str(info.value)
    assert "--heads 8" in message and "n_heads=4" in message and " — " in message
    with pytest.raises(ConversionError, match=r"--activation 'gelu'.*activation='relu'"):
        import_megatron(tmp_path / "mcore", activation="gelu")


def test_megatron_saved_config_that_contradicts_the_tensors_is_refused(tmp_path):
    _export(tmp_path)
    file = tmp_path / "mcore" / "meshformer_model_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "d_ff": 128}))
    with pytest.raises(ConversionError, match=r"d_ff=128.*d_ff=64"):
        import_megatron(tmp_path / "mcore")


def test_megatron_without_saved_config_needs_heads(tmp_path):
    _export(tmp_path)
    (tmp_path / "mcore" / "meshformer_model_config.json").unlink()
    with pytest.raises(ConversionError, match=r"--heads"):
        import_megatron(tmp_path / "mcore")
    cfg, _ = import_megatron(tmp_path / "mcore", n_heads=4, vocab_size=100, activation="relu")
    assert cfg.attention.n_heads == 4
