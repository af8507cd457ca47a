"""T5 (T5ForConditionalGeneration): position="t5_relative" (one learned, bucketed bias per stack, which HF keeps in
block 0's SelfAttention), RMSNorm without bias, attention_scale=1.0, scale_output for the tied head; ReLU or
gated-SiLU feed-forward; gated-GELU (T5 v1.1) is refused. transformers 5 always ties T5's lm_head to `shared`
(tie_word_embeddings=False only turns off the output scaling), so lm_head is an alias.
"""

from __future__ import annotations

from typing import Any

from meshformer.checkpointing.hf_adapter import COMMON, PLAIN_KINDS, HFAdapter
from meshformer.config import AttentionConfig, FfnConfig, ModelConfig, NormConfig
from meshformer.model.families import get_family_spec
from meshformer.model.families.encoder_decoder import DECODER, ENCODER
from meshformer.model.families.naming import Rule, norm, params


def rules(cfg: ModelConfig) -> list[Rule]:
    """One relative-position bias per stack, kept in block 0's SelfAttention; lm_head and the stacks' embeddings
    are aliases of `shared`."""
    rules = [Rule(("tok_embeddings.weight",), "shared.weight"),
             *[Rule(("tok_embeddings.weight",), name, alias=True)
               for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")],
             *norm("encoder_norm", "encoder.final_layer_norm", cfg),
             *norm("decoder_norm", "decoder.final_layer_norm", cfg),
             *[Rule((f"{stack}_relative_bias.relative_bias.weight",),
                    f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
               for stack in ("encoder", "decoder")]]

    def attention(ours: str, theirs: str) -> list[Rule]:
        return [r for p in "qkvo" for r in params(f"{ours}.{p}_proj", f"{theirs}.{p}", ("weight",))]

    def ffn(ours: str, theirs: str) -> list[Rule]:
        if cfg.ffn.activation == "swiglu":
            names = {"gate_proj": "wi_0", "up_proj": "wi_1", "down_proj": "wo"}
        else:
            names = {"up_proj": "wi", "down_proj": "wo"}
        return [r for a, b in names.items() for r in params(f"{ours}.{a}", f"{theirs}.{b}", ("weight",))]

    for i in range(ENCODER.count(cfg)):
        o, t = f"encoder_layers.{i}", f"encoder.block.{i}.layer"
        rules += [*norm(f"{o}.attn_norm", f"{t}.0.layer_norm", cfg), *attention(f"{o}.attn", f"{t}.0.SelfAttention"),
                  *norm(f"{o}.ffn_norm", f"{t}.1.layer_norm", cfg), *ffn(f"{o}.ffn", f"{t}.1.DenseReluDense")]
    for i in range(DECODER.count(cfg)):
        o, t = f"decoder_layers.{i}", f"decoder.block.{i}.layer"
        rules += [*norm(f"{o}.attn_norm", f"{t}.0.layer_norm", cfg), *attention(f"{o}.attn", f"{t}.0.SelfAttention"),
                  *norm(f"{o}.cross_norm", f"{t}.1.layer_norm", cfg),
                  *attention(f"{o}.cross_attn", f"{t}.1.EncDecAttention"),
                  *norm(f"{o}.ffn_norm", f"{t}.2.layer_norm", cfg), *ffn(f"{o}.ffn", f"{t}.2.DenseReluDense")]
    return rules


def config_from_hf(c: Any) -> ModelConfig:
    if c.d_kv * c.num_heads != c.d_model:
        raise ValueError("t5: d_kv * num_heads must equal d_model")
    if c.dense_act_fn != ("silu" if c.is_gated_act else "relu"):
        raise ValueError(f"t5: feed_forward_proj {c.feed_forward_proj!r} unsupported (use 'relu' or 'gated-silu'; "
                         "T5 v1.1's gated-gelu gates with gelu_new, meshformer's swiglu with silu)")
    return ModelConfig(family="encoder_decoder", vocab_size=c.vocab_size, d_model=c.d_model,
                       n_encoder_layers=c.num_layers, n_decoder_layers=c.num_decoder_layers, position="t5_relative",
                       scale_output=c.scale_decoder_outputs, tie_embeddings=True, share_embeddings=True, bias=False,
                       dropout=c.dropout_rate,
                       attention=AttentionConfig(n_heads=c.num_heads, relative_buckets=c.relative_attention_num_buckets,
                                                 relative_max_distance=c.relative_attention_max_distance, scale=1.0),
                       ffn=FfnConfig(d_ff=c.d_ff, activation="swiglu" if c.is_gated_act else "relu"),
                       norm=NormConfig(kind="rmsnorm", eps=c.layer_norm_epsilon, position="pre", final=True))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    spec = get_family_spec(cfg.family)
    return transformers.T5Config(  # type: ignore[call-arg]  # tie_word_embeddings: a PretrainedConfig kwarg
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.attention_head_dim, d_ff=cfg.ffn.d_ff,
        num_layers=spec.depth(cfg, "encoder"), num_decoder_layers=spec.depth(cfg, "decoder"),
        num_heads=cfg.attention.n_heads, dropout_rate=cfg.dropout, layer_norm_epsilon=cfg.norm.eps,
        relative_attention_num_buckets=cfg.attention.relative_buckets,
        relative_attention_max_distance=cfg.attention.relative_max_distance,
        feed_forward_proj="gated-silu" if cfg.ffn.activation == "swiglu" else "relu",
        tie_word_embeddings=cfg.scale_output,  # T5Config turns this into scale_decoder_outputs
    )


ADAPTER = HFAdapter(
    model_type="t5", model_class="T5ForConditionalGeneration", config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    kinds=(*PLAIN_KINDS, "cross_attention"),
    expresses=("n_encoder_layers", "n_decoder_layers", "attention.relative_buckets", "attention.relative_max_distance"),
    requirements={**COMMON, "family": "encoder_decoder", "position": "t5_relative", "norm": "rmsnorm", "bias": False,
                  "tie_embeddings": True, "share_embeddings": True, "attention_scale": 1.0,
                  "scale_output": {False, True}, "activation": {"relu", "swiglu"}},
    rules=rules,
    size_keys=("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
               "relative_attention_num_buckets", "relative_attention_max_distance"),
    layer_keys=("num_layers", "num_decoder_layers"),
)
