"""Multi-token prediction (model/mtp.py): the objective against a hand-written reference on a tiny DeepSeek-style
model, shifted targets, gradients into the shared embedding and head, generation untouched, the last pipeline stage's
pieces, every pipeline schedule accepted."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers.common import ROOT
from torch.distributed.pipelining import PipelineStage

from meshformer.batch import IGNORE_INDEX
from meshformer.config import load_config
from meshformer.loss.cross_entropy import cross_entropy_sum
from meshformer.model.flops import count_params, training_flops
from meshformer.model.moe import Experts
from meshformer.model.mtp import shifted_labels
from meshformer.model.transformer import Transformer
from meshformer.parallel.parallel_model import ParallelModel
from meshformer.parallel.pipeline.model import shared_weights
from meshformer.parallel.pipeline.stages import TransformerStage, split_layers
from meshformer.parallel_dims import validate_parallel

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(depth: int, weight: float = 0.3, *extra: str) -> Transformer:
    cfg = load_config("tiny-deepseek", ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2",
                                        "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=32",
                                        "model.mla.qk_nope_head_dim=16",
                                        "model.moe.n_experts=4", "model.moe.d_ff=16", "model.ffn.d_ff=32",
                                        f"model.mtp.depth={depth}", f"model.mtp.loss_weight={weight}",
                                        "model.mlp_types=['dense', 'moe']", *extra]).model
    torch.manual_seed(0)
    return Transformer(cfg).train()


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 12), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
    labels[0, 5] = IGNORE_INDEX  # a document boundary in row 0
    labels[1, 9:] = IGNORE_INDEX  # padding at the end of row 1
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 10:] = False
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_shifted_labels_drop_targets_past_the_end_and_across_ignored_ones() -> None:
    labels = torch.tensor([[1, 2, 3, IGNORE_INDEX, 5, 6, 7]])
    i = IGNORE_INDEX
    assert shifted_labels(labels, 1).tolist() == [[2, 3, i, i, 6, 7, i]]
    assert shifted_labels(labels, 2).tolist() == [[3, i, i, i, 7, i, i]]


def test_objective_equals_a_hand_written_reference() -> None:
    model, batch = _model(depth=2, weight=0.5), _batch()
    loss_sum, objective = ParallelModel(model, cross_entropy_sum, torch.device("cpu"))._training_loss_sums(batch)
    ids, labels = batch["input_ids"], batch["labels"]
    # reference: the main stack by hand, then each module from its parts
    hidden = model.decode(ids, batch["attention_mask"], final_norm=False)
    main = F.cross_entropy(model.output(model.decoder_norm(hidden)).flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    assert torch.allclose(loss_sum, main, atol=1e-5)
    mtp = model.mtp_layers
    assert mtp is not None
    from meshformer.model.masks import build_mask

    mask = build_mask(12, 12, causal=True, key_padding=batch["attention_mask"])
    rope = model._relative(torch.arange(12), 12, causal=True)
    rope = {key: value for key, value in rope.items() if key != "local_rope"}
    total, h = main, hidden
    for k, module in enumerate(mtp, start=1):
        ahead = torch.cat([ids[:, k:], torch.zeros(2, k, dtype=ids.dtype)], dim=1)
        x = module.eh_proj(torch.cat([module.enorm(model.tok_embeddings(ahead)), module.hnorm(h)], dim=-1))
        h = module.block(x, mask, padding=batch["attention_mask"], documents=None, **rope)
        targets = labels.clone()
        targets = torch.cat([targets[:, k:], torch.full((2, k), IGNORE_INDEX)], dim=1)
        for j in range(k):  # a target across an ignored label (boundary, padding) is dropped
            earlier = torch.cat([labels[:, j:], torch.full((2, j), IGNORE_INDEX)], dim=1)
            targets[earlier == IGNORE_INDEX] = IGNORE_INDEX
        logits = model.output(module.final_norm(h))
        # DeepSeek-V3: each depth's mean over its own targets (fewer than the main loss's), weighted lambda / depth
        total = total + 0.5 / 2 * F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                  ignore_index=IGNORE_INDEX, reduction="mean")
    # the objective comes in units of the main loss's tokens (the trainer divides by their count)
    main_tokens = (labels != IGNORE_INDEX).sum()
    assert torch.allclose(objective / main_tokens, total - main + main / main_tokens, atol=1e-5), (objective, total)
    assert not torch.allclose(objective, loss_sum)  # the modules add something


def test_mtp_loss_reaches_the_shared_embedding_and_head_and_is_logged() -> None:
    model, batch = _model(1, 0.3, "model.tie_embeddings=false"), _batch()  # embedding and head apart
    assert model.output is not None and model.tok_embeddings is not None
    assert model.output.weight is not model.tok_embeddings.weight
    parallel = ParallelModel(model, cross_entropy_sum, torch.device("cpu"))
    _, objective = parallel._training_loss_sums(batch)
    main = parallel._loss_sum(batch)
    (objective - main).backward()  # the MTP part alone
    assert model.tok_embeddings is not None and model.tok_embeddings.weight.grad is not None
    assert model.tok_embeddings.weight.grad.abs().sum() > 0
    assert model.output is not None and model.output.weight.grad is not None
    assert model.output.weight.grad.abs().sum() > 0
    assert model.decoder_layers is not None  # the main stack learns from the modules too, through h_0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.decoder_layers.parameters())
    scalars = parallel.mtp_scalars()
    assert list(scalars) == ["mtp/loss_1"] and 0 < scalars["mtp/loss_1"] < 10
    assert parallel.mtp_scalars() == {}  # reset after logging


def test_generation_ignores_the_mtp_modules() -> None:
    with_mtp, without = _model(depth=1).eval(), _model(depth=0).eval()
    without.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp_layers.")})
    ids = _batch()["input_ids"]
    assert torch.equal(with_mtp(ids), without(ids))


def test_every_pipeline_schedule_is_accepted_and_zero_bubble_stages_keep_the_weight_pass_graph() -> None:
    from meshformer.parallel.pipeline.model import PipelineParallelModel
    from meshformer.parallel.pipeline.weight_pass import RetainedWeightGraphStage

    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"):
        cfg = load_config("tiny-deepseek", ["parallel.pp=2", f"parallel.pp_schedule={schedule}", "model.n_layers=4",
                                            "model.mlp_types=['dense', 'moe', 'moe', 'moe']", "model.mtp.depth=1",
                                            "parallel.pp_stages_per_rank=2" if "interleaved" in schedule
                                            or schedule == "zbv" else "parallel.pp_stages_per_rank=1"])
        validate_parallel(cfg, 2, "cpu")
    split = PipelineParallelModel.__new__(PipelineParallelModel)
    split.schedule_name = "zbv"
    split.__dict__["mtp_depth"] = 1  # a cached property: the model's depth
    last, middle = torch.nn.Module(), torch.nn.Module()
    last.is_last, middle.is_last = True, False
    assert split._stage_class(last, PipelineStage) is RetainedWeightGraphStage
    assert split._stage_class(middle, PipelineStage) is PipelineStage
    split.schedule_name = "1f1b"
    assert split._stage_class(last, PipelineStage) is PipelineStage


def test_last_pipeline_stage_holds_the_modules_and_an_embedding_copy_under_the_plain_names() -> None:
    model = _model(1)
    spans = split_layers(model.cfg.n_layers, 2)
    first, last = (TransformerStage(model, span) for span in spans)
    assert first.mtp_layers is None and last.mtp_layers is not None and last.tok_embeddings is not None
    names = {name for name, _ in last.canonical_parameters()}
    assert {"tok_embeddings.weight", "mtp_layers.0.eh_proj.weight"} <= names
    assert names | {name for name, _ in first.canonical_parameters()} == {name for name, _ in
                                                                          model.canonical_parameters()}
    assert shared_weights(model, spans) == {"tok_embeddings.weight": [0, 1]}  # its gradients summed over the copies
    assert torch.equal(last.tok_embeddings.weight, model.tok_embeddings.weight)  # type: ignore[union-attr]


def test_params_and_flops_count_the_modules() -> None:
    model = _model(depth=2)
    counts = count_params(model.cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["mtp"] == sum(p.numel() for p in model.mtp_layers.parameters())  # type: ignore[union-attr]
    experts = [m for m in model.mtp_layers.modules() if isinstance(m, Experts)]  # type: ignore[union-attr]
    unused = sum((4 - 2) * sum(p[0].numel() for p in e.parameters()) for e in experts)
    off = dataclasses.replace(model.cfg, mtp=dataclasses.replace(model.cfg.mtp, depth=0))
    assert counts["active"] == count_params(off)["active"] + counts["mtp"] - unused
    extra = training_flops(model.cfg, 16) - training_flops(off, 16)
    one_block = training_flops(dataclasses.replace(off, n_layers=3, mlp_types=["dense", "moe", "moe"]), 16) \
        - training_flops(off, 16)  # a third block of the last block's kinds
    head_and_projection = 3 * 2 * 16 * (64 * 32 + 2 * 32 * 32)
    assert extra == 2 * (one_block + head_and_projection)


def test_deepseek_v3_round_trip_keeps_the_mtp_layer_bitwise() -> None:
    pytest.importorskip("transformers")
    from meshformer.checkpointing.hf import config_to_hf, from_hf_state_dict, to_hf_state_dict

    model = _model(depth=1)
    with torch.no_grad():  # distinct values in every tensor, norms included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    state = to_hf_state_dict(model, "deepseek_v3")
    n = model.cfg.n_layers
    layer = {k.removeprefix(f"model.layers.{n}.") for k in state if k.startswith(f"model.layers.{n}.")}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
            "shared_head.head.weight", "self_attn.kv_b_proj.weight", "mlp.gate.weight"} <= layer
    assert torch.equal(state[f"model.layers.{n}.eh_proj.weight"], model.mtp_layers[0].eh_proj.weight)  # type: ignore[index]
    assert config_to_hf(model.cfg, "deepseek_v3").num_nextn_predict_layers == 1
    ours = from_hf_state_dict(state, model.cfg, "deepseek_v3")
    expected = model.state_dict()
    assert set(ours) == {k for k in expected if k != "output.weight"} | ({"output.weight"} & set(ours))
    assert all(torch.equal(ours[k], expected[k]) for k in ours)
    reloaded = _model(depth=1)
    reloaded.load_state_dict(ours, strict=False)
    batch = _batch()
    parallel = [ParallelModel(m, cross_entropy_sum, torch.device("cpu")) for m in (model, reloaded)]
    sums = [p._training_loss_sums(batch)[1] for p in parallel]
    assert torch.equal(sums[0], sums[1])


def test_transformers_lists_an_exported_mtp_layer_as_unexpected_and_its_logits_are_ours(tmp_path) -> None:
    """docs/model/mla.md#checkpoints: the exported layer is UNEXPECTED to transformers, which drops it; the logits
    of its main layers equal ours."""
    transformers = pytest.importorskip("transformers")
    from meshformer.checkpointing.hf_folder import export_hf

    model = _model(depth=1).eval()
    export_hf(model.state_dict(), model.cfg, tmp_path / "hf", "deepseek_v3")
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True,
                                                                    dtype=torch.float32)
    n = model.cfg.n_layers
    assert info["unexpected_keys"] and all(k.startswith(f"model.layers.{n}.") for k in info["unexpected_keys"])
    assert not info["missing_keys"]
    ids = _batch()["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(ids).logits, model(ids), rtol=1e-4, atol=1e-4)
    text = (ROOT / "docs" / "model" / "mla.md").read_text()
    assert "`UNEXPECTED`" in text and "harmless" in text
    # conversion.md's deepseek_v3 row says what the import does, as mla.md does
    row = next(line for line in (ROOT / "docs" / "model" / "conversion.md").read_text().splitlines()
               if line.startswith("| `deepseek_v3` |"))
    assert "read when `model.mtp.depth` is set" in row and "An import reads the layer when" in text
