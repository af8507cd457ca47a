"""The chunked head loss equals the plain full-logits loss (values and gradients) and never holds full logits."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from helpers.parallel import build_cpu_plan, make_batches, make_config, new_model
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from meshformer.batch import IGNORE_INDEX, model_inputs
from meshformer.config import ConfigError
from meshformer.loss.cross_entropy import cross_entropy_sum
from meshformer.loss.fused import VocabShard, chunked_linear_cross_entropy, head_loss_fn
from meshformer.parallel_dims import ParallelDims
from meshformer.train.loss_choice import resolve_loss


def head_inputs(rows: int = 90, d: int = 24, vocab: int = 301, bias: bool = False, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(3, rows // 3, d, generator=gen).requires_grad_()
    w = (torch.randn(vocab, d, generator=gen) * 0.3).requires_grad_()
    b = (torch.randn(vocab, generator=gen) * 0.1).requires_grad_() if bias else None
    y = torch.randint(vocab, (3, rows // 3), generator=gen)
    y[:, ::5] = IGNORE_INDEX
    return h, w, b, y


def loss_and_grads(fn, h, w, b, y, scale: float = 0.37):
    loss = fn(h, w, b, y)
    params = [h, w] + ([b] if b is not None else [])
    return loss.detach(), torch.autograd.grad(loss * scale, params)  # a non-unit upstream gradient, as 1/tokens


def plain(label_smoothing, z_loss):
    return lambda h, w, b, y: cross_entropy_sum(F.linear(h, w, b), y, label_smoothing=label_smoothing, z_loss=z_loss)


def chunked(label_smoothing, z_loss, rows, recompute=False):
    return lambda h, w, b, y: chunked_linear_cross_entropy(h, y, w, b, label_smoothing=label_smoothing,
                                                           z_loss=z_loss, chunk_rows=rows, recompute=recompute)


# both chunked paths: gradients stored by the forward, or recomputed by the backward
RECOMPUTE = pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])


@pytest.mark.parametrize("label_smoothing,z_loss", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-3), (0.2, 1e-2)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [7, 64, 1000])  # uneven chunks, several chunks, a single chunk
@RECOMPUTE
def test_chunked_equals_plain_fp32(label_smoothing, z_loss, bias, rows, recompute):
    inputs = head_inputs(bias=bias)
    ref_loss, ref_grads = loss_and_grads(plain(label_smoothing, z_loss), *inputs)
    loss, grads = loss_and_grads(chunked(label_smoothing, z_loss, rows, recompute), *inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-4)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("label_smoothing,z_loss,bias", [(0.0, 0.0, False), (0.2, 1e-2, True)])
def test_recompute_equals_stored_chunked_fp32(label_smoothing, z_loss, bias):
    inputs = head_inputs(bias=bias)
    ref_loss, ref_grads = loss_and_grads(chunked(label_smoothing, z_loss, 16), *inputs)
    loss, grads = loss_and_grads(chunked(label_smoothing, z_loss, 16, recompute=True), *inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-4)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@RECOMPUTE
def test_chunked_equals_plain_under_bf16_autocast(recompute):
    """bf16 projection like nn.Linear under autocast; stated tolerance: loss 1e-3 relative, gradients 2% of norm."""
    inputs = head_inputs(rows=240, d=64, vocab=1000, bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads = loss_and_grads(plain(0.1, 1e-3), *inputs)
        loss, grads = loss_and_grads(chunked(0.1, 1e-3, 64, recompute), *inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=0)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == want.dtype
        assert (got.float() - want.float()).norm() <= 0.02 * want.float().norm()


@RECOMPUTE
def test_all_ignored_rows_give_zero_loss_and_gradients(recompute):
    h, w, b, y = head_inputs(bias=True)
    y.fill_(IGNORE_INDEX)
    loss, grads = loss_and_grads(chunked(0.1, 1e-3, 16, recompute), h, w, b, y)
    assert loss.item() == 0.0 and all(g.abs().max().item() == 0.0 for g in grads)


@RECOMPUTE
def test_evaluation_computes_no_gradients_and_the_same_loss(recompute):
    h, w, b, y = head_inputs(bias=True)
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(h, y, w, b, label_smoothing=0.1, chunk_rows=8, recompute=recompute)
        ref = cross_entropy_sum(F.linear(h, w, b), y, label_smoothing=0.1)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-4)


@RECOMPUTE
def test_peak_memory_stays_below_one_full_logits_tensor(recompute):
    """Live-tensor accounting at a Llama-1B-like head (V/D ~ 63, rows/D = 4), scaled down: plain holds several
    B·T·V tensors, chunked never one."""
    rows, d, vocab = 513, 128, 8016
    h, w, _, y = head_inputs(rows=rows, d=d, vocab=vocab)
    full_fp32_logits = h.numel() // d * vocab * 4

    def peak(fn) -> int:
        tracker = MemTracker()
        tracker.track_external(h, w, y)
        with tracker:
            fn(h, w, None, y).backward()
        h.grad = w.grad = None
        snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        other = next(k for k in snapshot if str(k).endswith("OTH"))  # the tracked inputs themselves
        return snapshot["Total"] - snapshot[other]

    plain_peak, chunked_peak = peak(plain(0.0, 0.0)), peak(chunked(0.0, 0.0, 64, recompute))
    assert plain_peak > 2 * full_fp32_logits
    assert chunked_peak < full_fp32_logits
    assert chunked_peak < 0.75 * plain_peak


@pytest.mark.parametrize("kind", ["chunked", "chunked_recompute"])
@pytest.mark.parametrize("family", ["decoder", "encoder", "encdec"])
def test_model_head_loss_matches_logits_loss(family, kind):
    """Through the whole model (tied embeddings; BERT head transform + output bias; T5 output scaling)."""
    cfg = make_config(family)
    batch = make_batches(cfg, 1)[0]
    ls, z = cfg.train.label_smoothing, cfg.train.z_loss

    def run(fused: bool):
        model = new_model(cfg)
        if fused:
            loss = model(**model_inputs(batch), labels=batch["labels"], head_loss=head_loss_fn(kind, ls, z))
        else:
            loss = cross_entropy_sum(model(**model_inputs(batch)), batch["labels"], label_smoothing=ls, z_loss=z)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (ref_loss, ref_grads), (loss, grads) = run(False), run(True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-4)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_plan_uses_the_configured_loss():
    cfg = make_config("decoder")
    assert build_cpu_plan(cfg).report["loss"] == "chunked"
    cfg.train.loss = "plain"
    plan = build_cpu_plan(cfg)
    assert plan.head_loss is None and plan.report["loss"].startswith("plain")


def test_liger_loss_runs_eagerly_inside_a_compiled_model(monkeypatch):
    """Whole-model compile must not trace into liger's kernel (dynamo failed on it under torch 2.11 on an H200)."""
    traced = []

    class FakeLiger(torch.autograd.Function):  # stands in for liger's Triton kernel: plain cross-entropy
        @staticmethod
        def forward(ctx, hidden, weight, labels, bias, *rest):
            traced.append(torch.compiler.is_compiling())
            return F.cross_entropy(hidden @ weight.t(), labels, reduction="sum")

        @staticmethod
        def backward(ctx, grad):
            return (None,) * 12

    module = types.ModuleType("liger_kernel.ops.fused_linear_cross_entropy")
    module.LigerFusedLinearCrossEntropyFunction = FakeLiger
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_linear_cross_entropy", module)
    head_loss = head_loss_fn("liger", 0.0, 0.0)
    hidden, weight, labels = torch.randn(2, 3, 8), torch.randn(11, 8), torch.randint(0, 11, (2, 3))
    compiled = torch.compile(lambda h: head_loss(h.relu(), labels, weight, None), backend="eager")
    expected = F.cross_entropy(hidden.relu().reshape(-1, 8) @ weight.t(), labels.reshape(-1), reduction="sum")
    torch.testing.assert_close(compiled(hidden), expected)
    assert traced == [False]  # called once, by the eager graph break


