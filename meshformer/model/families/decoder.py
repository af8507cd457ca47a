"""Decoder-only (GPT, Llama): one causal stack; next-token prediction.

Name maps: Megatron-Core GPTModel (checkpointing/megatron.py); Hugging Face's live with each architecture
(meshformer/models/<model_type>/).
"""

from __future__ import annotations

from meshformer.model.families.common import transformer_family
from meshformer.model.families.naming import MegatronNames
from meshformer.model.families.spec import Stack
from meshformer.model.flops import decoder_flops

SPEC = transformer_family(
    name="decoder",
    stacks=(Stack("decoder", causal=True, count=lambda cfg: cfg.n_layers, depth_key="model.n_layers"),),
    objectives=("causal",),
    training_flops=decoder_flops,
    name_maps={},  # Hugging Face's: each architecture's folder, meshformer/models/<model_type>/
    megatron=MegatronNames(
        model="GPTModel", layers="decoder_layers", embedding="tok_embeddings.weight",
        positions="pos_embeddings.weight", final_norm="decoder_norm", output="output.weight",
        attn_norm="attn_norm", ffn_norm="ffn_norm", qkv=("attn.q_proj", "attn.k_proj", "attn.v_proj"),
        q_norm="attn.q_norm", k_norm="attn.k_norm", attn_out="attn.o_proj", gate="ffn.gate_proj",
        up="ffn.up_proj", down="ffn.down_proj", moe="ffn",
    ),
)
