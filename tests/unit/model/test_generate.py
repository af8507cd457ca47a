"""KV-cache decoding equals full-sequence decoding (float64), and greedy_decode gives the same tokens either way."""

from __future__ import annotations

import pytest
import torch

from meshformer.config.migrate import model_from_flat
from meshformer.model import Transformer
from meshformer.model.generate import greedy_decode, pad_rows

F64 = torch.float64
POSITIONS = ["sinusoidal", "learned", "rope", "alibi", "t5_relative", "none"]


pytestmark = pytest.mark.usefixtures("one_thread")



def model_for(family: str, position: str, seed: int = 0, **extra) -> Transformer:
    cfg = model_from_flat(family=family, vocab_size=40, d_model=32, n_heads=4, n_layers=2, d_ff=48, max_seq_len=20,
                          position=position, **extra)
    torch.manual_seed(seed)
    model = Transformer(cfg).to(F64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))  # sharper distributions than init, so argmax ties are unlikely
    return model


@pytest.mark.parametrize("family", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("position", POSITIONS)
def test_incremental_logits_equal_full_sequence_logits(family, position):
    extra = {"n_kv_heads": 2} if position == "rope" else {}
    if position == "alibi":
        extra["attention_window"] = 3
    if position == "t5_relative":  # 9 tokens reach the log-spaced and the clipped buckets
        extra.update(relative_buckets=6, relative_max_distance=6)
    model = model_for(family, position, **extra)
    ids = torch.randint(0, 40, (2, 9))
    memory = memory_padding = None
    if model.spec.seq2seq:
        source_padding = torch.ones(2, 6, dtype=torch.bool)
        source_padding[1, 4:] = False
        memory, memory_padding = model.encode(torch.randint(0, 40, (2, 6)), source_padding)
    with torch.no_grad():
        full = model.head(model.decode(ids, memory=memory, memory_padding=memory_padding))
        cache = model.new_cache()
        pieces = [model.head(model.decode(ids[:, :4], memory=memory, memory_padding=memory_padding, cache=cache))]
        for t in range(4, 9):  # a 4-token prefill, then one token at a time
            pieces.append(model.head(model.decode(ids[:, t:t + 1], memory=memory, memory_padding=memory_padding,
                                                  cache=cache)))
    assert cache[0].self_attn.length == 9
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("position", POSITIONS)
def test_greedy_decode_same_tokens_with_and_without_cache(position):
    decoder = model_for("decoder", position)
    prompt = torch.randint(0, 40, (3, 4))
    with_cache = greedy_decode(decoder, prompt, 12)
    assert with_cache.shape == (3, 16) and torch.equal(with_cache[:, :4], prompt)
    assert torch.equal(with_cache, greedy_decode(decoder, prompt, 12, use_cache=False))

    seq2seq = model_for("encoder_decoder", position)
    source = torch.randint(0, 40, (3, 7))
    padding = torch.ones(3, 7, dtype=torch.bool)
    padding[0, 5:] = False
    kwargs = dict(bos_id=1, source_ids=source, source_padding=padding)
    out = greedy_decode(seq2seq, None, 10, **kwargs)
    assert out.shape == (3, 11) and (out[:, 0] == 1).all()
    assert torch.equal(out, greedy_decode(seq2seq, None, 10, use_cache=False, **kwargs))


def test_greedy_decode_matches_step_by_step_argmax():
    model = model_for("decoder", "learned")
    prompt = torch.randint(0, 40, (2, 3))
    out = greedy_decode(model, prompt, 5)
    tokens = prompt
    for _ in range(5):  # the slow, obvious way
        tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, tokens)


def test_eos_stops_each_sequence():
    model = model_for("decoder", "rope")
    torch.manual_seed(0)
    prompt = torch.randint(0, 40, (4, 2))
    free = greedy_decode(model, prompt, 10)[:, 2:]

    def emits_then_moves_on(row: torch.Tensor, token: int) -> bool:
        hits = (row == token).nonzero()
        return len(hits) > 0 and bool((row[int(hits[0]):] != token).any())

    # An EOS that some row emits and then (without stopping) would follow with other tokens, while
    # another row never emits it, so decoding must run all 10 steps and fill the finished row.
    eos = next(t for t in free.unique().tolist()
               if any(emits_then_moves_on(r, t) for r in free) and any(not (r == t).any() for r in free))
    out = greedy_decode(model, prompt, 10, eos_id=eos)
    assert out.shape == (4, 12) and torch.equal(out[:, :2], prompt)
    for row, free_row in zip(out[:, 2:].tolist(), free.tolist()):
        stop = free_row.index(eos) + 1 if eos in free_row else 10
        assert row == free_row[:stop] + [eos] * (10 - stop)
    # Every row finished: decoding ends at the first EOS.
    single = greedy_decode(model, prompt[:1], 10, eos_id=int(free[0, 0]))
    assert single.tolist() == [[*prompt[0].tolist(), int(free[0, 0])]]


