"""DeepSeek-V4 (deepseek_v4) against transformers' random-initialised tiny model whose sequences are longer than the
window, the compression windows and the indexer's top-k, with every attention kind, hash routing in the first blocks
and mHC: logits on a right-padded fp32 batch, round trips both ways, export, greedy generation, cached steps against
the whole sequence, left-padded and packed rows against each run alone; the published configs' counts; the
refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.exactness import assert_export_exact, assert_import_exact, padded_batch

from meshformer.checkpointing.hf import config_from_hf, from_hf_model, infer_arch
from meshformer.config import load_config
from meshformer.model import Transformer
from meshformer.model.flops import count_params

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, T = 512, 14
# window 4; csa entries of 2 tokens (overlapping 4), the indexer keeping 2 of up to 7; hca entries of 4 tokens
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
            partial_rotary_factor=0.25, q_lora_rank=16, o_groups=2, o_lora_rank=8, moe_intermediate_size=16,
            n_routed_experts=4, num_experts_per_tok=2, hc_mult=2, sliding_window=4, routed_scaling_factor=1.5,
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            index_n_heads=2, index_head_dim=8, index_topk=2, max_position_embeddings=64,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tiny_hf(seed: int = 0, **extra) -> torch.nn.Module:
    """Every parameter random (norms, sinks, gate biases and mHC's included); a random hash table; the routers'
    selection bias nonzero."""
    torch.manual_seed(seed)
    config = transformers.DeepseekV4Config(**{**TINY, **extra})
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15, generator=gen)
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                buffer.copy_(torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(VOCAB)]))
            elif name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1, generator=gen)
    return model


def test_import_logits_round_trip_and_export():
    """Logits within 1e-4 at the real tokens of a right-padded batch; both round trips bitwise; the compressed
    entries and the indexer's selection change the logits (they are exercised)."""
    hf = tiny_hf()
    ours = from_hf_model(hf).eval()
    assert infer_arch(ours.cfg) == "deepseek_v4"
    assert ours.cfg.layer_types == ["sliding_mqa", "csa", "hca", "csa"] and ours.cfg.residual.kind == "mhc"
    ids, mask = padded_batch(VOCAB, T, left=False)
    real = mask.bool()
    got = assert_import_exact(hf, ours, ids, mask)
    with torch.no_grad():
        a = ours.cfg.compressed_attention
        every_entry = Transformer(dataclasses.replace(ours.cfg, compressed_attention=dataclasses.replace(
            a, index_topk=7))).eval()  # the indexer keeps every csa entry
        every_entry.load_state_dict(ours.state_dict())
        zero_entries = Transformer(ours.cfg).eval()  # hca entries all zero keys and values
        zero_entries.load_state_dict(ours.state_dict())
        zero_entries.decoder_layers["2"].attn.compressor.kv_norm.weight.zero_()
        for other in (every_entry, zero_entries):
            assert (other(ids, real)[real] - got[real]).abs().max() > 1e-3
    assert_export_exact(ours, ids, mask)


def test_the_feed_forwards_limit_clamps_as_transformers_does():
    """swiglu_limit small enough that most gate and up pre-activations are clamped: still within 1e-4, the export
    carries the limit, and the clamp changes the logits (it is exercised)."""
    hf = tiny_hf(swiglu_limit=0.05)
    ours = from_hf_model(hf).eval()
    assert ours.cfg.ffn.activation == "swiglu_limited" and ours.cfg.ffn.swiglu_limit == 0.05
    ids, mask = padded_batch(VOCAB, T, left=False)
    real = mask.bool()
    got = assert_import_exact(hf, ours, ids, mask)
    unlimited = Transformer(dataclasses.replace(ours.cfg, ffn=dataclasses.replace(ours.cfg.ffn, swiglu_limit=1e9)))
    unlimited.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (unlimited.eval()(ids, real)[real] - got[real]).abs().max() > 1e-3
    assert_export_exact(ours, ids, mask)


def test_greedy_generation_equals_transformers_generate():
    """Two prompts of 9 tokens and 8 new ones (past the window and several compression windows): ours with its
    cache equals transformers' cached generate, ours without it transformers' generate over whole sequences. The two
    differ here: the indexer scores some entries exactly 0 (ReLU), and top-k breaks such ties by the length it
    scores over, in both implementations alike."""
    from meshformer.model.generate import greedy_decode

    hf = tiny_hf(seed=1)
    ours = from_hf_model(hf).eval()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    for use_cache in (True, False):
        expected = hf.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                               use_cache=use_cache)
        assert greedy_decode(ours, ids, 8, use_cache=use_cache).tolist() == expected.tolist(), use_cache
        assert len({tuple(row) for row in expected[:, 9:].tolist()}) == 2


