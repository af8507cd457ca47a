"""Mamba-2 (meshformer/model/ssd.py, model/mamba2.py): the chunked scan against the step-by-step recurrence in
float64 (outputs, final states, every gradient, packed documents); the mixer against transformers' NemotronH
Mamba2Mixer with copied weights on a padded fp32 batch and through its cache; decoding step by step equal to the
whole sequence; packed documents equal the documents one by one; initialisation, optimizer grouping, counts and
config refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.recurrent_mixer import (
    assert_cached_steps_match_transformers,
    assert_context_parallel_pieces_equal_the_whole,
    assert_gradients_reach_every_parameter,
    assert_matches_transformers_on_a_padded_batch,
    assert_packed_documents_equal_one_by_one,
)

from meshformer.config.migrate import model_from_flat
from meshformer.errors import ConfigError
from meshformer.model.config import MambaConfig, ModelConfig
from meshformer.model.linear_attention import LinearCache
from meshformer.model.mamba2 import Mamba2
from meshformer.model.ssd import chunk_ssd, recurrent_ssd

transformers = pytest.importorskip("transformers")
from transformers.models.nemotron_h import modeling_nemotron_h as hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

D, HEADS, DIM, STATE, GROUPS = 32, 4, 8, 6, 2


def scan_inputs(batch: int = 2, length: int = 13, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64, generator=g)
    return [torch.randn(batch, length, HEADS, DIM, **f64), torch.rand(batch, length, HEADS, **f64) * 0.8,
            -torch.rand(HEADS, **f64) * 2, torch.randn(batch, length, GROUPS, STATE, **f64),
            torch.randn(batch, length, GROUPS, STATE, **f64), torch.randn(batch, HEADS, DIM, STATE, **f64)]


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 64])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_scan_equals_the_recurrence_in_float64(chunk_size: int, packed: bool) -> None:
    """Outputs, final states and the gradients of x, dt, A, B, C and the initial state, with and without documents
    (one starting inside a chunk, one at a chunk's first token, a one-token one)."""
    inputs = [t.requires_grad_() for t in scan_inputs()]
    x, dt, A, B, C, state = inputs
    docs = None
    if packed:
        docs = torch.tensor([[0] * 3 + [1] * 5 + [2] + [3] * 4, [0] * 13])
    ref_y, ref_state = recurrent_ssd(x, dt, A, B, C, initial_state=state, doc_ids=docs)
    y, final = chunk_ssd(x, dt, A, B, C, chunk_size=chunk_size, initial_state=state, doc_ids=docs)
    torch.testing.assert_close(y, ref_y, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(final, ref_state, atol=1e-12, rtol=1e-10)
    g = torch.Generator().manual_seed(1)
    wy = torch.randn(y.shape, dtype=y.dtype, generator=g)
    ws = torch.randn(final.shape, dtype=y.dtype, generator=g)
    expected = torch.autograd.grad((ref_y * wy).sum() + (ref_state * ws).sum(), inputs)
    got = torch.autograd.grad((y * wy).sum() + (final * ws).sum(), inputs)
    for name, a, b in zip("x dt A B C state".split(), got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=name)


def test_documents_reset_the_state() -> None:
    """A document's outputs do not depend on the previous document nor on the initial state."""
    x, dt, A, B, C, state = scan_inputs(batch=1)
    docs = torch.tensor([[0] * 6 + [1] * 7])
    y, _ = chunk_ssd(x, dt, A, B, C, chunk_size=4, initial_state=state, doc_ids=docs)
    alone, _ = chunk_ssd(x[:, 6:], dt[:, 6:], A, B[:, 6:], C[:, 6:], chunk_size=4)
    torch.testing.assert_close(y[:, 6:], alone, atol=1e-12, rtol=1e-10)
    carried, _ = chunk_ssd(x, dt, A, B, C, chunk_size=4, initial_state=state)
    assert (carried[:, 6:] - alone).abs().max() > 1e-3


def hf_config(**extra: Any) -> Any:
    fields: dict[str, Any] = dict(
        vocab_size=40, hidden_size=D, num_hidden_layers=1, layers_block_type=["mamba"], mamba_num_heads=HEADS,
        mamba_head_dim=DIM, ssm_state_size=STATE, n_groups=GROUPS, conv_kernel=4, chunk_size=4,
        layer_norm_epsilon=1e-5, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48)
    return transformers.NemotronHConfig(**{**fields, **extra})


def ours(chunk_size: int = 4, **extra: Any) -> ModelConfig:
    return model_from_flat(d_model=D, norm="rmsnorm", norm_eps=1e-5, bias=False, layer_types=["mamba2"],
                           mamba=MambaConfig(n_heads=HEADS, head_dim=DIM, state_size=STATE, n_groups=GROUPS,
                                             chunk_size=chunk_size, dt_floor=1e-3), **extra)


def pair(chunk_size: int = 4, seed: int = 0) -> tuple[Mamba2, Any]:
    torch.manual_seed(seed)
    theirs = hf.NemotronHMamba2Mixer(hf_config(), layer_idx=0).eval()
    with torch.no_grad():
        for p in theirs.parameters():  # every weight random, A_log and D included
            p.copy_(torch.randn_like(p) * 0.3)
    mine = Mamba2(ours(chunk_size))
    loaded = mine.load_state_dict(theirs.state_dict(), strict=True)
    assert not loaded.missing_keys and not loaded.unexpected_keys
    return mine.eval(), theirs


@pytest.mark.parametrize("chunk_size", [3, 64])
def test_matches_transformers_on_a_padded_batch(chunk_size: int) -> None:
    mine, theirs = pair(chunk_size)
    assert_matches_transformers_on_a_padded_batch(mine, theirs, D)


def test_cached_prefill_and_steps_match_transformers_cache() -> None:
    mine, theirs = pair()
    cache_hf = transformers.DynamicCache(config=hf_config())
    cache = assert_cached_steps_match_transformers(mine, theirs, cache_hf, D, against_whole=False)
    assert cache.state.shape == (2, HEADS, DIM, STATE) and cache.conv.shape == (2, 3, HEADS * DIM + 2 * GROUPS * STATE)


def test_decoding_step_by_step_equals_the_whole_sequence_in_float64() -> None:
    mine, _ = pair()
    mine.double()
    x = torch.randn(2, 10, D, dtype=torch.float64)
    cache = LinearCache()
    with torch.no_grad():
        whole = mine(x)
        steps = [mine(x[:, :3], cache=cache)] + [mine(x[:, t:t + 1], cache=cache) for t in range(3, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, atol=1e-12, rtol=1e-10)


def test_packed_documents_equal_the_documents_one_by_one() -> None:
    assert_packed_documents_equal_one_by_one(pair(chunk_size=4)[0], D)


def test_gradients_reach_every_parameter() -> None:
    assert_gradients_reach_every_parameter(pair()[0], D)


def test_initialisation_optimizer_groups_and_counts() -> None:
    """A_log = log(uniform(1, 16)), D 1, softplus(dt_bias) in [1e-3, 0.1], the norm's scale 1; A_log, D, dt_bias and
    the convolution go to AdamW (vectors and a depthwise filter), in_proj and out_proj to Muon; the kind's parameter
    count is the module's."""
    from meshformer.model import Transformer
    from meshformer.model.components import TOKEN_MIXERS
    from meshformer.optim.muon import decays, is_muon_parameter

    cfg = ours(vocab_size=50, n_layers=2, n_heads=4, position="none", d_ff=48, activation="swiglu",
               norm_weight_offset=1.0)
    cfg.layer_types = ["mamba2", "full_attention"]
    model = Transformer(cfg, init_seed=3)
    mixer = model.decoder_layers["0"].attn
    assert isinstance(mixer, Mamba2) and model.decoder_layers["0"].mixers["attn"] == "mamba2"
    rate = mixer.A_log.exp()
    assert rate.min() >= 1 and rate.max() <= 16 and rate.std() > 0
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert dt.min() >= 1e-3 - 1e-7 and dt.max() <= 0.1 + 1e-7
    assert torch.equal(mixer.D, torch.ones(HEADS)) and torch.equal(mixer.norm.weight, torch.ones(HEADS * DIM))
    assert mixer.conv1d.weight.abs().max() <= 0.5 and mixer.conv1d.weight.std() > 0
    muon = {name.split(".attn.")[1] for name, p in model.named_parameters()
            if name.startswith("decoder_layers.0.attn.") and is_muon_parameter(name, p)}
    assert muon == {"in_proj.weight", "out_proj.weight"}
    no_decay = {name.split(".attn.")[1] for name, p in model.named_parameters()
                if name.startswith("decoder_layers.0.attn.") and not decays(name, p)}
    assert no_decay == {"A_log", "D", "dt_bias", "conv1d.bias", "norm.weight"}
    assert sum(p.numel() for p in mixer.parameters()) == TOKEN_MIXERS["mamba2"].params(cfg)


@pytest.mark.parametrize(("extra", "message"), [
    ({"n_groups": 3}, "n_groups=3 must divide n_heads=4"),
    ({"state_size": 0}, "state_size=0 must be positive"),
    ({"dt_floor": -1.0}, "dt_floor=-1.0 must be >= 0"),
])
def test_config_refusals(extra: dict[str, Any], message: str) -> None:
    from meshformer.config.validate import validate_model

    cfg = ours()
    for key, value in extra.items():
        setattr(cfg.mamba, key, value)
    with pytest.raises(ConfigError, match=message):
        validate_model(cfg, "test")


def test_the_scan_computes_in_float32_under_autocast() -> None:
    """Under bf16 autocast the block runs forward and backward, and the scan gives exactly its float32 result."""
    mine, _ = pair()
    mine.train()
    x = torch.randn(2, 9, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mine(x)
    out.float().square().sum().backward()
    assert out.dtype == torch.bfloat16 and all(p.grad is not None for p in mine.parameters())
    inputs = [t.float() for t in scan_inputs()[:5]]
    expected, _ = chunk_ssd(*inputs, chunk_size=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = chunk_ssd(*inputs, chunk_size=4)
    assert got.dtype == torch.float32 and torch.equal(got, expected)


def hybrid() -> ModelConfig:
    cfg = ours(chunk_size=4, vocab_size=50, n_layers=3, n_heads=4, head_dim=8, position="rope", d_ff=48,
               activation="swiglu", document_mask=True)
    cfg.layer_types = ["mamba2", "full_attention", "mamba2"]
    return cfg


def test_a_packed_hybrid_model_equals_its_documents_one_by_one() -> None:
    from meshformer.model import Transformer

    torch.manual_seed(0)
    model = Transformer(hybrid()).eval()
    lengths = [6, 2, 9]
    ids = torch.randint(0, 50, (1, sum(lengths)))
    documents = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = model(ids, doc_ids=documents)
        alone = torch.cat([model(part) for part in ids.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_greedy_generation_with_and_without_cache_is_equal() -> None:
    """Left-padded prompts of different lengths through a hybrid model: the cached state and window per step give
    the tokens recomputing the whole sequence gives."""
    from meshformer.model import Transformer
    from meshformer.model.generate import greedy_decode, pad_rows

    torch.manual_seed(1)
    model = Transformer(hybrid()).eval()
    prompt, padding = pad_rows([[3, 14, 15, 9, 2, 6], [5, 3, 5]], 0)
    with torch.no_grad():
        cached = greedy_decode(model, prompt, 8, prompt_padding=padding)
        recomputed = greedy_decode(model, prompt, 8, prompt_padding=padding, use_cache=False)
    assert cached.shape == (2, 14) and torch.equal(cached, recomputed)


def test_context_parallel_pieces_equal_the_whole_sequence() -> None:
    """One rank holding both pieces: the first piece's state and window enter the second, except where the second
    starts a document; values and gradients."""
    mine, _ = pair(chunk_size=4)
    for lengths in ([7, 1, 5, 3], [16], [8, 8]):
        assert_context_parallel_pieces_equal_the_whole(mine, lengths, D)


def test_tensor_parallel_heads_sum_to_the_whole_block() -> None:
    """Two ranks simulated in one process: each runs its heads and groups (`shard_heads`, the split parameters cut
    on dim 0, out_proj's columns cut), and their outputs add up to the whole block's, through the cache too."""
    import copy

    mine, _ = pair()
    x = torch.randn(2, 9, D)
    with torch.no_grad():
        whole = mine(x)
        parts, steps = [], []
        for rank in range(2):
            part = copy.deepcopy(mine)
            split, kept = part.shard_heads(2, rank, lambda t: t)
            assert set(kept) == {"in_proj.weight", "conv1d.weight", "conv1d.bias"}
            for name in split:
                owner, _, leaf = name.rpartition(".")
                module = part.get_submodule(owner)
                setattr(module, leaf, torch.nn.Parameter(getattr(module, leaf).chunk(2)[rank].clone()))
            part.out_proj.weight = torch.nn.Parameter(mine.out_proj.weight.chunk(2, dim=1)[rank].clone())
            parts.append(part(x))
            cache = LinearCache()
            steps.append(torch.cat([part(x[:, :5], cache=cache)] + [part(x[:, t:t + 1], cache=cache)
                                                                     for t in range(5, 9)], dim=1))
            assert cache.state is not None and cache.state.shape == (2, HEADS // 2, DIM, STATE)
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(steps[0] + steps[1], whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planner_bytes_follow_what_autograd_keeps(dtype: torch.dtype) -> None:
    """The kind's saved_bytes against the tensors the module's graph keeps (saved-tensor hooks, parameters
    excluded), in float32 and under bf16 autocast, at three shapes: within 15%."""
    from meshformer.model.components import TOKEN_MIXERS
    from meshformer.planner.activations import ActivationShape
    from meshformer.planner.measure import saved_activation_bytes

    half = dtype != torch.float32
    for heads, dim, state, groups, chunk, batch, seq in [(4, 16, 16, 1, 8, 1, 50), (4, 32, 16, 2, 64, 2, 256),
                                                          (8, 16, 64, 1, 32, 1, 300)]:
        cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, layer_types=["mamba2"],
                          mamba=MambaConfig(n_heads=heads, head_dim=dim, state_size=state, n_groups=groups,
                                            chunk_size=chunk))
        module = Mamba2(cfg)
        x = torch.randn(batch, seq, cfg.d_model).to(dtype).requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=half):
            kept = saved_activation_bytes(module, lambda m=module, x=x: m(x))
        layout = ActivationShape(batch, seq, 1, 2 if half else 4, 4)
        predicted = TOKEN_MIXERS["mamba2"].saved_bytes(cfg, layout, memory_len=0, causal=True)
        assert abs(predicted / kept - 1) < 0.15, (heads, dim, chunk, predicted, kept)
