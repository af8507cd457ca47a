"""Model components against direct float64 computations written out here, independently of the model code."""

from __future__ import annotations

import math

import pytest
import torch

from meshformer.config import AttentionConfig, FfnConfig, ModelConfig, NormConfig
from meshformer.config.migrate import model_from_flat
from meshformer.model import Transformer
from meshformer.model.attention import Attention
from meshformer.model.masks import build_mask, masked_avg_pool, pool_padding_mask
from meshformer.model.positions import (
    RelativePositionBias,
    RotaryEmbedding,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    relative_position_bucket,
    sinusoidal_table,
)

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")



def tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=50, d_model=32, n_heads=4, n_layers=2, d_ff=48, max_seq_len=24, dropout=0.0)
    return model_from_flat(**{**base, **overrides})


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg).to(F64).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up of any two tensors shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


# ----------------------------------------------------------------------------- reference attention


def allowed_matrix(batch: int, q_len: int, k_len: int, *, q_offset=0, causal=False, window=None, key_padding=None,
                   two_sided_window=True) -> torch.Tensor:
    """(B, Tq, Tk) bool from explicit loops; rows with no allowed key are opened to every key their causality allows
    (the documented rule)."""
    out = torch.zeros(batch, q_len, k_len, dtype=torch.bool)
    for b in range(batch):
        for i in range(q_len):
            qi = i + q_offset
            for j in range(k_len):
                ok = True
                if causal and j > qi:
                    ok = False
                if window is not None and abs(qi - j) >= window:
                    ok = False
                if key_padding is not None and not key_padding[b, j]:
                    ok = False
                out[b, i, j] = ok
            if not out[b, i].any():
                out[b, i] = True
                if causal:
                    out[b, i, qi + 1:] = False
    return out


def reference_attention(attn: Attention, x: torch.Tensor, allowed: torch.Tensor, memory=None, bias=None,
                        rotate=None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + bias, masked) V per head, with K/V heads shared by query-head groups."""
    src = x if memory is None else memory
    q = x @ attn.q_proj.weight.T + attn.q_proj.bias
    k = src @ attn.k_proj.weight.T + attn.k_proj.bias
    v = src @ attn.v_proj.weight.T + attn.v_proj.bias
    d = attn.head_dim
    n_heads, n_kv = q.shape[-1] // d, k.shape[-1] // d
    outs = []
    for h in range(n_heads):
        g = h // (n_heads // n_kv)  # the K/V head serving query head h
        qh, kh, vh = q[..., h * d:(h + 1) * d], k[..., g * d:(g + 1) * d], v[..., g * d:(g + 1) * d]
        if rotate is not None:
            qh, kh = rotate(qh), rotate(kh)
        scores = qh @ kh.transpose(-1, -2) / math.sqrt(d)
        if bias is not None:
            scores = scores + bias[h]
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.softmax(scores, dim=-1) @ vh)
    return torch.cat(outs, dim=-1) @ attn.o_proj.weight.T + attn.o_proj.bias


# ----------------------------------------------------------------------------- positions


def test_sinusoidal_table_matches_the_paper_formula():
    table = sinusoidal_table(20, 10).double()
    for pos in range(20):
        for i in range(5):
            angle = pos / 10000 ** (2 * i / 10)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
def test_absolute_positions_are_added_to_scaled_token_embeddings(position):
    model = build(tiny(position=position, scale_embeddings=True))
    ids = torch.randint(0, 50, (2, 7))
    table = sinusoidal_table(24, 32).double() if position == "sinusoidal" else model.pos_embeddings.weight
    expected = model.tok_embeddings.weight[ids] * math.sqrt(32) + table[3:10]
    torch.testing.assert_close(model.embed(ids, positions=torch.arange(3, 10)), expected)
    names = dict(model.named_buffers(remove_duplicate=False))
    assert (position == "sinusoidal") == ("pos_embeddings.table" in names)
    assert "pos_embeddings.table" not in model.state_dict()  # a non-persistent buffer, never trained or saved


def test_rope_rotates_half_split_pairs():
    head_dim, theta = 8, 10000.0
    x = torch.randn(1, 1, 5, head_dim, dtype=F64)
    rope = RotaryEmbedding(head_dim, 16, theta)
    out = apply_rope(x, rope(torch.arange(3, 8)))
    half = head_dim // 2
    for t in range(5):
        for i in range(half):
            angle = (t + 3) * theta ** (-2 * i / head_dim)
            a, b = x[0, 0, t, i].item(), x[0, 0, t, i + half].item()
            assert out[0, 0, t, i].item() == pytest.approx(a * math.cos(angle) - b * math.sin(angle), abs=1e-6)
            assert out[0, 0, t, i + half].item() == pytest.approx(a * math.sin(angle) + b * math.cos(angle), abs=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(8, 64)
    q, k = torch.randn(8, dtype=F64), torch.randn(8, dtype=F64)

    def score(i: int, j: int) -> float:
        qi = apply_rope(q.view(1, 1, 1, 8), rope(torch.tensor([i])))
        kj = apply_rope(k.view(1, 1, 1, 8), rope(torch.tensor([j])))
        return (qi * kj).sum().item()

    assert score(7, 3) == pytest.approx(score(40, 36), abs=1e-5)
    assert score(7, 3) != pytest.approx(score(7, 5), abs=1e-3)


def t5_bucket(relative: int, *, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """Raffel et al.'s bucket of key-minus-query distance `relative`, in Python integers and float64 logs."""
    half = num_buckets // 2 if bidirectional else num_buckets  # buckets per direction
    base = half if bidirectional and relative > 0 else 0
    n = abs(relative) if bidirectional else max(-relative, 0)
    exact = half // 2
    if n < exact:
        return base + n
    return base + min(half - 1, exact + int(math.log(n / exact) / math.log(max_distance / exact) * (half - exact)))