def test_decoding_past_max_seq_len_is_a_clear_error():
    model = model_for("decoder", "learned")
    prompt = torch.randint(0, 40, (1, 15))
    assert greedy_decode(model, prompt, 6).shape == (1, 21)  # 20 positions fed: fits exactly
    with pytest.raises(ValueError, match="max_seq_len=20"):
        greedy_decode(model, prompt, 7)
    alibi = model_for("decoder", "alibi")  # no table: free to go past max_seq_len
    assert greedy_decode(alibi, prompt, 10).shape == (1, 25)
    with pytest.raises(ValueError, match="encoder-decoder"):
        greedy_decode(model_for("encoder_decoder", "none"), prompt, 2)
    with pytest.raises(ValueError, match="encoder-only"):
        greedy_decode(model_for("encoder", "none"), prompt, 2)


def test_training_mode_is_restored():
    model = model_for("decoder", "none").train()
    greedy_decode(model, torch.zeros(1, 1, dtype=torch.long), 2)
    assert model.training


@pytest.mark.parametrize("backend", ["sdpa", "math", "blockwise"])
def test_cached_steps_align_causal_attention_at_the_bottom_right(backend):
    """A KV-cache step's queries are the last of its keys: SDPA gets torch's lower-right causal bias, the math path a
    tril(k - q) mask, the blockwise kernel its offset; each must equal the full-sequence pass."""
    model = model_for("decoder", "rope", n_kv_heads=2, attention_backend=backend)
    ids = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        full = model.head(model.decode(ids))
        cache = model.new_cache()
        steps = [model.head(model.decode(ids[:, :5], cache=cache)), model.head(model.decode(ids[:, 5:], cache=cache))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("position", POSITIONS)
def test_left_padded_prompts_decode_as_each_prompt_alone(position, use_cache):
    """Padding is never attended to and positions count from each row's first real token: a row of a left-padded
    batch gets the tokens its prompt gets unpadded (learned / sinusoidal tables and RoPE read per-row positions)."""
    extra = {"n_kv_heads": 2} if position == "rope" else {}
    model = model_for("decoder", position, **extra)
    torch.manual_seed(1)
    rows = [torch.randint(3, 40, (n,)).tolist() for n in (2, 6, 4)]
    ids, padding = pad_rows(rows, pad_id=0)
    assert padding.tolist()[0] == [False] * 4 + [True] * 2
    out = greedy_decode(model, ids, 7, prompt_padding=padding, use_cache=use_cache)
    assert out.shape == (3, 13) and torch.equal(out[:, :6], ids)
    for row, prompt in zip(out, rows):
        alone = greedy_decode(model, torch.tensor([prompt]), 7)
        assert row[6:].tolist() == alone[0, len(prompt):].tolist()


def test_bad_prompt_padding_is_refused():
    model = model_for("decoder", "rope")
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="padding on the left only"):
        greedy_decode(model, ids, 2, prompt_padding=torch.tensor([[True, True, False, True]] * 2))
    with pytest.raises(ValueError, match="at least one token"):
        pad_rows([[1, 2], []], pad_id=0)


@pytest.mark.parametrize("position", POSITIONS)
def test_right_padded_sources_decode_as_each_source_alone(position):
    model = model_for("encoder_decoder", position)
    torch.manual_seed(2)
    rows = [torch.randint(3, 40, (n,)).tolist() for n in (5, 2, 7)]
    ids, padding = pad_rows(rows, pad_id=0, left=False)
    assert padding.tolist()[1] == [True] * 2 + [False] * 5
    out = greedy_decode(model, None, 6, bos_id=1, source_ids=ids, source_padding=padding)
    for row, source in zip(out, rows):
        assert row.tolist() == greedy_decode(model, None, 6, bos_id=1, source_ids=torch.tensor([source]))[0].tolist()


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_capacity_factor_moe_generates_dropless_whatever_the_batch(use_cache):
    """Generation ignores model.moe.capacity_factor: with it, which tokens an expert drops depends on the other tokens
    of the forward (the batch's other prompts; the whole sequence, or one new token with a cache), so a prompt's
    continuation would depend on its neighbours. Training still drops."""
    from meshformer.model.moe import moe_layers

    model = model_for("decoder", "rope", n_experts=4, experts_per_token=2, capacity_factor=0.5)
    torch.manual_seed(1)
    rows = [torch.randint(3, 40, (n,)).tolist() for n in (3, 6, 5, 2)]
    ids, padding = pad_rows(rows, pad_id=0)
    model.train()
    model(ids)
    layer = next(layer for _, layer in moe_layers(model))
    assert layer.last_stats.dropped_fraction > 0.1  # the capacity bites in training
    together = greedy_decode(model, ids, 6, prompt_padding=padding, use_cache=use_cache)
    for row, prompt in zip(together, rows):
        alone = greedy_decode(model, torch.tensor([prompt]), 6, use_cache=not use_cache)
        assert row[ids.shape[1]:].tolist() == alone[0, len(prompt):].tolist()
    assert model.training and layer.drops_tokens  # restored
