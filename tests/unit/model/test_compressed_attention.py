"""DeepSeek-V4's pieces (model/compressed_attention.py) against transformers 5.24's modules, fp32, random weights:
the grouped output projection, the heavily compressed attention's compressor, the attention of a sliding and of an
HCA block (whole-sequence path, sinks included) and hash routing."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4GroupedLinear,
    DeepseekV4HashRouter,
    DeepseekV4HCACompressor,
    DeepseekV4RotaryEmbedding,
)

from meshformer.model.compressed_attention import (
    CompressedAttention,
    Compressor,
    GroupedOutputProjection,
    HashRouter,
)

pytestmark = pytest.mark.usefixtures("one_thread")

D, HEADS, HEAD_DIM, ROPE = 32, 4, 16, 4


def hf_config(**fields) -> DeepseekV4Config:
    return DeepseekV4Config(hidden_size=D, num_attention_heads=HEADS, head_dim=HEAD_DIM, partial_rotary_factor=ROPE /
                            HEAD_DIM, q_lora_rank=16, o_groups=2, o_lora_rank=8, num_hidden_layers=1, vocab_size=64,
                            n_routed_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6, index_n_heads=2,
                            index_head_dim=8, index_topk=2,
                            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 4},
                            **fields)


def randomise(module: nn.Module) -> None:
    for p in module.parameters():
        nn.init.normal_(p, std=0.3)


@torch.no_grad()
def test_grouped_output_projection_equals_transformers():
    torch.manual_seed(0)
    cfg = hf_config()
    theirs_a = DeepseekV4GroupedLinear(HEADS * HEAD_DIM // 2, 2 * 8, 2)
    theirs_b = nn.Linear(2 * 8, D, bias=False)
    ours = GroupedOutputProjection(HEADS * HEAD_DIM, groups=cfg.o_groups, rank=cfg.o_lora_rank, d_model=D)
    randomise(theirs_a), randomise(theirs_b)
    ours.o_a_proj.copy_(theirs_a.weight), ours.o_b_proj.weight.copy_(theirs_b.weight)
    x = torch.randn(2, 5, HEADS * HEAD_DIM)
    expected = theirs_b(theirs_a(x.reshape(2, 5, 2, -1)).flatten(2))
    torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="groups"):
        GroupedOutputProjection(30, groups=4, rank=2, d_model=D)


@torch.no_grad()
def test_heavy_compressor_equals_transformers_over_a_sequence_longer_than_its_windows():
    """Eleven tokens at rate 4: two whole windows (the third, partial, is left out), rotated at positions 0 and 4;
    each query sees a window only once it has passed its end."""
    torch.manual_seed(1)
    cfg = hf_config()
    theirs = DeepseekV4HCACompressor(cfg)
    randomise(theirs)
    ours = Compressor(D, HEAD_DIM, rate=4, rope_dim=ROPE, rope_theta=cfg.compress_rope_theta, eps=1e-6)
    ours.load_state_dict({k: v for k, v in theirs.state_dict().items() if "rotary" not in k})
    x = torch.randn(2, 11, D)
    positions = torch.arange(11)
    compressed, bias = theirs(x, None, positions[None].expand(2, -1), None, 0)
    ours_kv, visible = ours(x, positions)
    assert ours_kv.shape == (2, 2, HEAD_DIM)
    torch.testing.assert_close(ours_kv, compressed[:, 0], rtol=0, atol=1e-5)
    assert torch.equal(visible, bias[0, 0] == 0)
    assert visible[3].tolist() == [True, False] and not visible[2].any() and visible[10].all()


@torch.no_grad()
def test_hash_router_equals_transformers():
    """Fixed experts per token id (the table a checkpoint ships); the gate's sqrt-softplus scores weigh them."""
    torch.manual_seed(2)
    cfg = hf_config()
    theirs = DeepseekV4HashRouter(cfg)
    randomise(theirs)
    theirs.tid2eid.copy_(torch.stack([torch.randperm(8)[:2] for _ in range(64)]))
    ours = HashRouter(D, n_experts=8, top_k=2, vocab_size=64, scale=cfg.routed_scaling_factor)
    ours.weight.copy_(theirs.weight), ours.experts_of_token.copy_(theirs.tid2eid)
    x, ids = torch.randn(2, 5, D), torch.randint(0, 64, (2, 5))
    _, expected_weights, expected_indices = theirs(x, ids)
    weights, indices = ours(x, ids)
    assert torch.equal(indices, expected_indices)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=1e-6)


@pytest.mark.parametrize("layer_type", ["sliding_attention", "heavily_compressed_attention",
                                        "compressed_sparse_attention"])
@torch.no_grad()
def test_attention_equals_transformers(layer_type):
    """Seventeen tokens, window 3, compression rate 4: the sliding branch leaves out most of the past; the
    compressed entries bring back the finished windows, all of them (HCA) or the indexer's top 2 of up to 4 (CSA,
    overlapping windows); sinks and the grouped output projection included."""
    torch.manual_seed(3)
    cfg = hf_config(sliding_window=3, layer_types=[layer_type])
    cfg._attn_implementation = "eager"
    theirs = DeepseekV4Attention(cfg, 0)
    randomise(theirs)
    ours = CompressedAttention(D, HEADS, HEAD_DIM, q_rank=16, rope_dim=ROPE, window=3, groups=2, o_rank=8, eps=1e-6,
                               rope_theta=cfg.rope_theta, compress_theta=cfg.compress_rope_theta,
                               compress_rate=4 if theirs.compressor is not None else None,
                               index=(2, 8, 2) if layer_type == "compressed_sparse_attention" else None)
    names = {"o_a_proj.weight": "output.o_a_proj", "o_b_proj.weight": "output.o_b_proj.weight"}
    ours.load_state_dict({names.get(k, k).replace("compressor.indexer.scorer.", "indexer.")
                          .replace("compressor.indexer.", "indexer."): v
                          for k, v in theirs.state_dict().items() if "rotary" not in k})
    length = 17
    x, positions = torch.randn(2, length, D), torch.arange(length)
    distance = positions[:, None] - positions[None, :]
    mask = torch.zeros(length, length).masked_fill((distance < 0) | (distance >= 3), float("-inf"))
    rotary = DeepseekV4RotaryEmbedding(cfg)
    tables = {kind: rotary(x, position_ids=positions[None], layer_type=kind) for kind in ("main", "compress")}
    expected, _ = theirs(x, tables, positions[None].expand(2, -1), mask.expand(2, 1, -1, -1))
    torch.testing.assert_close(ours(x, positions), expected, rtol=0, atol=1e-5)


