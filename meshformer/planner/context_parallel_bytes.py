"""The two context-parallel methods (parallel.cp_method) side by side: the bytes each rank sends per micro-batch
and the bytes of whole-sequence tensors its token mixers keep for backward, and which method to run.

Per self-attention-like layer, with b sequences, T tokens, n = T / cp of them on each rank, a-byte activations,
H query heads and G key/value heads of D width on each tensor-parallel rank:
- allgather: every rank sends its keys and values to the cp - 1 others, 2 b G n D a (cp - 1), and their backward
  reduce-scatter sends as much; attention keeps the whole sequence's keys and values repeated to every query head,
  2 b H T D a, besides its own queries and output. MLA sends its compressed latent and rotary key instead. Gated
  DeltaNet and KDA pass an fp32 (b, H, Dk, Dv) state in 2 cp - 1 all-gathers of two slots per rank, each way.
- ulysses: four all-to-alls (q, k, v in; the output back), each sending (cp - 1) / cp of a (b, n, heads x D) tensor,
  and as many in backward; key/value heads fewer than cp are first repeated up to cp. Attention then keeps q, k, v
  and its output for H / cp heads over T tokens: 4 b H n D a, the keys and values cp times fewer than allgather's.
  DeepSeek-V4's kinds all-gather their one key/value head, entries and indexer keys as under allgather, and move
  only the queries and the output all-to-all (CSA: its picks gathered too).
  Gated DeltaNet and KDA exchange q, k, v, their b and a inputs, and the output; Mamba-2 x, its groups' B and C,
  dt with the padding beside it, and the output (the all-gather passes its fp32 (b, H, P, N) state as above).

The rule `recommend` states: Ulysses where every token mixer allows it and it sends fewer bytes, else allgather.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config import Config
from meshformer.model.components import model_kinds, token_mixer
from meshformer.model.components.base import FP32
from meshformer.model.families import get_family_spec

METHODS = ("allgather", "ulysses")
RULE = ("ulysses where every token mixer's heads split over cp (x tp) and it sends fewer bytes per micro-batch than "
        "the all-gather; otherwise allgather")


@dataclass(frozen=True)
class MethodCost:
    method: str
    sent: float  # bytes one rank sends per micro-batch, forward and backward
    kept: float  # bytes of exchanged or whole-sequence tensors the mixers keep for backward, per micro-batch
    refusal: str | None  # why the config cannot run this method (None: it can)


def _layer_cost(cfg: Config, kind: str, method: str, batch: int, cp: int, tp: int, a: int) -> tuple[float, float]:
    """(sent, kept) bytes of one token-mixer layer of `kind` on one rank, per micro-batch."""
    m = cfg.model
    seq = cfg.data.seq_len
    n = seq // cp
    others = cp - 1
    if kind in ("full_attention", "sliding_attention"):
        d, heads, kv = m.attention_head_dim, m.attention.n_heads // tp, max(m.kv_heads // tp, 1)
        if method == "allgather":
            return 2 * 2 * batch * kv * n * d * a * others, 2 * batch * heads * seq * d * a
        kv = kv if kv % cp == 0 else cp
        return 2 * (2 * heads + 2 * kv) * batch * n * d * a * others / cp, 4 * batch * heads * n * d * a
    if kind in ("mla", "dsa", "dsa_shared"):
        x, heads = m.mla, m.attention.n_heads // tp
        if method == "allgather":
            return (2 * batch * n * (x.kv_lora_rank + x.qk_rope_head_dim) * a * others,
                    batch * seq * (x.kv_lora_rank + x.qk_rope_head_dim) * a + batch * heads * seq * (x.qk_head_dim
                                                                                                   + x.v_head_dim) * a)
        width = heads * (2 * x.qk_head_dim + 2 * x.v_head_dim)  # q, k, v in and the output back
        return 2 * batch * n * width * a * others / cp, batch * n * width * a
    if kind in ("linear_attention", "kda"):
        la = m.linear_attention
        heads, key_heads = la.n_heads // tp, (la.n_heads if kind == "kda" else la.key_heads) // tp
        if method == "allgather":
            state = batch * heads * la.key_head_dim * la.value_head_dim * FP32
            return 2 * (2 * cp - 1) * 2 * state * others, 0.0
        decay = heads * la.key_head_dim if kind == "kda" else heads
        width = 2 * key_heads * la.key_head_dim + 2 * heads * la.value_head_dim + heads + decay
        return 2 * batch * n * width * a * others / cp, batch * n * width * a
    if kind in ("sliding_mqa", "hca", "csa"):
        c, d = m.compressed_attention, m.attention_head_dim
        rate = {"sliding_mqa": 0, "hca": c.hca_rate, "csa": c.csa_rate}[kind]
        # the key/value head and the entries gathered forward, their gradients reduce-scattered back; the indexer's
        # keys forward only (no gradient); a CSA piece's last window (rate tokens) too small to count
        rows, entries = batch * n, batch * n // rate if rate else 0
        sent = (2 * rows * d + 2 * entries * d + (entries * c.index_dim if kind == "csa" else 0)) * a * others
        kept = (batch * seq * d + (batch * seq // rate * d if rate else 0)) * a
        if method == "allgather":
            return sent, kept
        # Ulysses gathers the same, and moves the queries in and the output back (all-to-all, each way in backward
        # too) and CSA's picks (int64 slots and flags, forward only); it keeps its heads' queries and output whole
        heads = m.attention.n_heads // tp
        picks = 2 * rows * min(c.index_topk, seq // rate) * 8 * others if kind == "csa" else 0
        return sent + 2 * 2 * rows * heads * d * a * others / cp + picks, kept + 2 * batch * heads * n * d * a
    if kind == "mamba2":
        mamba = m.mamba
        heads, groups = mamba.n_heads // tp, mamba.n_groups // tp
        if method == "allgather":
            state = batch * heads * mamba.head_dim * mamba.state_size * FP32
            return 2 * (2 * cp - 1) * 2 * state * others, 0.0
        # x and the output back, B and C, dt with the padding beside it
        width = 2 * heads * mamba.head_dim + 2 * groups * mamba.state_size + 2 * heads
        return 2 * batch * n * width * a * others / cp, batch * n * width * a
    return 0.0, 0.0


def cp_costs(cfg: Config, cp: int, tp: int = 1, batch: int | None = None) -> list[MethodCost]:
    """Both methods' bytes for `cfg` under cp context-parallel ranks (each holding tp's share of the heads), one
    micro-batch of `batch` sequences (default data.batch_size)."""
    batch = cfg.data.batch_size if batch is None else batch
    a = 2 if cfg.train.dtype == "bf16" else 4
    kinds = [token_mixer(cfg.model, block).name for stack in get_family_spec(cfg.model.family).stacks
             if not stack.cross for block in range(stack.count(cfg.model))]
    costs = []
    for method in METHODS:
        sent = kept = 0.0
        for kind in kinds:
            s, k = _layer_cost(cfg, kind, method, batch, cp, tp, a)
            sent, kept = sent + s, kept + k
        refusal = None
        if method == "ulysses":
            refusal = next((r for kind in model_kinds(cfg.model) if (r := kind.ulysses(cfg.model, cp, tp))), None)
        costs.append(MethodCost(method, sent, kept, refusal))
    return costs


def recommend(costs: list[MethodCost]) -> MethodCost:
    """`RULE`: Ulysses where it runs and sends fewer bytes, else the all-gather."""
    gather, ulysses = costs
    return ulysses if ulysses.refusal is None and ulysses.sent < gather.sent else gather


def context_parallel_report(cfg: Config, layouts: list[tuple[int, int]], batch: int) -> list[dict]:
    """Per distinct (cp, tp) with cp > 1: both methods' bytes and the recommendation, for `meshformer plan`."""
    out = []
    for cp, tp in dict.fromkeys((cp, tp) for cp, tp in layouts if cp > 1):
        costs = cp_costs(cfg, cp, tp, batch)
        out.append({"cp": cp, "tp": tp, "recommended": recommend(costs).method, "configured": cfg.parallel.cp_method,
                    "methods": {c.method: {"sent_gib": c.sent / 2**30, "kept_gib": c.kept / 2**30,
                                           "refusal": c.refusal} for c in costs}})
    return out