@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (8, 10), (16, 64), (6, 7)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_relative_buckets_follow_the_formula(num_buckets, max_distance, bidirectional):
    relative = torch.arange(-400, 401)
    got = relative_position_bucket(relative, bidirectional=bidirectional, num_buckets=num_buckets,
                                   max_distance=max_distance)
    expected = [t5_bucket(r, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
                for r in relative.tolist()]
    assert got.dtype == torch.int64 and got.tolist() == expected
    assert got.min() == 0 and got.max() == num_buckets - 1  # every distance lands in a table row


def test_t5_relative_buckets_known_values():
    def bucket(r: int, bidirectional: bool) -> int:
        return int(relative_position_bucket(torch.tensor(r), bidirectional=bidirectional, num_buckets=32,
                                            max_distance=128))

    # T5 defaults. Encoder: keys before (or at) the query use buckets 0-15, keys after it 16-31.
    assert [bucket(r, True) for r in (0, -1, -7, -8, -16, -127, -128, -1000)] == [0, 1, 7, 8, 10, 15, 15, 15]
    assert [bucket(r, True) for r in (1, 7, 8, 1000)] == [17, 23, 24, 31]
    # Decoder: only the past counts, future keys share bucket 0; 16 exact buckets, then log-spaced.
    assert [bucket(r, False) for r in (5, 0, -1, -15, -16, -32, -127, -128, -1000)] == [0, 0, 1, 15, 16, 21, 31, 31, 31]


def test_relative_position_bias_indexes_its_table_per_head():
    module = RelativePositionBias(n_heads=3, num_buckets=8, max_distance=10, bidirectional=True)
    q, k = torch.arange(2, 6), torch.arange(7)
    bias = module(q, k)
    assert bias.shape == (3, 4, 7)
    table = module.relative_bias.weight
    for i, qi in enumerate(q.tolist()):
        for j, kj in enumerate(k.tolist()):
            row = t5_bucket(kj - qi, bidirectional=True, num_buckets=8, max_distance=10)
            assert torch.equal(bias[:, i, j], table[row])


def test_alibi_slopes_follow_press_et_al():
    assert alibi_slopes(8).tolist() == pytest.approx([2.0 ** -(i + 1) for i in range(8)])
    # 12 heads: the 8-head slopes, then every other slope of the 16-head sequence.
    expected_12 = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 + i) for i in range(4)]
    assert alibi_slopes(12).tolist() == pytest.approx(expected_12)
    bias = alibi_bias(alibi_slopes(4), torch.arange(2, 5), torch.arange(5))
    for h, slope in enumerate([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]):
        for i in range(3):
            for j in range(5):
                assert bias[h, i, j].item() == pytest.approx(-slope * abs(i + 2 - j))


