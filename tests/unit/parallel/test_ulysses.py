"""Ulysses context parallel (parallel.cp_method="ulysses") in one process: the sequence-to-head exchange with cp
ranks simulated by threads, and the config checks. Parity against one process: tests/parity (ulysses rows)."""

from __future__ import annotations

import pytest
import torch
from helpers.ulysses_threads import run_ranks

from meshformer.config import Config, ConfigError
from meshformer.config.sections import DataConfig, OptimConfig, ParallelConfig
from meshformer.model.attention import SequenceChunk
from meshformer.model.config import AttentionConfig, LinearAttentionConfig, ModelConfig
from meshformer.parallel.context import sequence_chunk
from meshformer.parallel_dims import ParallelDims, check_context_parallel


def test_planner_counts_v4_kinds_under_ulysses_as_the_gathers_plus_queries_and_outputs() -> None:
    """DeepSeek-V4's kinds under Ulysses: the all-gathers of the key/value head, entries and indexer keys, plus the
    queries in and the output back (and CSA's picks); with one key/value head the all-gather moves less."""
    from meshformer.config import load_config
    from meshformer.planner.context_parallel_bytes import cp_costs, recommend

    cfg = load_config("tiny-v4")  # sliding_mqa, csa, hca, csa; 4 heads of 32; 128 tokens; csa: top 8 of rate 4
    gather, ulysses = cp_costs(cfg, 2, batch=1)
    n = 128 // 2
    moved = 4 * 2 * 2 * n * 4 * 32 * 4 / 2  # 4 blocks: q in, out back, both ways, half of each moved, fp32
    picks = 2 * 2 * n * 8 * 8  # 2 csa blocks: slots and flags, int64, to the other rank
    assert ulysses.refusal is None and ulysses.sent - gather.sent == moved + picks
    assert ulysses.kept - gather.kept == 4 * 2 * 4 * n * 32 * 4  # each block's queries and output, its 2 heads
    assert recommend([gather, ulysses]).method == "allgather"


@pytest.mark.parametrize("count", [2, 4])
def test_heads_of_whole_sequences_and_back(count: int) -> None:
    """Each rank's pieces (sequence_chunk's split) become its heads over the whole sequence in order, and back."""
    x = torch.randn(2, 8, 4 * count, 3)  # (B, H, T, D)
    held = [sequence_chunk({"input_ids": x.transpose(1, 2)}, r, count)["input_ids"].transpose(1, 2)
            for r in range(count)]

    def work(chunk: SequenceChunk) -> tuple[torch.Tensor, torch.Tensor]:
        heads = chunk.to_heads(held[chunk.index])
        return heads, chunk.to_sequence(heads)

    for r, (heads, back) in enumerate(run_ranks(count, work)):
        per = 8 // count
        assert torch.equal(heads, x[:, r * per:(r + 1) * per])
        assert torch.equal(back, held[r])


def ulysses_config(n_heads: int = 4, n_kv_heads: int | None = None, **model) -> Config:  # type: ignore[no-untyped-def]
    return Config(model=ModelConfig(attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads), **model),
                  data=DataConfig(seq_len=16), parallel=ParallelConfig(cp=2, cp_method="ulysses"))


def refusal(cfg: Config, cp: int = 2, tp: int = 1) -> str:
    with pytest.raises(ConfigError) as err:
        check_context_parallel(cfg, ParallelDims.from_config(ParallelConfig(cp=cp, tp=tp), cp * tp))
    message = str(err.value)
    assert "\n" not in message and "cp_method='ulysses'" in message
    return message


def test_heads_that_cp_does_not_split_are_refused_naming_the_fix() -> None:
    assert "splits each rank's 3 attention heads" in refusal(ulysses_config(n_heads=3))
    assert "n_heads=4 / tp=2" in refusal(ulysses_config(n_heads=4), cp=4, tp=2)
    # 3 key/value heads per rank against cp=2: neither divides the other
    assert "n_kv_heads=3" in refusal(ulysses_config(n_heads=6, n_kv_heads=3))
    gdn = ulysses_config(layer_types=["linear_attention"],
                         linear_attention=LinearAttentionConfig(n_heads=4, n_key_heads=1))
    assert "model.linear_attention.n_key_heads=1" in refusal(gdn)


def test_accepted_where_heads_split_and_fewer_kv_heads_repeat() -> None:
    for cfg, cp in [(ulysses_config(n_heads=4, n_kv_heads=1), 2), (ulysses_config(n_heads=8, n_kv_heads=2), 4),
                    (ulysses_config(layer_types=["mla"]), 2)]:
        check_context_parallel(cfg, ParallelDims.from_config(ParallelConfig(cp=cp), cp))


def test_what_ulysses_does_not_split_is_refused() -> None:
    assert "dsa blocks" in refusal(ulysses_config(layer_types=["dsa"]))
    assert "model.position='alibi'" in refusal(ulysses_config(position="alibi"))
    cfg = ulysses_config()
    cfg = Config(model=cfg.model, data=cfg.data, parallel=cfg.parallel, optim=OptimConfig(qk_clip_threshold=100.0))
    assert "optim.qk_clip_threshold" in refusal(cfg)
    # the all-gather method takes every one of them
    check_context_parallel(Config(model=ModelConfig(position="alibi"), data=DataConfig(seq_len=16)),
                           ParallelDims.from_config(ParallelConfig(cp=2), 2))


