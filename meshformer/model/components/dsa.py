"""DeepSeek Sparse Attention (`model/dsa.py`; DeepSeek-V3.2, GLM-5) as the token-mixer kind `dsa`: the `mla` kind
(reading `[model.mla]` and `[model.attention]`) plus a lightning indexer per block (`[model.dsa]`) that keeps the
`dsa.topk` keys each query attends to. The kind `dsa_shared` (GLM-5's indexer_types "shared") holds no indexer: it
attends to the keys the nearest earlier `dsa` block selected in the same forward.

Tensor parallel splits the MLA projections as the `mla` kind does and keeps the indexer whole on every rank, its
scores' gradient summed over the ranks (each rank's heads give their share of its loss). Its cache holds the MLA
latent and rotary key and the indexer key of each token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from torch import nn

from meshformer.errors import ConfigError
from meshformer.model.components import register
from meshformer.model.components.base import FP32, ActivationLayout, GenerationCache, InitFn
from meshformer.model.components.mla import LatentAttention
from meshformer.model.config import ModelConfig
from meshformer.model.tp_styles import PARTIAL_GRADIENT


def indexer_matmuls(cfg: ModelConfig) -> tuple[int, int]:
    """The indexer's matmul weights read per query (wq_b from the query latent, weights_proj) and per key (wk)."""
    d, x, rank = cfg.d_model, cfg.dsa, cfg.mla.q_lora_rank or 0
    return rank * x.n_heads * x.head_dim + d * x.n_heads, d * x.head_dim


class SparseAttention(LatentAttention):
    """MLA over the keys a lightning indexer selects per query; the indexer's loss joins the objective."""

    name = "dsa"
    exports = LatentAttention.exports | {"dsa.n_heads", "dsa.head_dim", "dsa.topk", "dsa.rope_interleave"}
    section = "mla"  # its attention is multi-head latent attention (`ModelConfig.uses_mla`); [model.dsa] its indexer
    # the indexer's loss counts only real queries
    reads_padding_and_documents: ClassVar[bool] = True
    reads_carry: ClassVar[bool] = True  # hands its selection to the dsa_shared blocks after it
    rotary_peers: ClassVar[frozenset[str]] = frozenset({"dsa", "dsa_shared"})

    def ulysses(self, cfg: ModelConfig, cp: int, tp: int) -> str | None:
        # its indexer scores every key with heads of its own and keeps top-k across them: not split by heads here
        return ("its lightning indexer selects keys over all of its own heads, which Ulysses does not split; use "
                "parallel.cp_method='allgather'")

    def build(self, cfg: ModelConfig, *, causal: bool) -> nn.Module:
        from meshformer.model.dsa import SparseLatentAttention

        return SparseLatentAttention(cfg)

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        x = cfg.dsa
        if cfg.mla.q_lora_rank is None:
            raise ConfigError("dsa blocks read their indexer's queries from the query latent, but model.mla."
                              "q_lora_rank is unset", "set model.mla.q_lora_rank (DeepSeek-V3.2: 1536)")
        sizes = {"n_heads": x.n_heads, "head_dim": x.head_dim, "topk": x.topk}
        if bad := [k for k, v in sizes.items() if v <= 0]:
            raise ConfigError(f"model.dsa.{bad[0]}={sizes[bad[0]]} must be positive",
                              "DeepSeek-V3.2: n_heads=64, head_dim=128, topk=2048")
        if x.head_dim < cfg.mla.qk_rope_head_dim:
            raise ConfigError(f"model.dsa.head_dim={x.head_dim} is narrower than the rotary width model.mla."
                              f"qk_rope_head_dim={cfg.mla.qk_rope_head_dim} it rotates",
                              f"use model.dsa.head_dim >= {cfg.mla.qk_rope_head_dim}")
        if x.loss_weight < 0:
            raise ConfigError(f"model.dsa.loss_weight={x.loss_weight} must be at least 0", "use e.g. 1.0")

    def init_rule(self, cfg: ModelConfig, name: str) -> InitFn | None:
        if name == "indexer.k_norm.weight":  # a plain LayerNorm: norm.weight_offset is not its
            return lambda t, g: t.fill_(1.0)
        if name == "indexer.k_norm.bias":
            return lambda t, g: t.zero_()
        return super().init_rule(cfg, name)

    def trains_only(self, cfg: ModelConfig) -> str | None:
        return "indexer" if cfg.dsa.stage == "warmup" else None

    def tp_rules(self, cfg: ModelConfig) -> Mapping[str, str]:
        return {**super().tp_rules(cfg), "indexer.scores_grad": PARTIAL_GRADIENT}

    def new_cache(self) -> GenerationCache | None:
        from meshformer.model.dsa import IndexedKVCache

        return IndexedKVCache()  # k, v: MLA's latents and rotary keys; index_k: the indexer keys (B, 1, T, width)

    def cache_per_token(self, cfg: ModelConfig) -> int:
        return super().cache_per_token(cfg) + cfg.dsa.head_dim

    def params(self, cfg: ModelConfig) -> int:
        """MLA's, and the indexer's matmul weights and its key LayerNorm (weight and bias)."""
        return super().params(cfg) + sum(indexer_matmuls(cfg)) + 2 * cfg.dsa.head_dim

    def flops(self, cfg: ModelConfig, queries: int, keys: int, *, causal: bool) -> int:
        """MLA's over every key (the selection is a mask), and the indexer's projections and scores (its heads'
        head_dim-wide products and their weighted sum)."""
        per_query, per_key = indexer_matmuls(cfg)
        x = cfg.dsa
        indexer = 2 * queries * per_query + 2 * keys * per_key + 2 * queries * keys * x.n_heads * (x.head_dim + 1)
        return super().flops(cfg, queries, keys, causal=causal) + indexer

    def _indexer_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        """The indexer's fp32 scores per head (relu's input and output) and its summed scores, over the keys each
        query reads."""
        _, _, calls = self._rows(cfg, x)
        return x.batch * sum(q * k for q, k in calls) * (2 * cfg.dsa.n_heads + 1) * FP32

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        return super().saved_bytes(cfg, x, memory_len=memory_len, causal=causal) + self._indexer_bytes(cfg, x)

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        return super().selective_bytes(cfg, x, memory_len=memory_len, causal=causal) + self._indexer_bytes(cfg, x)