def test_the_cache_bench_counts_each_layer_kind(tmp_path):
    """bench/v4_cache_bytes.py: a sliding window's last window - 1 keys, one entry per HCA window, one entry and one
    indexer key per CSA window, each compressor's unfinished window (projections and gates: CSA's of both halves,
    and the last finished window's first halves); V3 a latent and a rotary key per token; its table loads."""
    from types import SimpleNamespace

    from helpers.common import load_script
    from transformers import DeepseekV4Config

    bench = load_script("bench/v4_cache_bytes.py")
    v4 = DeepseekV4Config(num_hidden_layers=2, layer_types=["heavily_compressed_attention",
                                                            "compressed_sparse_attention"],
                          mlp_layer_types=["moe", "moe"], sliding_window=8, head_dim=8, index_head_dim=4,
                          partial_rotary_factor=0.5,
                          compress_rates={"heavily_compressed_attention": 16, "compressed_sparse_attention": 4})
    hca = 7 * 8 + 2 * 8 + 2 * 16 * 8
    csa = 7 * 8 + 8 * (8 + 4) + (2 * 4 * 16 + 2 * 4 * 8) + (2 * 4 * 8 + 2 * 4 * 4)
    assert bench.v4_elements(v4, 32) == hca + csa
    v3 = SimpleNamespace(num_hidden_layers=3, kv_lora_rank=5, qk_rope_head_dim=1)
    assert bench.v3_elements(v3, 32) == 3 * 32 * 6
    columns, rows = bench.table(bench.rows(v3, v4))
    load_script("bench/tables.py").write_table(tmp_path / "architectures-07-v4-cache.json", machine="counted",
                                               page="architectures", title="t",
                                               command="python bench/v4_cache_bytes.py", columns=columns, rows=rows)
    assert load_script("bench/render_tables.py").load_tables(tmp_path)[0]["rows"][0][0] == "4,096"


def attention(kind: str, rate: int = 4, window: int = 3) -> CompressedAttention:
    torch.manual_seed(4)
    module = CompressedAttention(D, HEADS, HEAD_DIM, q_rank=16, rope_dim=ROPE, window=window, groups=2, o_rank=8,
                                 eps=1e-6, rope_theta=1e4, compress_theta=1.6e5,
                                 compress_rate=None if kind == "sliding" else rate,
                                 index=(2, 8, 2) if kind == "csa" else None)
    randomise(module)
    return module


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_queries_in_blocks_equal_one_block(kind, monkeypatch):
    """Blocks of 3 queries (each against its window's keys and its entries) give the outputs and gradients of one
    block of all 19 (transformers' equality is checked on one block above)."""
    module = attention(kind)
    x = torch.randn(2, 19, D, requires_grad=True)
    whole = module(x, torch.arange(19))
    grads = torch.autograd.grad(whole.square().sum(), [x, *module.parameters()], allow_unused=True)
    monkeypatch.setattr(CompressedAttention, "query_block", 3)
    blocks = module(x, torch.arange(19))
    torch.testing.assert_close(blocks, whole, rtol=0, atol=1e-6)
    for a, b in zip(torch.autograd.grad(blocks.square().sum(), [x, *module.parameters()], allow_unused=True), grads,
                    strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def threaded_pieces(module: nn.Module, x: torch.Tensor, count: int) -> torch.Tensor:
    """The module run as `count` context-parallel ranks in threads, each on its two pieces of x with an all-gather
    between the threads, the outputs put back in sequence order."""
    from helpers.allgather_threads import in_order, pieces, run_ranks

    def rank(chunk):  # type: ignore[no-untyped-def]
        mine = pieces(x, chunk)
        return module(mine, chunk.positions(mine.shape[1], mine.device), chunk=chunk)

    return in_order(run_ranks(count, rank))


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
@torch.no_grad()
def test_context_parallel_pieces_equal_the_whole_sequence(kind):
    """Two and four ranks' pieces of 24 tokens (pieces of 6 and 3; rate 3: an entry's window inside each piece, CSA's
    overlapping window reaching into the previous piece, held by another rank or, for the late piece, the same rank;
    window 5 across piece boundaries) against one process."""
    module = attention(kind, rate=3, window=5)
    x = torch.randn(2, 24, D)
    whole = module(x, torch.arange(24))
    for count in (2, 4):
        torch.testing.assert_close(threaded_pieces(module, x, count), whole, rtol=0, atol=1e-6)


def test_context_parallel_refuses_pieces_that_cut_a_window():
    from meshformer.errors import ConfigError

    module = attention("hca", rate=4)
    with pytest.raises(ConfigError, match="multiple of 2 x parallel.cp x 4"):
        threaded_pieces(module, torch.randn(1, 12, D), 2)  # pieces of 3 tokens