# ----------------------------------------------------------------------------- masks and attention


MASK_CASES = {
    "padding": dict(causal=False, padded=True),
    "causal": dict(causal=True),
    "causal+padding": dict(causal=True, padded=True),
    "window-causal": dict(causal=True, window=3),
    "window-two-sided": dict(causal=False, window=2, padded=True),
    "fully-padded-row": dict(causal=False, padded=True, empty_row=True),
    "causal-fully-padded-row": dict(causal=True, padded=True, empty_row=True),  # opened up to its own key
}


def _padding(batch: int, length: int, empty_row: bool) -> torch.Tensor:
    padding = torch.ones(batch, length, dtype=torch.bool)
    padding[0, length - 3:] = False
    if empty_row:
        padding[1] = False
    return padding


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_build_mask_matches_explicit_rules(case):
    spec = MASK_CASES[case]
    padding = _padding(2, 9, spec.get("empty_row", False)) if spec.get("padded") else None
    for q_len, q_offset in [(9, 0), (2, 7)]:  # full sequence and a KV-cache step
        mask = build_mask(q_len, 9, q_offset=q_offset, causal=spec["causal"], window=spec.get("window"),
                          key_padding=padding)
        got = mask.materialize(q_len, 9, torch.device("cpu")).expand(2, 1, q_len, 9)[:, 0]
        expected = allowed_matrix(2, q_len, 9, q_offset=q_offset, causal=spec["causal"], window=spec.get("window"),
                                  key_padding=padding)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("case", list(MASK_CASES))
def test_self_attention_with_masks_matches_reference(case, backend):
    spec = MASK_CASES[case]
    cfg = tiny(attention_backend=backend)
    attn = build(cfg).decoder_layers["0"].attn
    x = torch.randn(2, 9, 32, dtype=F64, requires_grad=True)
    padding = _padding(2, 9, spec.get("empty_row", False)) if spec.get("padded") else None
    mask = build_mask(9, 9, causal=spec["causal"], window=spec.get("window"), key_padding=padding)
    out = attn(x, mask)
    allowed = allowed_matrix(2, 9, 9, causal=spec["causal"], window=spec.get("window"), key_padding=padding)
    torch.testing.assert_close(out, reference_attention(attn, x, allowed), rtol=1e-9, atol=1e-10)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_padded_rows_never_produce_nan(backend, dtype):
    """A batch row that is all padding, through every family, with and without an ALiBi bias."""
    for family, position in [("encoder", "alibi"), ("decoder", "rope"), ("encoder_decoder", "learned")]:
        torch.manual_seed(0)
        model = Transformer(tiny(family=family, position=position, attention_backend=backend)).to(dtype)
        ids = torch.randint(0, 50, (2, 6))
        padding = torch.ones(2, 6, dtype=torch.bool)
        padding[1] = False
        logits = model(ids, padding, decoder_input_ids=ids, decoder_attention_mask=padding)
        logits.float().sum().backward()
        assert torch.isfinite(logits.float()).all()
        assert all(torch.isfinite(p.grad.float()).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_alibi_attention_matches_reference(backend):
    model = build(tiny(position="alibi", attention_backend=backend))
    attn = model.decoder_layers["0"].attn
    x = torch.randn(2, 7, 32, dtype=F64)
    padding = _padding(2, 7, False)
    bias = alibi_bias(model.alibi_slopes, torch.arange(7), torch.arange(7))
    out = attn(x, build_mask(7, 7, causal=True, key_padding=padding), bias=bias)
    slopes = [2.0 ** -(2 * (h + 1)) for h in range(4)]  # 4 heads: 2^(-8i/4)
    explicit = torch.tensor([[[-s * abs(i - j) for j in range(7)] for i in range(7)] for s in slopes], dtype=F64)
    expected = reference_attention(attn, x, allowed_matrix(2, 7, 7, causal=True, key_padding=padding), bias=explicit)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_rope_attention_matches_reference(backend):
    model = build(tiny(position="rope", attention_backend=backend))
    attn = model.decoder_layers["0"].attn
    x = torch.randn(2, 7, 32, dtype=F64)
    out = attn(x, build_mask(7, 7, causal=True), rope=model.rope(torch.arange(7)))
    d, half = 8, 4
    inv = torch.tensor([10000.0 ** (-2 * i / d) for i in range(half)], dtype=F64)
    angles = torch.arange(7, dtype=F64)[:, None] * inv[None]

    def rotate(t):  # pairs (i, i + d/2), written as complex multiplication
        z = torch.complex(t[..., :half], t[..., half:]) * torch.polar(torch.ones_like(angles), angles)
        return torch.cat([z.real, z.imag], dim=-1)

    expected = reference_attention(attn, x, allowed_matrix(2, 7, 7, causal=True), rotate=rotate)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-8)  # the cos/sin tables are stored in fp32


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_cross_attention_uses_source_padding(backend):
    model = build(tiny(family="encoder_decoder", attention_backend=backend))
    attn = model.decoder_layers["0"].cross_attn
    x, memory = torch.randn(2, 4, 32, dtype=F64), torch.randn(2, 9, 32, dtype=F64)
    padding = _padding(2, 9, empty_row=False)
    out = attn(x, build_mask(4, 9, causal=False, key_padding=padding), memory=memory)
    expected = reference_attention(attn, x, allowed_matrix(2, 4, 9, key_padding=padding), memory=memory)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-10)
    # Whole model: the decoder output does not depend on what sits in padded source positions.
    src, tgt = torch.randint(0, 50, (2, 9)), torch.randint(0, 50, (2, 4))
    changed = src.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % 50
    torch.testing.assert_close(model(src, padding, tgt), model(changed, padding, tgt), rtol=0, atol=1e-12)
    assert not torch.allclose(model(src, None, tgt), model(changed, None, tgt))


