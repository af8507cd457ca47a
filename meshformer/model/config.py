"""`ModelConfig`: the `[model]` section, everything a `Transformer` is built from.

It lives with the model, which reads no other section; `meshformer/config/` loads the whole tree from TOML,
validates it (against the family registry too) and re-exports this class. Which stacks a family has and how
deep they are is the family's business (`model/families/`), not this section's: `family` names a registered
family and the layer counts below are read by its stacks. Each block component reads its own table:
`[model.attention]`, `[model.mla]`, `[model.ffn]`, `[model.rope]`, `[model.norm]`, `[model.moe]`, `[model.init]`;
which kind of token mixer and channel mixer each block is comes from `layer_types` and `mlp_types`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from meshformer.model.config_compat import install_renamed, install_section_renames

# swiglu: down(silu(gate(x)) * up(x)) (Llama); geglu: the same gated by gelu's tanh approximation (Gemma);
# swiglu_clamped: gpt-oss's, gate clamped above and up both ways at swiglu_limit, then (up + 1) * gate *
# sigmoid(swiglu_alpha * gate); swiglu_limited: DeepSeek-V4's, plain swiglu of the gate clamped above and up both
# ways at swiglu_limit
Activation = Literal["relu", "relu2", "gelu", "gelu_tanh", "swiglu", "geglu", "swiglu_clamped", "swiglu_limited"]
GATED_ACTIVATIONS = ("swiglu", "geglu", "swiglu_clamped", "swiglu_limited")


@dataclass
class AttentionConfig:
    """The `[model.attention]` table: the attention of every block (its window: the sliding_attention blocks')."""

    n_heads: int = 4  # attention (query) heads
    n_kv_heads: int | None = None  # None: multi-head; 1: multi-query; else grouped-query
    head_dim: int | None = None  # width of each attention head; None: d_model // n_heads
    qk_norm: bool = False  # RMSNorm on the queries and keys before RoPE ...
    qk_norm_scope: Literal["head", "projection"] = "head"  # ... of each head (Qwen3, Gemma 3) or whole q/k (OLMo 2)
    qkv_bias: bool | None = None  # biases on the Q/K/V projections only; None: follows model.bias (Qwen2: true)
    dropout: float = 0.0  # dropout on attention probabilities (training only)
    # sliding window of the sliding_attention blocks (model.layer_types): keys with |i - j| < window
    window: int | None = None
    softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2)
    scale: float | None = None  # score multiplier; None: 1/sqrt(head_dim) (T5 folds it into init: 1.0)
    # Causal attention stays within each packed document (Llama 3's pretraining mask): from the batches' doc_ids
    document_mask: bool = False
    # auto: blockwise on a CPU where it applies (model/blockwise_attention.py), else SDPA; sdpa: torch picks;
    # flash | cudnn | efficient: that SDPA kernel first; blockwise: ours wherever it applies; math: explicit softmax
    backend: Literal["auto", "sdpa", "math", "flash", "cudnn", "efficient", "blockwise"] = "auto"
    # A learned logit per head in each softmax's denominator (gpt-oss): a query may attend to nothing. Every
    # backend takes it (SDPA kernels as one more key: model/attention.py sink_as_key)
    sinks: bool = False
    # A sigmoid gate per head on the attention output, read from the query projection (each head's q rows followed
    # by as many gate rows: Qwen3-Next): out = o_proj(attention * sigmoid(gate))
    output_gate: bool = False
    relative_buckets: int = 32  # t5_relative: learned bias buckets per stack (half per direction in the encoder)
    relative_max_distance: int = 128  # t5_relative: distances beyond this share the last bucket

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


