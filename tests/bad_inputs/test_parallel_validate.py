"""Bad layouts fail with a ConfigError naming the key, before any process group exists."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.parallel import make_config

from meshformer.config import ConfigError
from meshformer.config.migrate import with_dotted
from meshformer.parallel.pipeline.stages import split_layers, stage_ids_for_rank
from meshformer.parallel_dims import ParallelDims, bf16_supported, n_microbatches, validate_parallel


def bad(family: str = "decoder", world: int = 2, device: str = "cpu", **parallel) -> str:
    cfg = make_config(family, parallel)
    with pytest.raises(ConfigError) as err:
        validate_parallel(cfg, world, device)
    assert not dist.is_initialized()
    return str(err.value)


def test_dims_resolve_the_rest_of_the_world():
    dims = validate_parallel(make_config("decoder", {"pp": 2, "tp": 2}), 8, "cpu")
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 1, 2, 2)
    assert dims.fsdp_enabled and not dims.hsdp
    hsdp = ParallelDims.from_config(make_config("decoder", {"dp_replicate": 2}).parallel, 8)
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.dp) == (2, 4, 8) and hsdp.hsdp


def test_mesh_product_must_equal_world_size():
    assert "= 8 processes, but the world has 4" in bad(world=4, pp=2, tp=2, dp_shard=2)
    assert "does not divide the world size 6" in bad(world=6, pp=4)
    assert "parallel.tp must be >= 1" in bad(tp=0)


@pytest.mark.parametrize(("model", "key"), [
    ({"attention.n_heads": 6, "attention.n_kv_heads": None, "d_model": 48}, "model.attention.n_heads"),
    ({"attention.n_kv_heads": 2}, "model.attention.n_kv_heads"),
    ({"attention.n_kv_heads": None, "ffn.d_ff": 66}, "model.ffn.d_ff"),
    ({"attention.n_kv_heads": None, "vocab_size": 66}, "model.vocab_size"),
])
def test_tp_must_divide_heads_kv_heads_ffn_and_vocab(model, key):
    cfg = make_config("decoder", {"tp": 4})
    cfg.model = with_dotted(cfg.model, model)
    with pytest.raises(ConfigError, match=f"does not divide {key}"):
        validate_parallel(cfg, 4, "cpu")


def test_tp_must_divide_sequence_lengths():
    cfg = make_config("encdec", {"tp": 2})
    cfg.data.target_len = 7
    with pytest.raises(ConfigError, match="data.target_len"):
        validate_parallel(cfg, 2, "cpu")


def test_pipeline_needs_a_layer_per_stage():
    assert "8 pipeline stages, but the model has only 4 layers" in bad(world=4, pp=4, pp_schedule="zbv")
    assert "5 pipeline stages" not in bad(world=8, pp=8, pp_schedule="1f1b")  # 8 stages > 4 layers
    assert "pp_split_points" in bad(pp=2, pp_split_points=[0])
    assert "pp_split_points" in bad(pp=2, pp_split_points=[1, 2])


def test_too_few_microbatches_for_the_schedule():
    assert "needs at least pp=4 microbatches" in bad(world=4, pp=4, pp_microbatches=2)
    assert "multiple of pp=2" in bad(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, pp_microbatches=5)
    assert "data.batch_size=8 is smaller than the 16" in bad(pp=2, pp_microbatches=16)
    assert "pp_stages_per_rank=1" in bad(pp=2, pp_schedule="1f1b", pp_stages_per_rank=2)
    cfg = make_config("decoder", {"pp": 2, "pp_schedule": "zbv"})
    assert n_microbatches(cfg) == 4  # default: one per stage, 2 stages per rank in a V


def test_selective_recompute_rejected_with_zero_bubble():
    assert "zero-bubble" in bad(pp=2, pp_schedule="zbv", recompute="selective")


@pytest.mark.parametrize("recompute", ["full", "every_k"])
@pytest.mark.parametrize(("family", "parallel"), [("decoder", {"tp": 2}), ("moe", {"dp_shard": 2, "ep": 2})])
def test_compiled_full_recompute_of_distributed_weights_is_refused_before_torch_fails(recompute, family, parallel):
    """torch 2.13 fails inside its compiled backward (a device mesh among the saved tensors); selective works."""
    for mode in ("blocks", "model"):
        cfg = make_config(family, {**parallel, "recompute": recompute}, compile=mode)
        with pytest.raises(ConfigError, match="use parallel.recompute='selective'"):
            validate_parallel(cfg, 2, "cpu")
    validate_parallel(make_config(family, {**parallel, "recompute": "selective"}, compile="blocks"), 2, "cpu")
    validate_parallel(make_config(family, {**parallel, "recompute": recompute}), 2, "cpu")  # eager: fine


def test_context_parallel_layouts():
    """decoder- and encoder-only, any composition with FSDP/HSDP, TP and PP; sequences split evenly."""
    dims = validate_parallel(make_config("decoder", {"cp": 2}), 8, "cpu")
    assert (dims.dp_shard, dims.cp, dims.dp) == (4, 2, 4) and dims.fsdp_enabled and dims.cp_enabled
    only_cp = validate_parallel(make_config("decoder", {"cp": 2}), 2, "cpu")
    assert only_cp.dp == 1 and only_cp.fsdp_enabled  # FSDP over the 2 context-parallel ranks
    assert "not 'encoder_decoder'" in bad("encdec", cp=2)
    assert validate_parallel(make_config("encoder", {"cp": 2}), 2, "cpu").cp_enabled
    full = validate_parallel(make_config("decoder", {"cp": 2, "tp": 2, "pp": 2}), 16, "cpu")
    assert (full.pp, full.dp_shard, full.cp, full.tp) == (2, 2, 2, 2)
    assert "not divisible" in bad(world=3, cp=3)  # the harness's seq_len is 16: not 6 pieces



def test_bf16_rejected_on_a_device_without_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not bf16_supported("cuda") and bf16_supported("cpu")
    cfg = make_config("decoder", {}, dtype="bf16")
    with pytest.raises(ConfigError, match="no bf16 support"):
        validate_parallel(cfg, 1, "cuda")
    assert "configure FSDP" in bad(world=2, tp=2, mixed_precision_param="bf16")


def test_init_distributed_validates_before_joining(monkeypatch):
    from meshformer.runtime.distributed import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    cfg = make_config("decoder", {"tp": 2})
    with pytest.raises(ConfigError):
        init_distributed(cfg)  # would otherwise wait for 2 more processes
    assert not dist.is_initialized()


def test_even_and_manual_layer_splits():
    assert [(s.start, s.stop) for s in split_layers(10, 4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [(s.start, s.stop) for s in split_layers(4, 2, [3])] == [(0, 3), (3, 4)]
    assert stage_ids_for_rank(1, 4, 2, v_shape=False) == [1, 5]
    assert stage_ids_for_rank(1, 4, 2, v_shape=True) == [1, 6]


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2}])
def test_t5_relative_bias_refuses_tensor_and_pipeline_parallel(parallel):
    cfg = make_config("encdec", parallel)
    cfg.model.position = "t5_relative"
    with pytest.raises(ConfigError, match="t5_relative position bias is not supported with tensor/pipeline"):
        validate_parallel(cfg, 2, "cpu")
    cfg.parallel = make_config("encdec").parallel  # FSDP over both ranks: the tables are ordinary parameters
    assert validate_parallel(cfg, 2, "cpu").fsdp_enabled


def test_trainer_checks_the_layout_before_building_the_model(monkeypatch, tmp_path):
    """A layout that cannot run fails before any model is built (let alone sharded)."""
    import meshformer.train.setup as setup_module
    import meshformer.train.trainer as trainer_module
    from meshformer.config import load_config

    built: list = []
    monkeypatch.setattr(setup_module, "Transformer", lambda cfg: built.append(cfg))
    cfg = load_config("tiny-gpt", ["parallel.tp=2", f"logging.run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="does not divide the world size 1"):
        trainer_module.Trainer(cfg)
    assert not built


def test_context_parallel_with_sequence_parallel_needs_an_even_split_per_rank():
    from meshformer.config import load_config

    cfg = load_config("meshformer/configs/llama-8b.toml", ["parallel.cp=2", "parallel.tp=8", "data.seq_len=8136"])
    with pytest.raises(ConfigError, match="multiple of cp x tp = 16"):  # 4068 tokens per rank over 8 TP ranks
        validate_parallel(cfg, 16, "cpu")
    validate_parallel(load_config("meshformer/configs/llama-8b.toml", ["parallel.cp=2", "parallel.tp=8"]), 16, "cpu")


def test_context_parallel_chunks_keep_the_padding_mask_and_refuse_uneven_batches():
    from meshformer.parallel.context import sequence_chunk

    ids = torch.arange(12).view(2, 6)
    chunk = sequence_chunk({"input_ids": ids, "labels": ids + 1}, 0, 3)  # 6 pieces of one token: 0 and 5
    assert chunk["input_ids"].tolist() == [[0, 5], [6, 11]] and chunk["labels"].tolist() == [[1, 6], [7, 12]]
    padding = ids > 0
    assert sequence_chunk({"input_ids": ids, "attention_mask": padding}, 0, 3)["attention_mask"] is padding  # keys
    with pytest.raises(ValueError, match="multiple of 2 x cp"):
        sequence_chunk({"input_ids": ids}, 0, 2)


def test_context_parallel_pieces_balance_causal_work():
    """Every rank's queries see the same number of keys in total (contiguous chunks would give rank r 2r+1 times
    rank 0's), and the pieces of all ranks tile the sequence once."""
    from meshformer.model.attention import pieces_held

    for cp in (2, 4, 8):
        local = 2 * 16
        spans = [pieces_held(rank, cp, local) for rank in range(cp)]
        work = {sum(n * (at + n) for _, n, at in rank_spans) for rank_spans in spans}
        assert len(work) == 1, work
        starts = sorted(at for rank_spans in spans for _, _, at in rank_spans)
        assert starts == list(range(0, cp * local, 16))