# deepseek-ai/DeepSeek-V4-Flash and -Pro config.json values (transformers' defaults but these), both with the
# compressed blocks' YaRN below
PUBLISHED_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32.0,
                  "beta_slow": 1.0}
FLASH = dict(num_hidden_layers=43, hidden_size=4096, num_attention_heads=64, n_routed_experts=256,
             num_experts_per_tok=6, moe_intermediate_size=2048, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
             index_topk=512, layer_types=["sliding_attention"] * 2 + [
                 "compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention" for i in range(2, 43)])
PRO = dict(num_hidden_layers=61, hidden_size=7168, num_attention_heads=128, n_routed_experts=384,
           num_experts_per_tok=6, moe_intermediate_size=3072, q_lora_rank=1536, o_groups=16, o_lora_rank=1024,
           index_topk=1024)


@pytest.mark.parametrize(("name", "published", "total"), [
    ("deepseek-v4-flash", FLASH, 284e9), ("deepseek-v4-pro", PRO, 1.6e12)])
def test_bundled_config_counts_what_transformers_builds(name, published, total):
    """The bundled config is the published one imported; its count equals transformers' meta-device model's and
    the published totals within 3% (the published ones include the MTP module, which neither side builds)."""
    hf_config = transformers.DeepseekV4Config(**{**published, "rope_parameters": dict(PUBLISHED_YARN)})
    bundled = load_config(name).model
    imported = config_from_hf(hf_config)
    training_only = ("aux_loss", "aux_per_sequence", "router_bias_update_rate")
    assert imported == dataclasses.replace(bundled, moe=dataclasses.replace(
        bundled.moe, **{k: getattr(imported.moe, k) for k in training_only}))
    with torch.device("meta"):
        hf = transformers.DeepseekV4ForCausalLM(hf_config)
    counts = count_params(bundled)
    assert counts["total"] == sum(p.numel() for p in hf.parameters())
    assert abs(counts["total"] / total - 1) < 0.03, counts["total"]


# the compressed blocks' YaRN stretching 4 pretraining positions 16 times: of the two rotated pairs the faster keeps
# its frequency, the slower is divided by 16
YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4, "beta_fast": 4.0,
        "beta_slow": 1.0}


def test_compressed_blocks_yarn_equals_transformers():
    """YaRN on the compressed blocks (their queries, keys, compressed entries and indexer): logits within 1e-4 on a
    right-padded batch, greedy generation equal, the export carries it and writes it back; without it the logits
    move (it is exercised)."""
    from meshformer.model.generate import greedy_decode

    hf = tiny_hf(seed=3, rope_parameters=dict(YARN))
    assert hf.config.rope_parameters["compress"]["rope_type"] == "yarn"
    ours = from_hf_model(hf).eval()
    a = ours.cfg.compressed_attention
    assert (a.yarn_factor, a.yarn_original_max_seq_len, a.yarn_beta_fast) == (16.0, 4, 4.0)
    ids, mask = padded_batch(VOCAB, T, left=False)
    real = mask.bool()
    got = assert_import_exact(hf, ours, ids, mask)
    unscaled = Transformer(dataclasses.replace(ours.cfg, compressed_attention=dataclasses.replace(a, yarn_factor=1.0)))
    unscaled.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (unscaled.eval()(ids, real)[real] - got[real]).abs().max() > 1e-3
    assert_export_exact(ours, ids, mask)
    prompt = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    expected = hf.generate(input_ids=prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert greedy_decode(ours, prompt, 6).tolist() == expected.tolist()


@pytest.mark.parametrize(("extra", "named"), [
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ({"rope_parameters": {**YARN, "attention_factor": 1.2}}, "attention_factor=1.2"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
], ids=["kv-heads", "router", "yarn-attention-factor", "linear"])
def test_import_refuses_what_it_cannot_express(extra, named):
    with pytest.raises(ValueError, match=named):
        config_from_hf(transformers.DeepseekV4Config(**{**TINY, **extra}))


def test_plain_residuals_do_not_export():
    from meshformer.checkpointing.hf import incompatibilities

    cfg = config_from_hf(transformers.DeepseekV4Config(**TINY))
    plain = dataclasses.replace(cfg, residual=dataclasses.replace(cfg.residual, kind="plain"))
    assert "residual='plain' (needs 'mhc')" in incompatibilities(plain, "deepseek_v4")


@torch.no_grad()
def test_cached_steps_equal_the_whole_sequence_and_transformers_cached_generate():
    """Two 9-token prompts and 12 new tokens (6 csa and 3 hca windows finish while decoding): each cached step's
    logits within 1e-5 of our whole-sequence forward's last position and within 1e-4 of transformers' cached
    generate's; the greedy tokens equal. 8 index heads: with 2, entries the indexer scores exactly 0 tie, and the
    top-k's pick among them depends on the length it scores over, which differs between the prompt's pass and the
    whole sequence's (see the test above)."""
    hf = tiny_hf(seed=1, index_n_heads=8)
    ours = from_hf_model(hf).eval()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    expected = hf.generate(input_ids=ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                           use_cache=True, output_logits=True, return_dict_in_generate=True)
    cache, tokens, step = ours.new_cache(), ids, ids
    for theirs in expected.logits:
        logits = ours.head(ours.decode(step, cache=cache)[:, -1])
        whole = ours.head(ours.decode(tokens)[:, -1])
        torch.testing.assert_close(logits, whole, rtol=0, atol=1e-5)
        torch.testing.assert_close(logits, theirs, rtol=0, atol=1e-4)
        step = logits.argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, step], 1)
    assert tokens.tolist() == expected.sequences.tolist()