@dataclass
class MlaConfig:
    """The `[model.mla]` table: multi-head latent attention (model/mla.py, DeepSeek-V2/V3) of the "mla" blocks; their
    query heads are attention.n_heads."""

    q_lora_rank: int | None = None  # queries through a rank-r down-projection, RMSNorm, up-projection; None: direct
    kv_lora_rank: int = 64  # width of the one compressed latent per token that keys and values expand from
    qk_nope_head_dim: int = 32  # per-head query and key width without positions
    qk_rope_head_dim: int = 16  # rotary width: per-head queries, one key shared by every head
    v_head_dim: int = 32  # per-head value width
    rope_interleave: bool = True  # rotary pairs (2i, 2i + 1) as DeepSeek's checkpoints lay them out; false: half-split
    # scaled RoPE (rope.scaling): scores multiplied by (0.1 * mscale_all_dim * ln(rope.factor) + 1)^2; 0: off
    mscale_all_dim: float = 0.0
    # Llama 4's length scaling (Mistral 4): the queries at position p multiplied by 1 + query_scale_beta *
    # ln(1 + floor(p / rope.original_max_seq_len)), sharper attention far past pretraining; 0: off
    query_scale_beta: float = 0.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class DsaConfig:
    """The `[model.dsa]` table: DeepSeek Sparse Attention (model/dsa.py; DeepSeek-V3.2, GLM-5) of the "dsa" blocks,
    multi-head latent attention ([model.mla]) whose queries each attend to the `topk` keys a lightning indexer scores
    highest."""

    n_heads: int = 4  # indexer heads (DeepSeek-V3.2: 64)
    head_dim: int = 32  # width of each indexer query head and of the one indexer key per token (128)
    topk: int = 64  # keys each query attends to (2048); at least the keys it sees: dense MLA
    rope_interleave: bool = False  # the indexer's rotary pairs (2i, 2i + 1) (GLM-5) or half-split (DeepSeek-V3.2)
    # the indexer's training: "sparse" attends to the selected keys, the indexer learning the main attention over
    # them; "warmup" attends densely and trains only the indexers (every other parameter frozen). The csa blocks'
    # indexers (model.compressed_attention.index_loss_weight > 0) take the same stage
    stage: Literal["sparse", "warmup"] = "sparse"
    loss_weight: float = 1.0  # the indexer's loss (KL to the main attention, a mean over target tokens) times this


@dataclass
class CompressedAttentionConfig:
    """The `[model.compressed_attention]` table: DeepSeek-V4's attention (model/compressed_attention.py) of the
    "sliding_mqa", "hca" and "csa" blocks: one shared key/value head over a sliding window, plus compressed entries
    (hca: every finished window of `compress_rate` tokens; csa: the indexer's top `index_topk` of the overlapping
    windows). Heads and their width come from [model.attention]; the blocks rotate their own queries and keys, so
    model.position is "none"."""

    q_rank: int = 64  # width of the normed query latent (DeepSeek-V4-Flash: 1024)
    rope_dim: int = 16  # each head's trailing channels rotary turns (64)
    window: int = 128  # tokens the sliding branch reads, the query's own included (128)
    o_groups: int = 2  # groups of heads the output projection reads separately (8)
    o_rank: int = 64  # width each group is projected to before the final projection (1024)
    rope_theta: float = 10000.0  # rotary base of the sliding-only blocks
    compress_theta: float = 160000.0  # rotary base of the compressed blocks and their compressors
    hca_rate: int = 128  # tokens per heavily compressed entry (hca blocks)
    csa_rate: int = 4  # tokens per compressed sparse entry (csa blocks; each reads 2 x rate tokens)
    index_heads: int = 4  # csa indexer query heads (64)
    index_dim: int = 32  # width of each indexer head and key (128)
    index_topk: int = 64  # compressed entries each csa query keeps (512)
    # the csa indexer's training objective (KL from the main attention's mass on the entries to the indexer's
    # distribution over them, a mean over target tokens) times this; 0: the indexer gets no gradient. Its stage
    # (warm-up: dense over every visible entry, only the indexers train) is model.dsa.stage
    index_loss_weight: float = 0.0
    # YaRN of the compressed (hca, csa) blocks' rotary, their compressors' and indexers' too; the sliding-only blocks
    # rotate unscaled. yarn_factor 1: unscaled (DeepSeek-V4: 16 from 65,536 positions; cos/sin stay unmultiplied)
    yarn_factor: float = 1.0
    yarn_original_max_seq_len: int = 0  # the pretraining context the factor stretches (65536)
    yarn_beta_fast: float = 32.0  # rotations in that context above which a frequency is kept
    yarn_beta_slow: float = 1.0  # rotations below which it is divided by the factor