def test_loss_choice_is_checked_against_device_and_layout():
    cfg = make_config("decoder", loss="liger")
    single, tp, pp = ParallelDims(1, 1, 1, 1, 1, 1), ParallelDims(1, 1, 1, 1, 2, 2), ParallelDims(2, 1, 1, 1, 1, 2)
    with pytest.raises(ConfigError, match="train.loss='liger' needs CUDA"):
        resolve_loss(cfg, single, "cpu")
    cfg.parallel.pp_schedule = "zbv"
    with pytest.raises(ConfigError, match="train.loss='liger' cannot run under parallel.pp_schedule='zbv'"):
        resolve_loss(cfg, pp, "cuda")
    cfg.train.loss = "auto"
    assert resolve_loss(cfg, pp, "cpu").method == "chunked"  # the last pipeline stage runs it
    assert resolve_loss(cfg, tp, "cpu").method == "chunked"  # bound to the rank's vocabulary rows by parallelize
    cfg.train.loss = "plain"
    assert resolve_loss(cfg, pp, "cpu").bind(None).head_loss is None


def test_custom_loss_is_used_as_given_and_refused_under_tensor_parallel():
    cfg = make_config("decoder")
    custom = cross_entropy_sum
    spec = resolve_loss(cfg, ParallelDims(1, 1, 1, 1, 1, 1), "cpu", custom=custom)
    bound = spec.bind(None)
    assert bound.logits_loss is custom and bound.head_loss is None
    shard = VocabShard(None, 0, cfg.model.vocab_size)  # type: ignore[arg-type]  # binding runs no collective
    with pytest.raises(ConfigError) as err:
        spec.bind(shard)
    assert "\n" not in err.value.one_line() and "custom loss_fn" in err.value.one_line()
    assert "parallel.tp=1" in err.value.one_line()