def test_planner_counts_both_methods_bytes_and_recommends_by_its_rule() -> None:
    from meshformer.planner.context_parallel_bytes import context_parallel_report, cp_costs, recommend

    def costs(n_kv_heads: int, cp: int, **model):  # type: ignore[no-untyped-def]
        cfg = Config(model=ModelConfig(n_layers=2, d_model=256, attention=AttentionConfig(n_heads=32,
                                                                                          n_kv_heads=n_kv_heads),
                                       **model), data=DataConfig(seq_len=1024, batch_size=1))
        return cp_costs(cfg, cp)

    gather, ulysses = costs(8, 8)
    n, d, a = 1024 // 8, 256 // 32, 4  # tokens per rank, head width, fp32
    assert gather.sent == 2 * (2 * 2 * 8 * n * d * a * 7)  # 2 layers: K and V to 7 ranks, and back in backward
    assert ulysses.sent == 2 * (2 * (2 * 32 + 2 * 8) * n * d * a * 7 / 8)  # q, k, v and out, 7/8 of each moved
    assert ulysses.kept < gather.kept  # keys and values of 1/cp of the heads rather than of all of them
    assert recommend([gather, ulysses]).method == "ulysses"
    assert recommend(costs(1, 8)).method == "allgather"  # one key/value head: the gather moves little
    assert recommend(costs(8, 2)).method == "allgather"  # cp=2: Ulysses moves queries and outputs too
    refused = costs(8, 8, layer_types=["dsa"])[1]
    assert refused.refusal is not None and recommend(costs(8, 8, layer_types=["dsa"])).method == "allgather"
    cfg = Config(model=ModelConfig(), data=DataConfig(seq_len=1024))
    rows = context_parallel_report(cfg, [(1, 1), (2, 1), (2, 1), (4, 2)], batch=1)
    assert [(r["cp"], r["tp"]) for r in rows] == [(2, 1), (4, 2)]
    assert rows[0]["configured"] == "allgather" and set(rows[0]["methods"]) == {"allgather", "ulysses"}


@pytest.mark.parametrize("count", [2, 4])
def test_mamba2_heads_of_whole_sequences_equal_the_whole_block(count: int) -> None:
    """Mamba-2 under Ulysses, ranks as threads: each runs the convolution and the scan over whole sequences of its
    run of heads and of the groups they read, with the whole sequence's padding and documents; the outputs of its
    pieces equal the single-process block's."""
    from meshformer.model.config import MambaConfig
    from meshformer.model.mamba2 import Mamba2

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, layer_types=["mamba2"],
                      mamba=MambaConfig(n_heads=8, head_dim=4, state_size=6, n_groups=4, chunk_size=4))
    module = Mamba2(cfg)
    length = 8 * count
    x = torch.randn(2, length, 32)
    padding = torch.arange(length)[None] >= torch.tensor([[0], [3]])  # the second row left-padded
    documents = (torch.rand(2, length, generator=torch.Generator().manual_seed(1)) < 0.2).long().cumsum(1)
    with torch.no_grad():
        whole = module(x, padding=padding, documents=documents)

        def work(chunk: SequenceChunk) -> tuple[torch.Tensor, torch.Tensor]:
            positions = chunk.positions(length // count, x.device)  # this rank's two pieces
            return module(x[:, positions], chunk=chunk, padding=padding[:, positions], documents=documents), positions

        for out, positions in run_ranks(count, work):
            torch.testing.assert_close(out, whole[:, positions], atol=1e-5, rtol=1e-5)


def test_mamba2_heads_or_groups_that_cp_does_not_split_are_refused() -> None:
    from meshformer.model.config import MambaConfig

    def mamba(n_heads: int, n_groups: int) -> Config:
        return Config(model=ModelConfig(layer_types=["mamba2"], position="none",
                                        mamba=MambaConfig(n_heads=n_heads, n_groups=n_groups)),
                      data=DataConfig(seq_len=16), parallel=ParallelConfig(cp=2, cp_method="ulysses"))

    assert "model.mamba.n_groups=1" in refusal(mamba(8, 1))
    assert "model.mamba.n_heads=6 / tp=2" in refusal(mamba(6, 2), tp=2)
    check_context_parallel(mamba(8, 2), ParallelDims.from_config(ParallelConfig(cp=2), 2))


def test_planner_counts_mamba2_bytes_under_both_methods() -> None:
    from meshformer.model.config import MambaConfig
    from meshformer.planner.context_parallel_bytes import cp_costs, recommend

    mamba = MambaConfig(n_heads=16, head_dim=32, state_size=64, n_groups=4)
    cfg = Config(model=ModelConfig(n_layers=1, d_model=256, layer_types=["mamba2"], position="none", mamba=mamba),
                 data=DataConfig(seq_len=1024, batch_size=1))
    gather, ulysses = cp_costs(cfg, 4)
    n, a = 1024 // 4, 4
    assert gather.sent == 2 * 7 * 2 * (16 * 32 * 64 * 4) * 3  # the fp32 state, 2 cp - 1 gathers of 2 slots, each way
    assert ulysses.sent == 2 * n * (2 * 16 * 32 + 2 * 4 * 64 + 2 * 16) * a * 3 / 4
    assert ulysses.refusal is None and recommend([gather, ulysses]).method == "ulysses"
    assert cp_costs(cfg, 8)[1].refusal is not None  # 4 groups over 8 ranks