@dataclass
class FfnConfig:
    """The `[model.ffn]` table: the dense feed-forward (channel mixer) of the "dense" blocks."""

    d_ff: int = 512  # feed-forward hidden width (of each gated half with a GLU activation)
    # feed-forward activation (relu2: relu(x)²); swiglu / geglu: gated (two input projections)
    activation: Activation = "gelu"
    swiglu_limit: float = 7.0  # swiglu_clamped / swiglu_limited: the clamp on gate (above) and up (both ways)
    swiglu_alpha: float = 1.702  # swiglu_clamped: the gate's sigmoid slope

    @property
    def gated(self) -> bool:
        """A gated feed-forward (gate, up and down projections)."""
        return self.activation in GATED_ACTIVATIONS


@dataclass
class RopeConfig:
    """The `[model.rope]` table: rotary positions (model.position = "rope"), as Hugging Face defines them."""

    theta: float = 10000.0  # base of the rotary frequencies
    # RoPE frequency scaling (HF's rope_type); the tables are recomputed from these keys, never checkpointed.
    scaling: Literal["none", "linear", "llama3", "yarn"] = "none"
    factor: float = 1.0  # linear, llama3, yarn: how many times longer the context gets
    original_max_seq_len: int | None = None  # llama3, yarn: the pretraining context length
    low_freq_factor: float = 1.0  # llama3: wavelengths above original / this are divided by the factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below original / this are kept
    beta_fast: float = 32.0  # yarn: rotations above which frequencies are kept
    beta_slow: float = 1.0  # yarn: rotations below which frequencies are divided by the factor
    attention_factor: float | None = None  # yarn: cos/sin multiplier; None: 0.1 * ln(factor) + 1
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions (false: gpt-oss's exact ends)
    local_theta: float | None = None  # the sliding_attention blocks' RoPE base, unscaled (None: theta)
    # the fraction of each head's width that rotates (its first int(head_dim * factor) dimensions; Qwen3-Next: 0.25)
    partial_factor: float = 1.0


@dataclass
class NormConfig:
    """The `[model.norm]` table: the normalisation layers and where they go."""

    kind: Literal["layernorm", "rmsnorm"] = "layernorm"  # normalisation layer
    eps: float = 1e-5  # epsilon of every norm
    # Where each sub-layer's (attention's, feed-forward's) norm goes: pre: x + f(norm(x)); post: norm(x + f(x))
    # (the original paper, BERT); post_sublayer: x + norm(f(x)) (OLMo 2); sandwich: x + norm2(f(norm1(x))) (Gemma)
    position: Literal["pre", "post", "post_sublayer", "sandwich"] = "pre"
    # token-mixer kind (model.layer_types) -> its blocks' position, overriding `position` for those blocks (neither
    # may be sandwich); OLMo hybrid: {linear_attention = "pre"} beside post_sublayer attention blocks
    by_kind: dict[str, Literal["pre", "post", "post_sublayer"]] = field(default_factory=dict)
    final: bool | None = None  # norm after each stack; None: except with post-norm
    weight_offset: float = 0.0  # RMSNorm multiplies by (offset + weight); Gemma: 1 (its weights start at 0)
    embedding: bool = False  # norm right after the embeddings (BERT)

    @property
    def use_final(self) -> bool:
        return self.position != "post" if self.final is None else self.final


@dataclass
class MoeConfig:
    """The `[model.moe]` table: the mixture-of-experts feed-forward (model/moe.py) of the "moe" blocks."""

    n_experts: int = 0  # experts per MoE block; 0: every block dense
    experts_per_token: int = 2  # top-k
    d_ff: int = 0  # each expert's width; 0: model.ffn.d_ff
    n_shared_experts: int = 0  # always-on experts of width d_ff each (DeepSeek, Qwen2-MoE)
    # the shared experts' output scaled by sigmoid(a learned linear of the block input) (Qwen2-MoE, Qwen3-Next)
    shared_expert_gate: bool = False
    router_bias: bool = False  # a learned bias on the router logits (gpt-oss)
    expert_linear_bias: bool = False  # biases on each expert's gate/up and down projections (gpt-oss)
    # router logits -> expert scores (sigmoid: DeepSeek-V3; sqrt_softplus: sqrt(softplus(logit)), DeepSeek-V4)
    router_score: Literal["softmax", "sigmoid", "sqrt_softplus"] = "softmax"
    router_renormalize: bool = True  # the top-k weights sum to 1
    router_groups: int = 1  # group-limited routing (DeepSeek-V3): experts in this many groups ...
    router_groups_per_token: int = 1  # ... of which each token picks its best this many first
    # a group's score: the sum of its best two experts' (DeepSeek-V3) or its best expert's (DeepSeek-V2's
    # group_limited_greedy)
    router_group_score: Literal["top2_sum", "max"] = "top2_sum"
    capacity_factor: float = 0.0  # 0: dropless; > 0: each expert takes ceil(factor * tokens * k / n_experts)
    aux_loss: float = 0.0  # Switch/GShard load-balancing loss coefficient
    aux_per_sequence: bool = False  # the balance loss per sequence, averaged (else per micro-batch)
    router_z_loss: float = 0.0  # coefficient of mean(logsumexp(router logits)^2)
    router_bias_update_rate: float = 0.0  # auxiliary-loss-free balancing (DeepSeek-V3); 0: off
    router_scale: float = 1.0  # the top-k weights multiplied by this, after any renormalisation (DeepSeek-V3: 2.5)
    # auto: grouped_mm for bf16 on CUDA where it runs, else the loop (as fast as padded on CPU, or faster)
    backend: Literal["auto", "loop", "padded", "grouped_mm"] = "auto"


install_section_renames(MoeConfig, "moe")  # MoeConfig.expert_bias_terms: deprecated (config_compat.py)


@dataclass
class LinearAttentionConfig:
    """The `[model.linear_attention]` table: the Gated DeltaNet token mixer of the "linear_attention" blocks
    (model/linear_attention.py, Qwen3-Next's) and Kimi Delta Attention of the "kda" blocks (model/kda.py, Kimi
    Linear's: as many query/key heads as value heads, a forget gate per key channel): a recurrent state per value
    head instead of a KV cache."""

    n_heads: int = 4  # value heads (each with its own state, decay and write strength)
    n_key_heads: int | None = None  # query/key heads, each serving n_heads / n_key_heads value heads; None: n_heads
    key_head_dim: int = 32  # width of each query/key head (the state's rows)
    value_head_dim: int = 32  # width of each value head (the state's columns)
    conv_width: int = 4  # taps of the short causal depthwise convolution over q, k and v
    chunk_size: int = 64  # tokens per chunk of the chunked delta rule (compute only: any value, the same function)
    # how the input projections are stored (the same function): "grouped" = in_proj_qkvz and in_proj_ba interleaved
    # per key head (Qwen3-Next), "split" = in_proj_qkv (every q, then k, then v), in_proj_z, in_proj_b, in_proj_a
    # (Qwen3.5), "separate" = in_proj_q, in_proj_k, in_proj_v, in_proj_z, in_proj_b, in_proj_a (OLMo hybrid)
    projections: Literal["grouped", "split", "separate"] = "grouped"
    # beta = 2 sigmoid(b) rather than sigmoid(b): the delta rule's write strength reaches (0, 2), so a state
    # update's eigenvalues may be negative (OLMo hybrid)
    allow_neg_eigval: bool = False
    norm_eps: float | None = None  # the gated output norm's epsilon; None: model.norm.eps (OLMo hybrid: 1e-5)
    # the chunked rule's kernel: "torch" (model/gated_delta.py, any device), "fla" (flash-linear-attention's Triton
    # kernels, a GPU and the extra meshformer[fla]; kda blocks: chunk_kda), "auto" = fla where it is installed and
    # the model is on CUDA
    backend: Literal["torch", "fla", "auto"] = "auto"

    @property
    def key_heads(self) -> int:
        return self.n_key_heads or self.n_heads


@dataclass
class MambaConfig:
    """The `[model.mamba]` table: the Mamba-2 token mixer of the "mamba2" blocks (model/mamba2.py, NemotronH's
    mixer): a state-space scan per head with a (head_dim x state_size) state instead of a KV cache."""

    n_heads: int = 4  # heads, each with its own state, decay rate A, skip D and dt bias
    head_dim: int = 32  # width of each head's input x (the state's rows)
    state_size: int = 16  # N: width of B and C (the state's columns)
    n_groups: int = 1  # groups of heads sharing B and C (and a gated-norm group)
    conv_width: int = 4  # taps of the short causal depthwise convolution over x, B and C
    conv_bias: bool = True  # the convolution has a bias (Mamba-2 and Nemotron-H: yes)
    chunk_size: int = 64  # tokens per chunk of the chunked scan (compute only: any value, the same function)
    dt_floor: float = 0.0  # dt = max(softplus(dt + dt_bias), dt_floor) (transformers' NemotronH: time_step_min)
    # the scan's and convolution's kernels: "torch" (model/ssd.py, any device), "mamba_ssm" (mamba-ssm's
    # mamba_chunk_scan_combined and causal-conv1d's causal_conv1d_fn, a GPU and the extra meshformer[mamba];
    # generation and context parallel keep the torch path), "auto" = those where installed and the model is on CUDA
    backend: Literal["torch", "mamba_ssm", "auto"] = "auto"


@dataclass
class MtpConfig:
    """The `[model.mtp]` table: multi-token prediction (DeepSeek-V3's, model/mtp.py): `depth` sequential modules,
    module k predicting the token k + 1 ahead from the previous module's hidden states (under mHC its streams) and
    the embedding of the token k ahead, through one block of the model's own kinds and the shared output head."""

    depth: int = 0  # MTP modules (DeepSeek-V3: 1); 0: off
    loss_weight: float = 0.3  # lambda: the mean MTP loss over the modules joins the main loss times this
    # the module's block token mixer (a model.layer_types kind); "": the last block's (DeepSeek-V3). DeepSeek-V4:
    # "sliding_mqa" (its published MTP block has no compressor)
    layer_type: str = ""
    mlp_type: str = ""  # its channel mixer (a model.mlp_types kind); "": the last block's. DeepSeek-V4: "moe"


@dataclass
class ResidualConfig:
    """The `[model.residual]` table: how the blocks' branches join the stream between blocks (model/residual.py)."""

    # "plain": x + f(norm(x)) (model.norm.position places the norm); "mhc": manifold-constrained hyper-connections
    # (DeepSeek-V4), `streams` copies of the stream mixed by Sinkhorn-normalised matrices
    kind: Literal["plain", "mhc"] = "plain"
    streams: int = 4  # mhc: copies of the stream (DeepSeek-V4: 4)
    sinkhorn_iters: int = 20  # mhc: Sinkhorn iterations projecting each mix onto the doubly-stochastic matrices
    eps: float = 1e-6  # mhc: added to the mixing weights and to each normalising sum


@dataclass
class InitConfig:
    """The `[model.init]` table: the initialisation of the weights."""

    method: Literal["normal", "xavier"] = "normal"  # initialisation of linear and embedding weights
    std: float = 0.02  # normal: standard deviation (output projections scaled down with depth)


@dataclass
class ModelConfig:
    family: str = "decoder"  # a registered family (meshformer/model/families/__init__.py)
    vocab_size: int = 4096  # token embedding rows and output logits (at least the tokenizer's vocabulary)
    d_model: int = 128  # width of the residual stream
    n_layers: int = 4  # stack depth (each stack's, unless the family reads a key of its own below)
    n_encoder_layers: int | None = None  # encoder stack of a two-stack family; None: n_layers
    n_decoder_layers: int | None = None  # decoder stack of a two-stack family; None: n_layers
    position: Literal["sinusoidal", "learned", "rope", "alibi", "t5_relative", "none"] = "learned"  # position encoding
    max_seq_len: int = 256  # longest sequence (learned positions, rotary and mask tables)
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model)
    tie_embeddings: bool = True  # output projection shares the (target) token embedding
    share_embeddings: bool = True  # source/target families: one embedding for source and target
    bias: bool = True  # biases in linear layers and norms
    head_transform: bool = False  # BERT prediction head: dense + act + norm before output
    output_bias: bool = False  # bias on the output projection
    dropout: float = 0.0  # dropout on embeddings and sub-layer outputs (training only)
    logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    scale_output: bool = False  # multiply final hidden states by d_model**-0.5 before the output projection (T5)
    cross_downsample: int = 1  # pool encoder output by this factor before cross-attention
    # Token mixer of each block of a stack: "full_attention" | "sliding_attention" (attention.window, rope.local_theta)
    # | "linear_attention" (Gated DeltaNet: [model.linear_attention]) | "kda" (Kimi Delta Attention, the same
    # table) | "mamba2" (Mamba-2's state-space scan, [model.mamba]) | "mla" (multi-head latent attention,
    # [model.mla]) | "dsa" (MLA with DeepSeek's sparse attention: [model.mla], [model.dsa]; "dsa_shared": reusing the
    # nearest earlier dsa block's key selection, GLM-5) | "sliding_mqa", "hca",
    # "csa" (DeepSeek-V4's sliding, heavily compressed, compressed sparse: [model.compressed_attention]) | "none" (no
    # token mixer: the block is its channel mixer alone, Nemotron-H's MLP layers), one per block or a shorter pattern
    # repeated over the stack (Gemma 3: 5 sliding, then 1 full); []: all full
    layer_types: list[str] = field(default_factory=list)
    # Channel mixer of each block of a stack: "dense" (ffn) | "moe" (moe) | "hash_moe" (moe's experts, each token's
    # chosen by its id from a fixed table: DeepSeek-V4's first blocks) | "none" (the block is its token mixer alone),
    # one per block or a repeated pattern;
    # []: every block "moe" when moe.n_experts > 0, else "dense"
    mlp_types: list[str] = field(default_factory=list)
    attention: AttentionConfig = field(default_factory=AttentionConfig)  # [model.attention]
    mla: MlaConfig = field(default_factory=MlaConfig)  # [model.mla]
    dsa: DsaConfig = field(default_factory=DsaConfig)  # [model.dsa]
    compressed_attention: CompressedAttentionConfig = field(
        default_factory=CompressedAttentionConfig)  # [model.compressed_attention]
    ffn: FfnConfig = field(default_factory=FfnConfig)  # [model.ffn]
    rope: RopeConfig = field(default_factory=RopeConfig)  # [model.rope]
    norm: NormConfig = field(default_factory=NormConfig)  # [model.norm]
    moe: MoeConfig = field(default_factory=MoeConfig)  # [model.moe]
    linear_attention: LinearAttentionConfig = field(default_factory=LinearAttentionConfig)  # [model.linear_attention]
    mamba: MambaConfig = field(default_factory=MambaConfig)  # [model.mamba]
    init: InitConfig = field(default_factory=InitConfig)  # [model.init]
    mtp: MtpConfig = field(default_factory=MtpConfig)  # [model.mtp]
    residual: ResidualConfig = field(default_factory=ResidualConfig)  # [model.residual]

    @property
    def kv_heads(self) -> int:
        return self.attention.kv_heads

    @property
    def attention_head_dim(self) -> int:
        return self.attention.head_dim or self.d_model // self.attention.n_heads

    @property
    def uses_mla(self) -> bool:
        """Whether the blocks attend through multi-head latent attention, sparse or not (checkpoint formats ask;
        config validation: all of them or none)."""
        from meshformer.model.components import TOKEN_MIXERS  # the kinds read this module

        return any(TOKEN_MIXERS[kind].section == "mla" for kind in set(self.layer_types) if kind in TOKEN_MIXERS)

    @property
    def rope_dim(self) -> int:
        """The width the rotary table covers, as the first block's token mixer declares it (every token mixer of a
        RoPE model rotates the same width)."""
        from meshformer.model.components import token_mixer  # the kinds read this module

        return token_mixer(self, 0).rotary_width(self)

    @property
    def use_qkv_bias(self) -> bool:
        return self.bias if self.attention.qkv_bias is None else self.attention.qkv_bias

    @property
    def gated(self) -> bool:
        """A gated feed-forward (gate, up and down projections)."""
        return self.ffn.gated

    def layer_type(self, block: int) -> str:
        """The token mixer of block `block` (from 0) of a stack."""
        return self.layer_types[block % len(self.layer_types)] if self.layer_types else "full_attention"

    def block_norm_position(self, block: int) -> str:
        """Where block `block`'s sub-layer norms go: its token mixer's entry of norm.by_kind, else norm.position."""
        return self.norm.by_kind.get(self.layer_type(block), self.norm.position)

    def mlp_type(self, block: int) -> str:
        """The channel mixer of block `block` (from 0) of a stack."""
        kind = self.mlp_types[block % len(self.mlp_types)] if self.mlp_types else "moe"
        return "dense" if kind == "moe" and self.moe.n_experts == 0 else kind  # no experts: every block dense

    def is_moe(self, block: int) -> bool:
        """Whether block `block` of a stack holds experts (its channel mixer's kind splits them over parallel.ep)."""
        from meshformer.model.components import channel_mixer  # the kinds read this module

        return channel_mixer(self, block).expert_parallel

    def window(self, block: int) -> int | None:
        """The sliding window of block `block` of a stack (None: global attention), as its token mixer declares."""
        from meshformer.model.components import token_mixer

        return token_mixer(self, block).window(self)

    def local_rope(self, block: int) -> bool:
        """Whether block `block` rotates with the sliding blocks' own RoPE base (rope.local_theta)."""
        return self.rope.local_theta is not None and self.window(block) is not None

    @property
    def expert_d_ff(self) -> int:
        return self.moe.d_ff or self.ffn.d_ff

    @property
    def use_final_norm(self) -> bool:
        return self.norm.use_final


def attention_pattern(window: int | None, full_attention_every: int | None) -> list[str]:
    """layer_types for a sliding `window` where every `full_attention_every`-th block attends globally."""
    if window is None:
        return []
    if full_attention_every is None:
        return ["sliding_attention"]
    return ["sliding_attention"] * (full_attention_every - 1) + ["full_attention"]


def moe_pattern(moe_every: int, moe_first_dense: int, n_layers: int) -> list[str]:
    """mlp_types where block i is MoE when (i + 1) % moe_every == 0 and i >= moe_first_dense: a pattern without
    dense first blocks, else one entry per block of an `n_layers`-deep stack."""
    if moe_first_dense == 0:
        return [] if moe_every == 1 else ["dense"] * (moe_every - 1) + ["moe"]
    return ["moe" if (i + 1) % moe_every == 0 and i >= moe_first_dense else "dense" for i in range(n_layers)]


install_renamed(ModelConfig)  # cfg.n_heads, ModelConfig(rope_scaling=...): deprecated aliases (config_compat.py)
