"""Mamba-2 (`model/mamba2.py`, NemotronH's mixer) as the token-mixer kind `mamba2`, reading `[model.mamba]`: a
state-space scan per head instead of attention over keys, so, like Gated DeltaNet, it reads the padding and packed
documents of its tokens rather than a mask and keeps a state of constant size when generating.

Layouts: context parallel passes its convolution window and state from piece to piece in sequence order (or, with
parallel.cp_method="ulysses", gives each rank whole sequences of a run of its heads and groups) and tensor parallel
splits it by heads (and groups), as Gated DeltaNet does; data parallel, FSDP and pipeline stages hold it as
any other block.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import nn

from meshformer.errors import ConfigError
from meshformer.model.components import register
from meshformer.model.components.base import (
    FP32,
    ActivationLayout,
    GenerationCache,
    InitFn,
    TokenMixer,
    output_projection_bytes,
)
from meshformer.model.components.linear_attention import check_recurrent_sizes, residual_output_init
from meshformer.model.config import ModelConfig
from meshformer.model.tp_styles import HEAD_SHARD, ROWWISE


def _widths(cfg: ModelConfig) -> tuple[int, int, int]:
    """(inner width H x P, convolved channels: x, B and C, in_proj's output rows)."""
    m = cfg.mamba
    inner = m.n_heads * m.head_dim
    conv = inner + 2 * m.n_groups * m.state_size
    return inner, conv, inner + conv + m.n_heads


def mamba2_matmuls(cfg: ModelConfig) -> int:
    """Weights one token passes through: in_proj, out_proj and the convolution's taps."""
    inner, conv, rows = _widths(cfg)
    return cfg.d_model * rows + inner * cfg.d_model + conv * cfg.mamba.conv_width


def ssd_flops(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of the chunked scan (model/ssd.py), L = chunk_size: per chunk and group C B^T
    (L^2 N), per chunk and head the masked product with x (L^2 P), the state written (L P N), the state read (L P N)
    and the state carried (P N); 2 FLOPs a multiply-add, divided by the L tokens of the chunk."""
    m = cfg.mamba
    chunk = m.chunk_size
    per_chunk = m.n_groups * chunk * chunk * m.state_size + m.n_heads * (
        chunk * chunk * m.head_dim + 2 * chunk * m.head_dim * m.state_size + m.head_dim * m.state_size)
    return 2 * per_chunk // chunk


class Mamba2Kind(TokenMixer):
    """Mamba-2: in_proj, a short causal convolution over x, B and C, the chunked state-space scan with its skip D,
    a gate-first grouped RMSNorm and out_proj."""

    name = "mamba2"
    exports = frozenset({"mamba.n_heads", "mamba.head_dim", "mamba.state_size", "mamba.n_groups", "mamba.conv_width",
                         "mamba.conv_bias", "mamba.dt_floor"})
    section = "mamba"
    reads_padding_and_documents = True
    qk_clip = False  # no attention logits for MuonClip to record or clip

    def build(self, cfg: ModelConfig, *, causal: bool) -> nn.Module:
        from meshformer.model.mamba2 import Mamba2

        return Mamba2(cfg)

    def check(self, cfg: ModelConfig) -> None:
        m = cfg.mamba
        check_recurrent_sizes(cfg, "mamba2", "mamba",
                              ("n_heads", "head_dim", "state_size", "n_groups", "conv_width", "chunk_size"))
        if m.n_heads % m.n_groups:
            raise ConfigError(f"model.mamba.n_groups={m.n_groups} must divide n_heads={m.n_heads} (each group of "
                              "heads shares B and C)", "choose n_groups dividing n_heads")
        if m.dt_floor < 0:
            raise ConfigError(f"model.mamba.dt_floor={m.dt_floor} must be >= 0", "set it to 0 (no floor) or above")
        if m.backend == "mamba_ssm":
            from meshformer.model.mamba2_kernels import MAMBA_EXTRA, mamba_importable

            if not mamba_importable():
                raise ConfigError(f"{MAMBA_EXTRA} (not installed here)",
                                  'install them, or set model.mamba.backend = "auto" or "torch"')

    def tp_rules(self, cfg: ModelConfig) -> Mapping[str, str]:
        # in_proj's rows and the convolution's channels are not head-major: the module keeps them whole and reads its
        # heads' (model/mamba2.py: shard_heads); out_proj's columns are head-major
        return {"": HEAD_SHARD, "out_proj": ROWWISE}

    def tp_divides(self, cfg: ModelConfig) -> list[tuple[str, int, str]]:
        why = "Mamba-2 heads, and the groups of B and C they read, are split across tensor-parallel ranks"
        return [("model.mamba.n_heads", cfg.mamba.n_heads, why), ("model.mamba.n_groups", cfg.mamba.n_groups, why)]

    def ulysses(self, cfg: ModelConfig, cp: int, tp: int) -> str | None:
        # each rank runs whole sequences of a run of its heads and of the groups of B and C those heads read
        m = cfg.mamba
        for key, heads in (("n_heads", m.n_heads), ("n_groups", m.n_groups)):
            if (heads // tp) % cp:
                return (f"parallel.cp_method='ulysses' splits each rank's {heads // tp} Mamba-2 "
                        f"{key.removeprefix('n_')} (model.mamba.{key}={heads} / tp={tp}) over cp={cp}, which does not "
                        "divide them; choose cp (and tp) so that cp x tp divides them, or use "
                        "parallel.cp_method='allgather'")
        return None

    def init_rule(self, cfg: ModelConfig, name: str) -> InitFn | None:
        """mamba-ssm's Mamba2: A_log log(uniform(1, 16)), D 1, dt_bias the inverse softplus of
        exp(uniform(log 1e-3, log 1e-1)) (at least 1e-4), the convolution PyTorch's default (taps
        uniform(+-1/sqrt(conv_width)), bias 0 here), the gated norm's scale 1; out_proj as a residual output."""
        if name == "A_log":
            return lambda t, g: t.uniform_(1.0, 16.0, generator=g).log_()
        if name == "D" or name == "norm.weight":
            return lambda t, g: t.fill_(1.0)
        if name == "dt_bias":
            def dt_bias(t, g):  # type: ignore[no-untyped-def]
                dt = t.uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp_().clamp_(min=1e-4)
                return t.copy_(dt + (-(-dt).expm1()).log())

            return dt_bias
        if name == "conv1d.weight":
            bound = 1 / math.sqrt(cfg.mamba.conv_width)
            return lambda t, g: t.uniform_(-bound, bound, generator=g)
        if name == "out_proj.weight":
            return residual_output_init(cfg)
        return None

    def new_cache(self) -> GenerationCache | None:
        from meshformer.model.linear_attention import LinearCache

        return LinearCache()

    def cache_per_token(self, cfg: ModelConfig) -> int:
        """0: its cache holds, per sequence, the convolution's last conv_width - 1 inputs and each head's
        (head_dim x state_size) state, whatever the length."""
        return 0

    def params(self, cfg: ModelConfig) -> int:
        """The matmul weights and taps, the convolution's bias, A_log, D and dt_bias per head, the norm's weight."""
        m = cfg.mamba
        inner, conv, _ = _widths(cfg)
        return mamba2_matmuls(cfg) + (conv if m.conv_bias else 0) + 3 * m.n_heads + inner

    def flops(self, cfg: ModelConfig, queries: int, keys: int, *, causal: bool) -> int:
        return 2 * queries * mamba2_matmuls(cfg) + queries * ssd_flops(cfg)

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        """What its autograd graph keeps (read off `saved_tensors_hooks`). In the activation dtype per token: the
        input, in_proj's output, the convolution's padded input, out_proj's input. In float32 per token: the
        convolution's output and SiLU's (its float32 taps promote them), five (H x P)-wide tensors (the scan's input,
        its output with the skip, the gated norm's terms; seven from half-precision activations, whose float32 casts
        the scan and the norm keep), B and C per group and decayed per head, dt and its decay terms. Per head and
        token of the sequence padded to whole chunks of L: the (L x L) decays and scores, per group C B^T, and every
        chunk's entering (P x N) state. Within 15% of the measurement (tests/unit/model/test_mamba2.py). Under tensor
        parallel every term but the (gathered) input is this rank's heads'."""
        m, b, s, a, t = cfg.mamba, x.batch, x.seq, x.bytes, x.tp
        heads, groups = m.n_heads // t, m.n_groups // t
        inner, conv = heads * m.head_dim, heads * m.head_dim + 2 * groups * m.state_size
        rows = inner + conv + heads
        chunk = m.chunk_size
        padded = -(-s // chunk) * chunk
        wide = 5 if a >= FP32 else 7
        per_token = (cfg.d_model + rows + conv + inner) * a + (
            2 * conv + wide * inner + 2 * (heads + groups) * m.state_size + 5 * heads) * FP32
        scan = ((2 * heads + groups) * padded * chunk + padded // chunk * heads * m.head_dim * m.state_size) * FP32
        return b * (s * per_token + scan)

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        """What the selective policy keeps (parallel/recompute.py: the matmul outputs): in_proj's output in the
        activation dtype; in float32 the scan's batched products, per group and token padded to whole chunks of L
        C B^T (L wide), per head and padded token the two (L x P) output terms, per head and chunk the (P x N) state
        it writes; and out_proj's output. Equal to the measurement (tests/unit/planner/
        test_recurrent_selective_bytes.py, float32 and bf16 autocast). Under tensor parallel: this rank's heads'."""
        m, t = cfg.mamba, x.tp
        heads, groups, chunk = m.n_heads // t, m.n_groups // t, m.chunk_size
        rows = heads * m.head_dim * 2 + 2 * groups * m.state_size + heads
        chunks = -(-x.seq // chunk)
        scan = groups * chunks * chunk * chunk + heads * chunks * (2 * chunk + m.state_size) * m.head_dim
        return x.batch * (x.seq * rows * x.bytes + scan * FP32) + output_projection_bytes(cfg, x)

    def backward_bytes(self, cfg: ModelConfig, x: ActivationLayout, freed: float) -> float:
        """An estimate: the float32 gradients of the scan's per-chunk tensors and of every chunk's state."""
        m, b, s = cfg.mamba, x.batch, x.seq
        chunk = m.chunk_size
        padded = -(-s // chunk) * chunk
        return b * m.n_heads * (padded * (2 * chunk + 3 * m.head_dim)
                                + (padded // chunk + 1) * m.head_dim * m.state_size) * FP32


register(Mamba2Kind())