@torch.no_grad()
def test_left_padded_rows_equal_each_row_alone():
    """Rows of 14, 9 and 5 tokens padded on the left: each real token's logits within 1e-5 of its row's alone, the
    unpadded row's within 1e-4 of transformers'; cached greedy decoding (10 new tokens) equals transformers' cached
    generate of each row alone. transformers' own padded rows differ from their unpadded runs: its compressors pool
    windows over the pads."""
    from meshformer.model.generate import greedy_decode, pad_rows

    hf = tiny_hf(seed=1)
    ours = from_hf_model(hf).eval()
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (14, 9, 5)]
    ids, padding = pad_rows(rows, 0)
    logits = ours.head(ours.decode(ids, padding))
    positions = (padding.long().cumsum(1) - 1).clamp(min=0)
    theirs = hf(input_ids=ids, attention_mask=padding.long(), position_ids=positions).logits
    decoded = greedy_decode(ours, ids, 10, prompt_padding=padding)
    for i, row in enumerate(rows):
        alone = ours.head(ours.decode(torch.tensor([row])))[0]
        torch.testing.assert_close(logits[i, -len(row):], alone, rtol=0, atol=1e-5)
        hf_alone = hf(input_ids=torch.tensor([row])).logits[0]
        torch.testing.assert_close(alone, hf_alone, rtol=0, atol=1e-4)
        if len(row) < ids.shape[1]:
            assert (theirs[i, -len(row):] - hf_alone).abs().max() > 1e-2
        generated = hf.generate(input_ids=torch.tensor([row]), max_new_tokens=10, min_new_tokens=10,
                                do_sample=False, pad_token_id=0, use_cache=True)
        assert decoded[i, -10:].tolist() == generated[0, -10:].tolist(), i


@torch.no_grad()
def test_a_packed_row_equals_each_document_alone():
    """A row packing documents of 6, 11 and 9 tokens beside an unpacked one: each document's logits within 1e-5 of
    its own run."""
    hf = tiny_hf(seed=1)
    ours = from_hf_model(hf).eval()
    ids = torch.randint(3, VOCAB, (2, 26), generator=torch.Generator().manual_seed(5))
    documents = torch.tensor([[0] * 6 + [1] * 11 + [2] * 9, [0] * 26])
    logits = ours.head(ours.decode(ids, documents=documents))
    for row, start, n in ((0, 0, 6), (0, 6, 11), (0, 17, 9), (1, 0, 26)):
        alone = ours.head(ours.decode(ids[row:row + 1, start:start + n]))[0]
        torch.testing.assert_close(logits[row, start:start + n], alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("yarn", "named"), [
    ({"yarn_factor": 0.5}, "yarn_factor=0.5 must be >= 1"),
    ({"yarn_factor": 16.0}, "yarn_original_max_seq_len is not set"),
], ids=["factor", "original"])
def test_bad_compressed_yarn_is_refused(yarn, named):
    from meshformer.config import ConfigError, config_from_dict

    model = {"position": "none", "layer_types": ["sliding_mqa", "hca"], "norm": {"kind": "rmsnorm"},
             "compressed_attention": yarn}
    with pytest.raises(ConfigError, match=named):
        config_from_dict({"model": model})
