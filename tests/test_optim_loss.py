import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from meshformer.batch import IGNORE_INDEX
from meshformer.config import OptimConfig, ScheduleConfig
from meshformer.loss import cross_entropy_sum
from meshformer.train.optim import build_optimizer, lr_multiplier


def test_noam_matches_paper_formula():
    cfg = ScheduleConfig(name="noam", warmup_steps=4000)
    for step in (0, 99, 3999, 4000, 20000):
        s = step + 1
        assert lr_multiplier(step, cfg, 100000, 512) == pytest.approx(512**-0.5 * min(s**-0.5, s * 4000**-1.5))
    peak = max(lr_multiplier(s, cfg, 100000, 512) for s in range(0, 8000, 50))
    assert peak == pytest.approx(lr_multiplier(3999, cfg, 100000, 512), rel=1e-2)


def test_cosine_warmup_then_decay_to_floor():
    cfg = ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    values = [lr_multiplier(s, cfg, 110, 64) for s in range(110)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(values[10:]))
    assert lr_multiplier(110, cfg, 110, 64) == pytest.approx(0.1)
    assert values[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_wsd_is_flat_then_decays():
    cfg = ScheduleConfig(name="wsd", warmup_steps=5, decay_fraction=0.2, min_lr_ratio=0.0)
    assert lr_multiplier(50, cfg, 100, 64) == 1.0 and lr_multiplier(79, cfg, 100, 64) == 1.0
    assert lr_multiplier(90, cfg, 100, 64) == pytest.approx(0.5)
    assert lr_multiplier(100, cfg, 100, 64) == pytest.approx(0.0)
    assert lr_multiplier(7, ScheduleConfig(name="constant", warmup_steps=5), 100, 64) == 1.0


def test_label_smoothed_loss_ignores_padding():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[1, 3:] = IGNORE_INDEX
    got = cross_entropy_sum(logits, labels, label_smoothing=0.1)
    keep = labels != IGNORE_INDEX
    logp = F.log_softmax(logits[keep].double(), -1)
    target = labels[keep]
    nll = -logp.gather(1, target[:, None]).squeeze(1)
    smooth = -logp.mean(-1)
    expected = (0.9 * nll + 0.1 * smooth).sum()
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)


def test_z_loss_adds_log_partition_penalty():
    logits = torch.randn(3, 7) * 4
    labels = torch.tensor([1, IGNORE_INDEX, 2])
    base = cross_entropy_sum(logits, labels)
    with_z = cross_entropy_sum(logits, labels, z_loss=1e-2)
    z = torch.logsumexp(logits, -1)
    assert (with_z - base).item() == pytest.approx(1e-2 * (z[0] ** 2 + z[2] ** 2).item(), rel=1e-5)


def test_optimizer_skips_decay_on_vectors_and_dedups_tied():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=True)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "norm": torch.nn.LayerNorm(4)})
    opt, kernel = build_optimizer([model], OptimConfig(weight_decay=0.1, implementation="foreach"))
    decay, no_decay = opt.param_groups
    assert kernel == "foreach"
    assert [p.shape for p in decay["params"]] == [torch.Size([10, 4])]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