@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_grouped_and_multi_query_equal_explicitly_repeated_heads(n_kv_heads):
    gqa = build(tiny(n_kv_heads=n_kv_heads, position="rope")).decoder_layers["0"].attn
    mha = build(tiny(position="rope")).decoder_layers["0"].attn
    group, d = 4 // n_kv_heads, 8
    with torch.no_grad():
        for name in ("q_proj", "o_proj"):
            getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
        for name in ("k_proj", "v_proj"):  # head g of the GQA layer becomes heads g*group .. g*group+group-1
            src, dst = getattr(gqa, name), getattr(mha, name)
            dst.weight.copy_(src.weight.view(n_kv_heads, d, 32).repeat_interleave(group, 0).reshape(32, 32))
            dst.bias.copy_(src.bias.view(n_kv_heads, d).repeat_interleave(group, 0).reshape(32))
    x = torch.randn(2, 6, 32, dtype=F64)
    rope = RotaryEmbedding(8, 24).to(F64)(torch.arange(6))
    mask = build_mask(6, 6, causal=True)
    torch.testing.assert_close(gqa(x, mask, rope=rope), mha(x, mask, rope=rope), rtol=1e-10, atol=1e-12)
    assert gqa.k_proj.weight.shape == (n_kv_heads * d, 32)


FAMILY_CASES = [
    ("decoder", dict(position="learned")),
    ("decoder", dict(position="alibi", attention_window=4)),
    ("decoder", dict(position="rope", n_kv_heads=2)),
    ("encoder", dict(position="sinusoidal", norm_position="post", embedding_norm=True, head_transform=True)),
    ("encoder_decoder", dict(position="rope", norm="rmsnorm", activation="swiglu", cross_downsample=2)),
    ("encoder_decoder", dict(position="alibi", attention_scale=1.0, scale_output=True, bias=False)),
]


@pytest.mark.parametrize(("family", "extra"), FAMILY_CASES)
def test_sdpa_path_equals_math_path(family, extra):
    cfg = tiny(family=family, **extra)
    sdpa, math_model = build(cfg), build(tiny(family=family, attention_backend="math", **extra))
    math_model.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, 50, (3, 11))
    padding = torch.ones(3, 11, dtype=torch.bool)
    padding[0, 8:] = False
    padding[2] = False
    for mask in (None, padding):
        kwargs = dict(decoder_input_ids=ids[:, :7], decoder_attention_mask=None if mask is None else mask[:, :7])
        if not sdpa.spec.seq2seq:
            kwargs = {}
        torch.testing.assert_close(sdpa(ids, mask, **kwargs), math_model(ids, mask, **kwargs), rtol=1e-9, atol=1e-10)


