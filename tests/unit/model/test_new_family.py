"""Adding a model family takes one FamilySpec and one registry line, and nothing else in the tree.

This module declares a family meshformer does not ship — a decoder whose blocks start as the identity (every
residual branch's output projection zero-initialised, as in SkipInit / Fixup; it needs pre-norm, since a
post-norm block would normalise the identity away) — registers it with `register_family`, and then runs it
through the normal entry points: the config loader (with the family's own check), the model, the memory
planner's pipeline + tensor + FSDP path on a fake 8-rank world, and the single-process trainer (meta build,
sharded materialisation, two steps, final weights). A family table left anywhere outside the spec (a
`Literal` of family names, a default-objective or depth table) refuses or mis-sizes the new family and fails
here; `test_no_family_branches_outside_the_specs` also fails on any `family ==` / `family in` / `T[x.family]`.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from helpers.common import ROOT

from meshformer.config import ConfigError, ModelConfig, load_config
from meshformer.model import Transformer
from meshformer.model.families import FAMILIES, get_family_spec, register_family
from meshformer.model.families.common import transformer_family
from meshformer.model.families.spec import Stack
from meshformer.model.flops import count_params, decoder_flops, flops_per_token

NAME = "identity_start_decoder"
RESIDUAL_OUTPUTS = ("attn.o_proj.weight", "ffn.down_proj.weight")


def _start_as_identity(model: Transformer) -> None:
    model.init_weights()  # the shared rules first (a no-op on the meta device), then zero the residual branches
    with torch.no_grad():
        for _, block in SPEC.blocks(model):
            for name, param in block.named_parameters():
                if name.endswith(RESIDUAL_OUTPUTS):
                    param.zero_()


def _needs_pre_norm(cfg: ModelConfig) -> None:
    if cfg.norm.position != "pre":
        raise ConfigError(f"model.family={NAME!r} needs model.norm.position='pre' (a post-norm block normalises "
                          "its identity start away)", "set model.norm.position=pre")


SPEC = transformer_family(
    name=NAME,
    stacks=(Stack("decoder", causal=True, count=lambda cfg: cfg.n_layers, depth_key="model.n_layers"),),
    objectives=("causal",),
    init=_start_as_identity,
    check=_needs_pre_norm,
    training_flops=decoder_flops,
    name_maps={},
)

SMALL = [f'model.family="{NAME}"', "model.d_model=32", "model.attention.n_heads=4", "model.n_layers=2",
         "model.ffn.d_ff=64",
         "data.seq_len=32", "model.max_seq_len=32", "data.batch_size=4", "train.sample_interval=0",
         "train.eval_interval=0", "data.num_workers=0"]


@pytest.fixture
def family():
    register_family(SPEC)  # the one registry line (a shipped family adds SPEC to the tuple in families/__init__.py)
    yield SPEC
    del FAMILIES[NAME]


def test_config_loader_takes_the_family_from_the_registry(family):
    cfg = load_config("tiny-gpt", SMALL)
    assert get_family_spec(cfg.model.family) is family
    assert cfg.objective == "causal"  # "auto" picks the spec's first objective
    with pytest.raises(ConfigError, match="needs model.norm.position='pre'"):  # the family's own check runs on load
        load_config("tiny-gpt", [*SMALL, "model.norm.position=post"])
    with pytest.raises(ConfigError, match=f"does not fit model.family='{NAME}'"):
        load_config("tiny-gpt", [*SMALL, "train.objective=mlm"])
    with pytest.raises(ConfigError, match="model.n_layers must be positive"):
        load_config("tiny-gpt", [*SMALL, "model.n_layers=0"])


def test_unregistered_family_is_refused_on_load():
    with pytest.raises(ConfigError, match=f"unknown model.family '{NAME}'; registered families: \\["):
        load_config("tiny-gpt", SMALL)


def test_model_is_built_from_the_spec(family):
    cfg = load_config("tiny-gpt", SMALL).model
    model = Transformer(cfg)
    assert model.encoder_layers is None and len(model.decoder_layers) == 2
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())
    assert flops_per_token(cfg, 32) > 0
    weights = {name: param.abs().sum().item() for name, param in model.named_parameters() if name.endswith("weight")}
    assert [name for name, total in weights.items() if total == 0] == [
        f"decoder_layers.{i}.{name}" for i in range(2) for name in RESIDUAL_OUTPUTS]
    # Every block starts as the identity: the hidden states leave the stack as they entered it (before the norm).
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    h = model.embed(ids)
    model.decoder_norm = None
    assert torch.equal(model.decode(ids), h)


def test_planner_parallelises_it_on_a_fake_world(family):
    from meshformer.planner import estimate

    cfg = load_config("tiny-gpt", [*SMALL, "parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=2"])
    dims, ranks = estimate(cfg, world_size=8)
    assert (dims.pp, dims.tp, dims.dp_shard) == (2, 2, 2)
    assert [r.layers for r in ranks] == [1, 1]  # one block per pipeline stage, none dropped
    assert all(r.peak > 0 for r in ranks)


def test_trainer_trains_it(family, tmp_path):
    from meshformer.checkpointing.weights import load_weights
    from meshformer.train.trainer import Trainer

    cfg = load_config("tiny-gpt", [*SMALL, "train.steps=2", "schedule.warmup_steps=1", "logging.log_interval=1",
                                      f"logging.run_dir={tmp_path}"])
    trainer = Trainer(cfg)  # meta build + materialisation through the family's init
    for name, param in trainer.model.named_parameters():
        if name.endswith(RESIDUAL_OUTPUTS):
            assert param.abs().sum().item() == 0, name
    result = trainer.fit()
    assert math.isfinite(result.final_loss)
    trained = load_weights(tmp_path / "final")
    assert trained.cfg.family == NAME
    moved = [name for name, p in trained.named_parameters() if name.endswith(RESIDUAL_OUTPUTS) and p.abs().sum() > 0]
    assert len(moved) == 2 * len(RESIDUAL_OUTPUTS)  # every zeroed branch learned


# Conversions from foreign architectures name the family they produce; nothing else may.
CONVERSIONS = {"checkpointing/hf.py", "checkpointing/megatron.py", "checkpointing/megatron_config.py"}


def _names_family(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "family") or (isinstance(node, ast.Name)
                                                                         and node.id == "family")


def test_no_family_branches_outside_the_specs():
    package = ROOT / "meshformer"
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        if where.startswith("model/families/") or where in CONVERSIONS:
            continue
        for node in ast.walk(ast.parse(Path(path).read_text())):
            branch = isinstance(node, ast.Compare) and any(map(_names_family, [node.left, *node.comparators]))
            table = (isinstance(node, ast.Subscript) and _names_family(node.slice)
                     and not (isinstance(node.value, ast.Name) and node.value.id == "FAMILIES"))
            if branch or table:
                found.append(f"{where}:{node.lineno}")
    assert found == [], f"family knowledge outside model/families/: {found}"
