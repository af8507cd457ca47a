"""Block components (model/components/): the registry's accounting equals the reference values of 300 random
configs, a kind registered in a test alone builds, counts and gets tensor-parallel rules, and a kind that cannot run
under context parallel is refused in one line naming the layout."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping

import pytest
import torch
from helpers.common import TESTS
from helpers.component_reference import planner_config, reference
from torch import nn

from meshformer.config import Config, ConfigError
from meshformer.config.sections import DataConfig, ParallelConfig
from meshformer.model import Transformer
from meshformer.model.components import CHANNEL_MIXERS, ChannelMixer, register, unregister
from meshformer.model.components.base import ActivationLayout
from meshformer.model.config import AttentionConfig, ModelConfig
from meshformer.model.flops import count_params, training_flops
from meshformer.model.tp_styles import COLWISE, GATHER, ROWWISE
from meshformer.parallel_dims import ParallelDims, check_context_parallel
from meshformer.planner.activations import ActivationShape, block_saved, block_selective

REFERENCE = json.loads((TESTS / "fixtures" / "component_reference.json").read_text())


@pytest.mark.parametrize("start", range(0, len(REFERENCE["cases"]), 50))
def test_params_flops_and_planner_bytes_equal_the_reference(start):
    """Parameter counts, training FLOPs and each pipeline rank's activations and peak, as tests/fixtures'
    component_reference.json records them (`python tests/helpers/component_reference.py OUT.json`): a change to
    what a kind declares shows here, and the fixture is rewritten only for a change meant to alter the figures."""
    for case in REFERENCE["cases"][start:start + 50]:
        assert reference(case) == case["expected"], case


def test_layout_searches_equal_the_reference():
    """tp_template and template_shares key blocks by their kinds: the whole search's peaks are unchanged."""
    from helpers.component_reference import searched

    for name, overrides, world, layouts in REFERENCE["searches"]:
        assert searched(name, overrides, world) == layouts, (name, overrides)


def test_reference_values_can_fail():
    """The comparison sees a one-block change in what a kind declares."""
    case = REFERENCE["cases"][0]
    wider = json.loads(json.dumps(case))
    wider["model"]["ffn"]["d_ff"] += 8
    assert reference(wider) != case["expected"]


# ---------------------------------------------------------------- a toy kind, registered here alone