class CountGemms(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default)
        return func(*args, **(kwargs or {}))


@RECOMPUTE
def test_zero_bubble_split_backward_matches_and_recomputes_only_what_each_pass_uses(recompute):
    """torch's zero-bubble stage backward: an input pass, then a deferred weight pass that runs the loss's node
    again. Recomputing, each pass does 2 GEMMs per chunk (logits + its own gradient), not 3."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    x, w, b, y = head_inputs(bias=True)  # x: the stage input; the stage computes hidden = 1.5 x
    ref = torch.autograd.grad(plain(0.1, 1e-3)(1.5 * x, w, b, y), [x, w, b])
    loss = chunked(0.1, 1e-3, 16, recompute)(1.5 * x, w, b, y)
    chunks = -(-y.numel() // 16)
    with CountGemms() as input_pass:
        _, param_groups = stage_backward_input([loss], None, [x], iter([w, b]))
    with CountGemms() as weight_pass:
        stage_backward_weight(iter([w, b]), param_groups)
    for got, want in zip((x.grad, w.grad, b.grad), ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    expected = 2 * chunks if recompute else 0  # the stored path only scales its stored gradients
    assert (input_pass.count, weight_pass.count) == (expected, expected)


def test_recompute_keeps_no_weight_gradient_per_microbatch_in_flight():
    """GPipe-like: four forwards before their backwards. The stored path keeps an fp32 V x D weight gradient
    (and the hidden-state gradient) per micro-batch in flight, the recomputing one an fp32 log-partition per row."""
    from meshformer.planner.measure import LiveTensorBytes

    rows, d, vocab, in_flight = 66, 32, 4000, 4
    micro = [head_inputs(rows=rows, d=d, vocab=vocab, seed=s) for s in range(in_flight)]
    weight = micro[0][1]

    def peak(recompute: bool) -> int:
        with LiveTensorBytes(weight, *(t for h, _, _, y in micro for t in (h, y))) as tracker:
            start = tracker.live
            losses = [chunked(0.1, 1e-3, 16, recompute)(h, weight, None, y) for h, _, _, y in micro]
            after_forwards = tracker.live - start
            for loss in losses:
                loss.backward()
        weight.grad = None
        for h, *_ in micro:
            h.grad = None
        return after_forwards

    stored, recomputed = peak(False), peak(True)
    assert stored >= in_flight * (vocab * d + rows * d) * 4
    assert recomputed <= in_flight * (rows * 4 + 64)  # lse and the scalar loss (+ storage rounding)