def test_attention_scale_override():
    attn = build(tiny(attention_scale=0.3, attention_backend="math")).decoder_layers["0"].attn
    x = torch.randn(1, 5, 32, dtype=F64)
    out = attn(x, build_mask(5, 5, causal=False))
    # Rescaling Q by 0.3 * sqrt(d) turns the reference's 1/sqrt(d) into 0.3.
    with torch.no_grad():
        attn.q_proj.weight.mul_(0.3 * math.sqrt(8))
        attn.q_proj.bias.mul_(0.3 * math.sqrt(8))
    torch.testing.assert_close(out, reference_attention(attn, x, allowed_matrix(1, 5, 5)), rtol=1e-9, atol=1e-10)


# ----------------------------------------------------------------------------- cross_downsample


def test_pooling_of_encoder_output_and_source_mask():
    x = torch.randn(2, 7, 3, dtype=F64)
    padding = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    pooled, pooled_mask = masked_avg_pool(x, padding, 3), pool_padding_mask(padding, 3)
    assert pooled_mask.tolist() == [[True, True, False], [True, False, False]]
    torch.testing.assert_close(pooled[0, 0], x[0, 0:3].mean(0))
    torch.testing.assert_close(pooled[0, 1], x[0, 3:5].mean(0))  # the padded 6th position is left out
    torch.testing.assert_close(pooled[1, 0], x[1, 0])
    assert torch.isfinite(pooled).all()
    # In the model: encode() pools the unpooled encoder states the same way.
    model = build(tiny(family="encoder_decoder", cross_downsample=3))
    ids = torch.randint(0, 50, (2, 7))
    full, _ = model.encode(ids, padding, pool=False)
    memory, memory_padding = model.encode(ids, padding)
    assert memory.shape == (2, 3, 32) and memory_padding.tolist() == pooled_mask.tolist()
    torch.testing.assert_close(memory[0, 1], full[0, 3:5].mean(0))


@pytest.mark.parametrize("backend", ["auto", "math"])
def test_document_mask_makes_a_packed_row_equal_its_documents_run_alone(backend):
    """RoPE scores depend only on relative positions, so with attention kept inside each document every document
    of a packed row gets exactly the outputs it gets alone; without the mask the later ones see the earlier."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, max_seq_len=24, position="rope", bias=False,
                      attention=AttentionConfig(n_heads=4, n_kv_heads=2, document_mask=True, backend=backend),
                      ffn=FfnConfig(d_ff=64, activation="swiglu"), norm=NormConfig(kind="rmsnorm"))
    model = Transformer(cfg).eval()
    lengths = [5, 9, 3]
    docs = [torch.randint(0, 50, (1, n)) for n in lengths]
    packed = torch.cat(docs, dim=1)
    doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    with torch.no_grad():
        together = model(packed, doc_ids=doc_ids)
        alone = torch.cat([model(d) for d in docs], dim=1)
        model.cfg.attention.document_mask = False
        unmasked = model(packed, doc_ids=doc_ids)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    assert (unmasked[:, lengths[0]:] - alone[:, lengths[0]:]).abs().max() > 1e-2


def test_document_mask_keeps_causality_and_the_other_masks():
    documents = torch.tensor([[0, 0, 1, 1, 1, 2]])
    mask = build_mask(6, 6, causal=True, window=2, documents=documents).mask
    q, k = torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij")
    expected = (k <= q) & (q - k < 2) & (documents[0][q] == documents[0][k])
    assert torch.equal(mask[0, 0], expected)
    # a context-parallel piece (queries at positions 3, 4) reads the rows of the whole sequence's mask
    piece = build_mask(2, 6, q_positions=torch.tensor([3, 4]), causal=True, documents=documents).mask
    assert torch.equal(piece[0, 0], ((k <= q) & (documents[0][q] == documents[0][k]))[3:5])