class ScaledUnit(nn.Module):
    """x -> down(up(x) * scale): a channel mixer with one colwise and one rowwise projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.ffn.d_ff, cfg.d_model, bias=False)
        self.scale = nn.Parameter(torch.full((cfg.ffn.d_ff,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.up_proj(x) * self.scale)


class Scaled(ChannelMixer):
    name = "toy_scaled"

    def build(self, cfg: ModelConfig) -> nn.Module:
        return ScaledUnit(cfg)

    def tp_rules(self, cfg: ModelConfig) -> Mapping[str, str]:
        return {"": GATHER, "up_proj": COLWISE, "down_proj": ROWWISE}

    def context_parallel(self, cfg: ModelConfig) -> str | None:
        return "its scale mixes the whole sequence at once"

    def params(self, cfg: ModelConfig) -> tuple[int, int]:
        n = 2 * cfg.d_model * cfg.ffn.d_ff + cfg.ffn.d_ff
        return n, n

    def flops(self, cfg: ModelConfig, tokens: int) -> int:
        return 2 * tokens * 2 * cfg.d_model * cfg.ffn.d_ff

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        return 2.0 * x.batch * x.seq * cfg.ffn.d_ff * x.bytes

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        return 1.0 * x.batch * x.seq * cfg.ffn.d_ff * x.bytes

    def backward_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        return 0.0


@pytest.fixture
def toy() -> Iterator[Scaled]:
    kind = register(Scaled())
    try:
        yield kind
    finally:
        unregister(kind.name)


def toy_config(**fields) -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=16, n_layers=2, max_seq_len=16, mlp_types=["dense", "toy_scaled"],
                       **fields)


def test_a_registered_kind_builds_and_counts(toy):
    cfg = toy_config()
    model = Transformer(cfg)
    block = model.decoder_layers["1"]  # type: ignore[index]
    assert isinstance(block.ffn, ScaledUnit) and block.mixers["ffn"] == "toy_scaled"
    assert not isinstance(model.decoder_layers["0"].ffn, ScaledUnit)  # type: ignore[index]
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())
    assert model(torch.randint(0, 64, (2, 8))).shape == (2, 8, 64)
    dense = dataclasses.replace(cfg, mlp_types=["dense"])
    scaled_flops = 3 * 2 * 8 * 2 * cfg.d_model * cfg.ffn.d_ff
    dense_flops = 3 * 2 * 8 * (3 if cfg.gated else 2) * cfg.d_model * cfg.ffn.d_ff
    assert training_flops(cfg, 8) == training_flops(dense, 8) - dense_flops + scaled_flops
    x = ActivationShape(2, 8, 1, 4, 4)
    dense_kind = CHANNEL_MIXERS["dense"]  # block 0's: the blocks differ in their channel mixer alone
    assert block_saved(cfg, x, index=1) - block_saved(cfg, x, index=0) == (toy.saved_bytes(cfg, x)
                                                                            - dense_kind.saved_bytes(cfg, x))
    assert block_selective(cfg, x, index=1) - block_selective(cfg, x, index=0) == (
        toy.selective_bytes(cfg, x) - dense_kind.selective_bytes(cfg, x))


def test_a_registered_kind_gets_its_tensor_parallel_rules(toy):
    """Applied under a fake 2-rank group on the meta device: the toy's projections are split as it declares, with no
    edit anywhere else."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from meshformer.parallel.mesh import build_mesh
    from meshformer.parallel.tensor_parallel import apply_tensor_parallel
    from meshformer.planner.shard import fake_world

    cfg = toy_config()
    with fake_world(2):
        with torch.device("meta"):
            model = Transformer(cfg)
        dims = ParallelDims.from_config(ParallelConfig(tp=2), 2)
        apply_tensor_parallel(model, build_mesh(dims, "cpu").tp)
        ffn = model.decoder_layers["1"].ffn  # type: ignore[index]
        assert isinstance(ffn.up_proj.weight, DTensor) and ffn.up_proj.weight.placements == (Shard(0),)
        assert ffn.down_proj.weight.placements == (Shard(1),)
        assert ffn.scale.placements == (Replicate(),)  # no rule: replicated like every unsplit parameter
        assert ffn.up_proj.weight.to_local().shape == (cfg.ffn.d_ff // 2, cfg.d_model)


def test_a_context_parallel_refusal_is_one_line_naming_the_layout(toy):
    cfg = Config(model=toy_config(), data=DataConfig(seq_len=16))
    dims = ParallelDims.from_config(ParallelConfig(cp=2), 2)
    with pytest.raises(ConfigError) as err:
        check_context_parallel(cfg, dims)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("parallel.cp=2: toy_scaled blocks: its scale mixes the whole sequence at once")
    assert "set parallel.cp=1" in message
    check_context_parallel(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mlp_types=[])), dims)


def test_cross_attention_refuses_context_parallel_in_one_line():
    cfg = Config(model=ModelConfig(family="encoder_decoder"), data=DataConfig(seq_len=16))
    with pytest.raises(ConfigError, match=r"^parallel\.cp=2: cross_attention blocks: context parallel is "
                                          r"implemented for decoder-only and encoder-only models") as err:
        check_context_parallel(cfg, ParallelDims.from_config(ParallelConfig(cp=2), 2))
    assert "\n" not in str(err.value)


def test_an_unregistered_kind_is_refused_by_validation():
    from meshformer.config.validate import validate

    cfg = planner_config(REFERENCE["cases"][0])
    cfg.model.mlp_types = ["toy_scaled"]
    with pytest.raises(ConfigError, match="model.mlp_types holds 'toy_scaled', not a kind meshformer builds"):
        validate(cfg)


@pytest.mark.parametrize("family", ["decoder", "encoder_decoder"])
def test_a_generation_cache_stores_what_its_kinds_declare_per_token(family):
    """After a cached forward of T tokens each block's caches hold B x T x cache_per_token elements (the
    cross-attention's: per memory position)."""
    from meshformer.model.components import TOKEN_MIXERS

    cfg = ModelConfig(family=family, vocab_size=64, d_model=32, n_layers=2, max_seq_len=16, position="rope",
                      attention=AttentionConfig(n_heads=4, n_kv_heads=2), layer_types=["full_attention"])
    model = Transformer(cfg).eval()
    cache = model.new_cache()
    ids = torch.randint(0, 64, (2, 5))
    memory = model.encode(ids)[0] if family == "encoder_decoder" else None
    model.decode(ids, memory=memory, cache=cache)
    for block, block_cache in zip(model.decoder_layers.values(), cache, strict=True):  # type: ignore[union-attr]
        for attribute, kv in (("attn", block_cache.self_attn), ("cross_attn", block_cache.cross_attn)):
            if attribute not in block.mixers:
                assert kv.k is None
                continue
            stored = kv.k.numel() + kv.v.numel()
            assert stored == 2 * 5 * TOKEN_MIXERS[block.mixers[attribute]].cache_per_token(cfg)
