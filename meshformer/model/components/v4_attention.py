"""DeepSeek-V4's attention (`model/compressed_attention.py`) as three token-mixer kinds reading
`[model.compressed_attention]` and `[model.attention]` (heads, head_dim): "sliding_mqa" (a sliding window only),
"hca" (plus every finished window of `hca_rate` tokens compressed to one entry) and "csa" (plus the lightning
indexer's top `index_topk` entries of overlapping `csa_rate` windows). One key/value head shared by every head,
a learned sink logit per head, a grouped output projection.

The blocks rotate their own queries and keys (model.position = "none") from each row's positions 0, 1, ..., counted
from its first real token and from each packed document's start. Tensor parallel splits the query heads (q_b_proj
colwise, the sinks with their heads) and the grouped output projection by its groups (o_a's groups with their
heads, o_b rowwise); the query latent, the one key/value head, the compressors and the indexer run whole on every
rank (`CompressedAttention.shard_heads`). Context parallel (the all-gather method) keeps each rank's queries and
all-gathers the one key/value head, the compressed entries and the indexer's keys (each piece of a sequence must
hold whole compression windows: data.seq_len a multiple of 2 x cp x the rate); over left-padded or packed rows it
all-gathers the compressors' per-token projections instead and pools each run's windows over the whole sequence,
each query reading its own run's keys and entries. Ulysses splits only the query heads over cp (all-to-all), the
key/value head, entries and picks gathered as above. The generation cache keeps the last window - 1 keys and each
compressor's unfinished window and finished entries (CSA: the indexer's too), so a step reads the window and the
entries, not the prefix.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import ClassVar

from torch import nn

from meshformer.errors import ConfigError
from meshformer.model.components import register
from meshformer.model.components.base import (
    FP32,
    INDEX,
    ActivationLayout,
    GenerationCache,
    InitFn,
    TokenMixer,
    output_projection_bytes,
)
from meshformer.model.config import ModelConfig
from meshformer.model.tp_styles import COLWISE, HEAD_SHARD, ROWWISE


class V4AttentionKind(TokenMixer):
    """One of V4's three attention layer types; `rate` and `indexed` say which."""

    name = "sliding_mqa"
    section = "compressed_attention"
    exports = frozenset(f"compressed_attention.{name}" for name in (
        "q_rank", "rope_dim", "window", "o_groups", "o_rank", "rope_theta", "compress_theta", "hca_rate", "csa_rate",
        "index_heads", "index_dim", "index_topk", "yarn_factor", "yarn_original_max_seq_len",
        "yarn_beta_fast", "yarn_beta_slow"))
    blockwise_kernel = False
    qk_clip = False
    reads_padding_and_documents: ClassVar[bool] = True  # left-padded and packed rows restart their positions

    def _rate(self, cfg: ModelConfig) -> int | None:
        return None

    def _indexed(self) -> bool:
        return False

    def build(self, cfg: ModelConfig, *, causal: bool) -> nn.Module:
        from meshformer.model.compressed_attention import V4Attention, compress_scaling

        c = cfg.compressed_attention
        rate = self._rate(cfg)
        index = (c.index_heads, c.index_dim, c.index_topk) if self._indexed() else None
        return V4Attention(cfg.d_model, cfg.attention.n_heads, cfg.attention_head_dim, c.q_rank, c.rope_dim,
                           c.window, c.o_groups, c.o_rank, cfg.norm.eps, c.rope_theta, c.compress_theta,
                           compress_rate=rate, index=index, compress_scaling=compress_scaling(c),
                           dense=self._indexed() and cfg.dsa.stage == "warmup")

    def check(self, cfg: ModelConfig) -> None:
        c, hd, heads = cfg.compressed_attention, cfg.attention_head_dim, cfg.attention.n_heads
        if cfg.position != "none":
            raise ConfigError(f"{self.name} blocks rotate their own queries and keys, but model.position="
                              f"{cfg.position!r}", 'set model.position = "none"')
        if cfg.norm.kind != "rmsnorm":
            raise ConfigError(f"{self.name} blocks norm with RMSNorm, but model.norm.kind={cfg.norm.kind!r}",
                              'set model.norm.kind = "rmsnorm"')
        sizes = {"q_rank": c.q_rank, "rope_dim": c.rope_dim, "window": c.window, "o_groups": c.o_groups,
                 "o_rank": c.o_rank, "hca_rate": c.hca_rate, "csa_rate": c.csa_rate, "index_heads": c.index_heads,
                 "index_dim": c.index_dim, "index_topk": c.index_topk}
        if bad := [k for k, v in sizes.items() if v <= 0]:
            raise ConfigError(f"model.compressed_attention.{bad[0]}={sizes[bad[0]]} must be positive",
                              "DeepSeek-V4-Flash: q_rank=1024, rope_dim=64, window=128, o_groups=8, o_rank=1024")
        if not c.yarn_factor >= 1:
            raise ConfigError(f"model.compressed_attention.yarn_factor={c.yarn_factor} must be >= 1 (1: unscaled)",
                              "DeepSeek-V4: yarn_factor = 16 with yarn_original_max_seq_len = 65536")
        if c.yarn_factor > 1 and c.yarn_original_max_seq_len <= 0:
            raise ConfigError(f"model.compressed_attention.yarn_factor={c.yarn_factor} stretches a pretraining "
                              "context, but yarn_original_max_seq_len is not set",
                              "set yarn_original_max_seq_len (DeepSeek-V4: 65536)")
        if c.rope_dim % 2 or c.rope_dim > min(hd, c.index_dim):
            raise ConfigError(f"model.compressed_attention.rope_dim={c.rope_dim} must be even and at most the head "
                              f"width {hd} and index_dim {c.index_dim}", "use e.g. rope_dim = 64")
        if (heads * hd) % c.o_groups:
            raise ConfigError(f"model.compressed_attention.o_groups={c.o_groups} does not divide the heads' width "
                              f"{heads * hd}", "use a divisor of model.attention.n_heads")

    def context_piece_multiple(self, cfg: ModelConfig) -> int:
        # each piece compresses its own windows: none may straddle two pieces
        rate = self._rate(cfg)
        return 1 if rate is None else rate

    def ulysses(self, cfg: ModelConfig, cp: int, tp: int) -> str | None:
        # the query heads split over cp; the one key/value head, the entries and the indexer's picks all-gathered
        local = cfg.attention.n_heads // tp
        if local % cp:
            return (f"parallel.cp_method='ulysses' splits each rank's {local} attention heads (n_heads="
                    f"{cfg.attention.n_heads} / tp={tp}) over cp={cp}, which does not divide them; choose cp (and tp) "
                    "so that cp x tp divides n_heads, or use parallel.cp_method='allgather'")
        return None

    def tp_rules(self, cfg: ModelConfig) -> Mapping[str, str]:
        # the module takes its heads' sinks and output groups itself and gathers its input from the sequence slices
        return {"": HEAD_SHARD, "q_b_proj": COLWISE, "output.o_b_proj": ROWWISE}

    def tp_divides(self, cfg: ModelConfig) -> list[tuple[str, int, str]]:
        return [("model.attention.n_heads", cfg.attention.n_heads, "attention heads are split across tensor-parallel "
                 "ranks"),
                ("model.compressed_attention.o_groups", cfg.compressed_attention.o_groups, "the grouped output "
                 "projection's groups are split with the heads")]

    def init_rule(self, cfg: ModelConfig, name: str) -> InitFn | None:
        if name == "sinks" or name.endswith("position_bias"):  # as transformers: no sink share, even gates at first
            return lambda t, g: t.zero_()
        return None

    def new_cache(self) -> GenerationCache | None:
        from meshformer.model.compressed_attention import V4Cache

        return V4Cache()

    def cache_per_token(self, cfg: ModelConfig) -> int:
        """Elements per token of context, rounded up: a compressed entry (head_dim; CSA: and an index_dim indexer
        key) per `rate` tokens. The window's keys and the unfinished windows do not grow with the context
        (`cache_elements` counts them)."""
        rate = self._rate(cfg)
        return 0 if rate is None else -(-self._entry_width(cfg) // rate)

    def _entry_width(self, cfg: ModelConfig) -> int:
        return cfg.attention_head_dim + (cfg.compressed_attention.index_dim if self._indexed() else 0)

    def cache_elements(self, cfg: ModelConfig, context: int) -> int:
        """Elements its cache (`V4Cache`) holds for one sequence after `context` tokens: the last window - 1 keys
        (head_dim each), one entry per finished window (`cache_per_token`), and each compressor's `rate` slots of
        projections and gates (CSA: both halves, and the last finished window's first halves with their gates; the
        indexer's alike at index_dim)."""
        c, hd, rate = cfg.compressed_attention, cfg.attention_head_dim, self._rate(cfg)
        total = min(c.window - 1, context) * hd
        if rate is not None:
            total += context // rate * self._entry_width(cfg)
            for width in (hd, c.index_dim) if self._indexed() else (hd,):
                slots = 2 * width if self._indexed() else width
                total += 2 * rate * slots + (2 * rate * width if self._indexed() else 0)
        return total

    def _widths(self, cfg: ModelConfig) -> tuple[int, int, int]:
        return cfg.attention.n_heads, cfg.attention_head_dim, cfg.d_model

    def _matmuls(self, cfg: ModelConfig) -> tuple[int, int]:
        """Matmul weights read per query (queries, key/value, output, and any compressor and indexer projections)
        and the indexer's own per-query ones."""
        c = cfg.compressed_attention
        heads, hd, d = self._widths(cfg)
        main = d * c.q_rank + c.q_rank * heads * hd + d * hd + c.o_rank * heads * hd + c.o_groups * c.o_rank * d
        rate = self._rate(cfg)
        if rate is not None:
            main += 2 * d * (2 * hd if self._indexed() else hd)
        if self._indexed():
            main += 2 * d * 2 * c.index_dim + c.q_rank * c.index_heads * c.index_dim + d * c.index_heads
        return main, 0

    def params(self, cfg: ModelConfig) -> int:
        """The matmul weights, the query latent's and key's norms, a sink per head; a compressor's per-slot gate
        bias and norm; an indexer's too."""
        c = cfg.compressed_attention
        heads, hd, _ = self._widths(cfg)
        total = self._matmuls(cfg)[0] + c.q_rank + hd + heads
        rate = self._rate(cfg)
        if rate is not None:
            total += rate * (2 * hd if self._indexed() else hd) + hd
        if self._indexed() and rate is not None:
            total += rate * 2 * c.index_dim + c.index_dim
        return total

    def _entries(self, cfg: ModelConfig, keys: int) -> int:
        """Keys a query reads at most: its window and, where compressed, the entries it may see or keep."""
        c, rate = cfg.compressed_attention, self._rate(cfg)
        seen = 0 if rate is None else keys // rate
        return min(c.window, keys) + (min(seen, c.index_topk) if self._indexed() else seen)

    def flops(self, cfg: ModelConfig, queries: int, keys: int, *, causal: bool) -> int:
        """Projections per token, scores and weighted values over each query's keys (computed densely over the
        window and entries: an upper bound), and the indexer's scores against every entry."""
        c = cfg.compressed_attention
        heads, hd, _ = self._widths(cfg)
        total = 2 * queries * self._matmuls(cfg)[0] + 4 * queries * heads * hd * self._entries(cfg, keys)
        if self._indexed():
            total += 2 * queries * (keys // c.csa_rate) * c.index_heads * (c.index_dim + 1)
        return total

    def _blocks(self, cfg: ModelConfig, x: ActivationLayout) -> tuple[int, int, int, int]:
        """Over this rank's query blocks (`CompressedAttention.query_block` consecutive positions of a piece; under
        context parallel rank 0's two pieces, whose positions sum as every rank's do): (scores per head, gathered
        entries, mask elements, the largest block's scores per head). A block's queries score its windows' keys,
        the sink and, in HCA, every entry its last query may see; in CSA each query's top-k picks (gathered)."""
        from meshformer.model.compressed_attention import CompressedAttention

        c = cfg.compressed_attention
        seq, cp = _query_span(x)
        return _query_blocks(seq, cp, x.batch, c.window, self._rate(cfg), c.index_topk if self._indexed() else None,
                             CompressedAttention.query_block)

    def _score_heads(self, cfg: ModelConfig, x: ActivationLayout) -> int:
        """The heads whose scores a rank keeps: its tensor-parallel share, split again over cp under Ulysses."""
        return self._widths(cfg)[0] // x.tp // (x.cp if x.ulysses else 1)

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        """Per token its input, latent (norm input, normalised, output), queries (before and after their norm and
        rotary), key (its norm input, normalised), the rotary tables and output (rotated back, and its groups'
        projections); the whole sequence's key/value head (all-gathered under context parallel); a compressor's
        projections and float32 gate weights per token and its entries (norm input, normalised, and the whole
        sequence's); each query block's probabilities (`_blocks`) and masks, CSA's gathered entries. The indexer
        keeps nothing (it passes no gradient) unless its objective is on (`_index_loss_bytes`). Under bfloat16 the
        float32 copies the queries' norm and the compressor's norm make."""
        heads, hd, d = self._widths(cfg)
        heads //= x.tp  # this rank's heads (and output groups); the latent, key/value head and input whole
        c, a, rate, seq = cfg.compressed_attention, x.bytes, self._rate(cfg), x.seq
        widening = FP32 if a != FP32 else 0  # a float32 copy kept beside a low-precision tensor
        per_token = (d + 2 * c.q_rank + 3 * heads * hd + hd + c.o_groups // x.tp * c.o_rank) * a + heads * FP32
        # the norms' normalised inputs (before their weight), their statistics, the rotary tables (cos, sin, -sin)
        per_token += (c.q_rank + hd) * a + (3 * c.rope_dim // 2 + 2) * FP32 + heads * hd * widening
        total = seq * per_token + seq * x.cp * hd * a
        if rate is not None:
            width = 2 * hd if self._indexed() else hd
            entries = seq * x.cp // rate
            total += seq * width * (a + FP32) + (seq // rate) * hd * (2 * a + widening) + entries * hd * a
        scores, gathered, masks, _ = self._blocks(cfg, x)
        if x.ulysses and rate is not None and self._indexed() and cfg.dsa.stage != "warmup":
            # the picks all-gathered as one int64 tensor (indices and kept flags, B x T x 2 top-k), whose slices
            # the gathers keep, in place of this rank's own indices
            picks = min(c.index_topk, seq * x.cp // rate)
            total += (seq * x.cp * 2 - seq) * picks * INDEX
        return (x.batch * (total + self._score_heads(cfg, x) * scores * a + gathered * hd * a) + masks
                + self._index_loss_bytes(cfg, x))

    def _index_loss_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        """What the csa indexer's objective keeps for backward (index_loss_weight > 0): its compressor's
        projections, gate weights and entries over the detached input, and per query its heads' queries (projected,
        float32 and rotated), gates, and over the entries it is scored on (its top-k; in the warm-up every one it
        may see) the gathered keys (and their float32 copy), each head's ReLU output and weighted score, the
        log-softmax, the target and the mask."""
        c = cfg.compressed_attention
        rate = self._rate(cfg)
        if not self._indexed() or rate is None or c.index_loss_weight <= 0:
            return 0.0
        from meshformer.model.compressed_attention import CompressedAttention

        a, di, hi, seq = x.bytes, c.index_dim, c.index_heads, x.seq
        widening = FP32 if a != FP32 else 0
        compressor = seq * 2 * di * (a + FP32) + (seq // rate) * di * (2 * a + widening) + seq * x.cp // rate * di * a
        # under Ulysses every rank scores the whole sequence's queries (counting its own only)
        queries, pieces = _query_span(x)
        scored = _scored_entries(queries, pieces, rate, None if cfg.dsa.stage == "warmup" else c.index_topk,
                                 CompressedAttention.query_block)
        per_query = hi * di * (a + 2 * FP32) + hi * FP32
        per_entry = di * (a + FP32) + 2 * hi * FP32 + 3 * FP32 + 1
        return x.batch * (compressor + queries * per_query + scored * per_entry)

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        """The matmul outputs: latent, queries, key, each query block's scores and outputs, and the output
        projection's."""
        heads, hd, _ = self._widths(cfg)
        heads //= x.tp
        c = cfg.compressed_attention
        scores = self._blocks(cfg, x)[0]
        return (x.batch * (x.seq * (c.q_rank + 2 * heads * hd + hd) + self._score_heads(cfg, x) * scores) * x.bytes
                + output_projection_bytes(cfg, x))

    def backward_bytes(self, cfg: ModelConfig, x: ActivationLayout, freed: float) -> float:
        """The largest query block's score gradients (float32 and the activation dtype) and the whole sequence's
        key/value head and entries' gradients, accumulated over the blocks."""
        hd = self._widths(cfg)[1]
        rate, whole = self._rate(cfg), x.seq * x.cp
        largest = self._blocks(cfg, x)[3]
        entries = 0 if rate is None else whole // rate
        return x.batch * (self._score_heads(cfg, x) * largest * (FP32 + x.bytes) + (whole + entries) * hd * FP32)


def _query_span(x: ActivationLayout) -> tuple[int, int]:
    """(tokens, pieces' ranks) of the query blocks a rank runs: its two pieces of the sequence, or under Ulysses the
    whole sequence as one piece (for its share of the heads)."""
    return (x.seq * x.cp, 1) if x.ulysses else (x.seq, x.cp)


@functools.lru_cache(maxsize=256)
def _scored_entries(seq: int, cp: int, rate: int, topk: int | None, step: int) -> int:
    """(query, entry) pairs the csa indexer's objective scores over this rank's query blocks: each query's top-k
    (`topk`), or in the warm-up (None) every entry its block's last query may see."""
    from meshformer.model.attention import pieces_held

    spans = pieces_held(0, cp, seq) if cp > 1 else [(0, seq, 0)]
    total = 0
    for _, length, at in spans:
        for first in range(at, at + length, step):
            n = min(step, at + length - first)
            total += n * (min(topk, seq * cp // rate) if topk is not None else (first + n) // rate)
    return total


@functools.lru_cache(maxsize=256)
def _query_blocks(seq: int, cp: int, batch: int, window: int, rate: int | None, topk: int | None, step: int
                  ) -> tuple[int, int, int, int]:
    """`V4AttentionKind._blocks` (the planner asks it of every layout: cached)."""
    from meshformer.model.attention import pieces_held

    spans = pieces_held(0, cp, seq) if cp > 1 else [(0, seq, 0)]
    scores = gathered = masks = largest = 0
    for _, length, at in spans:
        for first in range(at, at + length, step):
            n = min(step, at + length - first)
            keys = first + n - max(0, first - window + 1)
            entries = 0
            if rate is not None and topk is not None:
                entries = min(topk, seq * cp // rate)
                gathered += n * entries
            elif rate is not None:
                entries = (first + n) // rate
            scores += n * (keys + entries + 1)
            masks += n * (keys + entries * (batch if topk is not None else 1))
            largest = max(largest, n * (keys + entries + 1))
    return scores, gathered, masks, largest


class HeavilyCompressedKind(V4AttentionKind):
    name = "hca"

    def _rate(self, cfg: ModelConfig) -> int | None:
        return cfg.compressed_attention.hca_rate


class CompressedSparseKind(V4AttentionKind):
    name = "csa"

    def _rate(self, cfg: ModelConfig) -> int | None:
        return cfg.compressed_attention.csa_rate

    def _indexed(self) -> bool:
        return True

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        weight = cfg.compressed_attention.index_loss_weight
        if weight < 0:
            raise ConfigError(f"model.compressed_attention.index_loss_weight={weight} must be at least 0",
                              "use e.g. 1.0 to train the csa indexers, 0 to leave them as they are")
        if cfg.dsa.stage == "warmup" and weight == 0:
            raise ConfigError('model.dsa.stage = "warmup" trains only the csa indexers, but their loss is off '
                              "(model.compressed_attention.index_loss_weight = 0)",
                              'set model.compressed_attention.index_loss_weight > 0 (e.g. 1.0), or model.dsa.stage = '
                              '"sparse"')

    def trains_only(self, cfg: ModelConfig) -> str | None:
        # the indexer's warm-up: dense attention over every visible entry, only the indexers learn
        return "indexer" if cfg.dsa.stage == "warmup" else None


register(V4AttentionKind())
register(HeavilyCompressedKind())
register(CompressedSparseKind())
