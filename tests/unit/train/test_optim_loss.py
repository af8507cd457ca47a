import itertools
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshformer.batch import IGNORE_INDEX
from meshformer.config import OptimConfig, ScheduleConfig
from meshformer.errors import DivergenceError
from meshformer.loss.cross_entropy import cross_entropy_sum
from meshformer.optim import AdamWConfig, build_optimizer
from meshformer.parallel.parallel_model import ParallelModel
from meshformer.train.optim import lr_multiplier
from meshformer.train.step import TrainStep


def _adamw_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for state in optimizer.state.values() for t in state.values()]


class GivenGradients(ParallelModel):
    """A plan whose backward sets the gradients a test hands it (random, with `bad` in one element)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(torch.nn.ParameterList(params), cross_entropy_sum, torch.device("cpu"))
        self.params, self.bad = params, None

    def global_token_count(self, micro_batches):
        return torch.tensor(1.0)

    def forward_backward(self, batch, global_tokens, last_micro_batch=True):
        for p in self.params:
            p.grad = torch.randn_like(p)
        if self.bad is not None:
            self.params[1].grad[0] = self.bad
        return torch.zeros(())


def given_gradients_step(kernel: str = "fused", limit: int = 1) -> tuple[GivenGradients, TrainStep]:
    torch.manual_seed(0)
    plan = GivenGradients([torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))])
    optim = OptimConfig(adamw=AdamWConfig(implementation=kernel), max_nonfinite_in_a_row=limit)
    return plan, TrainStep(plan, optim, ScheduleConfig(name="constant", warmup_steps=0), 10, d_model=1)


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_inf_nan_gradient_norm_skips_the_whole_update(kernel):
    plan, training = given_gradients_step(kernel)
    params, optimizer, updates = plan.params, training.optimizer, training.skipped_updates
    applied: list[float] = []
    training.add_post_step_hook(lambda a: applied.append(a.item()))  # e.g. the router-bias update: skipped too

    def step(bad: float | None) -> None:
        plan.bad = bad
        training.step([{}])

    step(None)
    weights, state = [p.detach().clone() for p in params], _adamw_state(optimizer)
    for bad in (float("nan"), float("inf")):
        step(bad)
        assert all(torch.equal(p, w) for p, w in zip(params, weights))  # no NaN, no decay: untouched
        assert all(torch.equal(a, b) for a, b in zip(_adamw_state(optimizer), state))  # moments and step count too
        if bad != bad:  # the first of two in a row is within the limit of 1
            assert updates.check(step=2) == 1
    with pytest.raises(DivergenceError, match="the last 2 steps .* all had an inf/nan gradient norm"):
        updates.check(step=3)
    step(None)
    assert not any(torch.equal(p, w) for p, w in zip(params, weights))  # a finite step updates again
    assert updates.check(step=4) == 0 and updates.total == 2
    assert applied == [1.0, 0.0, 0.0, 1.0]


def test_post_step_hooks_run_after_the_optimizer_step_in_order():
    plan, training = given_gradients_step()
    seen: list[tuple[str, int, bool]] = []
    before = plan.params[0].detach().clone()

    def hook(name: str):
        def run(applied: torch.Tensor) -> None:  # after the update, before zero_grad and the scheduler
            updated = not torch.equal(plan.params[0], before)
            seen.append((name, len(training.optimizer.state), updated and plan.params[0].grad is not None))
            assert applied.item() == 1.0
        return run

    training.add_post_step_hook(hook("first"))
    training.add_post_step_hook(hook("second"))
    stats = training.step([{}])
    assert seen == [("first", 2, True), ("second", 2, True)]
    assert plan.params[0].grad is None and stats.lr == training.optimizer.param_groups[0]["lr"]


def test_only_the_step_owner_writes_the_optimizers_private_attributes():
    package = Path(__file__).resolve().parents[3] / "meshformer"
    owner = package / "train" / "step.py"
    writes = re.compile(r"\.(grad_scale|found_inf)\s*=[^=]")
    found = [f"{path.relative_to(package)}:{n}" for path in sorted(package.rglob("*.py")) if path != owner
             for n, line in enumerate(path.read_text().splitlines(), 1) if writes.search(line)]
    assert found == []
    assert writes.search(owner.read_text())  # the rule would notice


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
    opt, kernel = build_optimizer([model], OptimConfig(weight_decay=0.1, adamw=AdamWConfig(implementation="foreach")))
    decay, no_decay = opt.param_groups
    assert kernel == "foreach"
    assert [p.shape for p in decay["params"]] == [torch.Size([10, 4])]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