class SharedSparseAttention(SparseAttention):
    """MLA over the keys the nearest earlier dsa block selected in this forward (GLM-5's indexer_types "shared"): no
    indexer, no indexer loss, no indexer keys in its cache. Counted as MLA."""

    name = "dsa_shared"

    def build(self, cfg: ModelConfig, *, causal: bool) -> nn.Module:
        from meshformer.model.dsa import SparseLatentAttention

        return SparseLatentAttention(cfg, shared=True)

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        if cfg.layer_type(0) != "dsa":
            raise ConfigError(f"model.layer_types={cfg.layer_types} starts with {cfg.layer_type(0)!r}, but a "
                              "dsa_shared block reuses the key selection of an earlier dsa block",
                              'start model.layer_types with "dsa" (GLM-5: indexer_types[0] is "full")')
        if cfg.mtp.depth and cfg.layer_type(cfg.n_layers - 1) == "dsa_shared":
            raise ConfigError("the multi-token prediction block takes the last block's kind, dsa_shared, but has no "
                              "dsa block before it to take a key selection from",
                              'make the last block "dsa", or set model.mtp.depth = 0')

    def tp_rules(self, cfg: ModelConfig) -> Mapping[str, str]:
        return LatentAttention.tp_rules(self, cfg)

    def cache_per_token(self, cfg: ModelConfig) -> int:
        return LatentAttention.cache_per_token(self, cfg)

    def params(self, cfg: ModelConfig) -> int:
        return LatentAttention.params(self, cfg)

    def flops(self, cfg: ModelConfig, queries: int, keys: int, *, causal: bool) -> int:
        return LatentAttention.flops(self, cfg, queries, keys, causal=causal)

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        return LatentAttention.saved_bytes(self, cfg, x, memory_len=memory_len, causal=causal)

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        return LatentAttention.selective_bytes(self, cfg, x, memory_len=memory_len, causal=causal)


register(SparseAttention())
register(SharedSparseAttention())
