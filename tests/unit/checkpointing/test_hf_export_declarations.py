"""What a Hugging Face export may write comes from declarations (checkpointing/hf_adapter.py's `undeclared_options`):
an option set away from its default that no shared declaration, kind or adapter lists is refused, not left out."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshformer.checkpointing.hf import config_to_hf, incompatibilities, infer_arch, to_hf_state_dict
from meshformer.checkpointing.hf_adapter import adapters, undeclared_options
from meshformer.config import AttentionConfig, FfnConfig, MlaConfig, ModelConfig, MoeConfig, NormConfig
from meshformer.model import Transformer
from meshformer.model.config import ResidualConfig


def _llama() -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=32, n_layers=2, position="rope", bias=False, tie_embeddings=False,
                       max_seq_len=16, attention=AttentionConfig(n_heads=4),
                       ffn=FfnConfig(d_ff=64, activation="swiglu"), norm=NormConfig(kind="rmsnorm"))


def test_an_undeclared_option_is_refused_by_every_export():
    # hyper-connections change every residual; only DeepSeek-V4's adapter declares residual.kind, so no other may
    # write the model
    cfg = replace(_llama(), residual=ResidualConfig(kind="mhc", streams=2))
    assert infer_arch(_llama()) == "llama"
    assert "residual.kind='mhc'" not in undeclared_options(cfg, adapters()["deepseek_v4"])
    for arch in set(adapters()) - {"deepseek_v4"}:
        refused = f"residual.kind='mhc' (no declaration lets a {arch} export write it)"
        assert refused in incompatibilities(cfg, arch)
    with pytest.raises(ValueError, match=r"no Hugging Face architecture matches this config"):
        infer_arch(cfg)
    with pytest.raises(ValueError, match=r"cannot be expressed as llama: .*residual\.kind='mhc'"):
        config_to_hf(cfg, "llama")
    with pytest.raises(ValueError, match=r"residual\.kind='mhc'"):
        to_hf_state_dict(Transformer(cfg), "llama")


def test_an_option_is_written_only_where_declared():
    # Mistral 4 declares the Llama-4 query scale; DeepSeek-V3's config has no key for it
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, position="rope", bias=False, tie_embeddings=False,
                      max_seq_len=16, layer_types=["mla"], attention=AttentionConfig(n_heads=4),
                      ffn=FfnConfig(d_ff=64, activation="swiglu"), norm=NormConfig(kind="rmsnorm"),
                      mla=MlaConfig(query_scale_beta=0.1), moe=MoeConfig(n_experts=4, router_score="sigmoid"))
    assert "mla.query_scale_beta=0.1" in undeclared_options(cfg, adapters()["deepseek_v3"])
    assert "mla.query_scale_beta=0.1" not in undeclared_options(cfg, adapters()["mistral4"])


def test_a_kind_is_written_only_by_adapters_that_declare_it():
    cfg = replace(_llama(), layer_types=["mla"])
    assert undeclared_options(cfg, adapters()["llama"]) == ["kind 'mla'"]
    assert "kind 'mla'" not in undeclared_options(cfg, adapters()["deepseek_v3"])


def test_unread_tables_and_neutral_options_need_no_declaration():
    # MLA sizes without an MLA block compute nothing; dropout and backends do not change the function
    cfg = replace(_llama(), dropout=0.1, mla=MlaConfig(kv_lora_rank=16),
                  attention=AttentionConfig(n_heads=4, backend="math"))
    assert undeclared_options(cfg, adapters()["llama"]) == []
