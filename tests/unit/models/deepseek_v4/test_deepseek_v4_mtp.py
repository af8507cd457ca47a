"""DeepSeek-V4's multi-token prediction module beside mHC (model/mtp.py `HyperMtpModule`): the published
checkpoint's mtp.0.* names and shapes, round trips bitwise (state dicts and an HF folder), a forward computed by hand
from its parts with transformers' own V4 block as the block, its loss through the objective, and the refusals.
transformers builds no V4 MTP module, so its forward is checked against that reference rather than against a model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from meshformer.batch import IGNORE_INDEX
from meshformer.checkpointing.hf import config_to_hf, from_hf_model, from_hf_state_dict, to_hf_state_dict
from meshformer.config import ConfigError, config_from_dict
from meshformer.model import Transformer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, T, D, STREAMS = 256, 10, 32, 2
TINY = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
            partial_rotary_factor=0.25, q_lora_rank=16, o_groups=2, o_lora_rank=8, moe_intermediate_size=16,
            n_routed_experts=4, num_experts_per_tok=2, hc_mult=STREAMS, sliding_window=4, routed_scaling_factor=1.5,
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            index_n_heads=2, index_head_dim=8, index_topk=2, max_position_embeddings=64,
            layer_types=["sliding_attention", "heavily_compressed_attention"], mlp_layer_types=["hash_moe", "moe"],
            bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _randomise(model: Transformer, seed: int) -> None:
    """Every parameter random (norms near 1, mHC's and the routers' included); hash tables, and the selection biases
    of the learned routers (a hash block's router has none to export)."""
    hashed = tuple(f"decoder_layers.{i}." for i in range(model.cfg.n_layers) if model.cfg.mlp_type(i) == "hash_moe")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15 + (1.0 if name.endswith("norm.weight") else 0.0))
        for name, buffer in model.named_buffers():
            if name.endswith(("tid2eid", "experts_of_token")):
                buffer.copy_(torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(VOCAB)]))
            elif name.endswith("expert_bias") and not name.startswith(hashed):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)


def _model(depth: int = 1) -> Transformer:
    """The tiny V4 imported from transformers' config, with `depth` MTP modules, every weight random."""
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**TINY))
    cfg = from_hf_model(hf).cfg
    cfg = dataclasses.replace(cfg, mtp=dataclasses.replace(cfg.mtp, depth=depth))
    model = Transformer(cfg).eval()
    _randomise(model, 0)
    return model


def test_export_names_the_published_mtp_tensors_and_round_trips_bitwise(tmp_path):
    """mtp.0.*: e_proj, h_proj, enorm, hnorm, norm, the hc_head merge of STREAMS weights over STREAMS x D, and a
    sliding-window MoE block (no compressor, a learned router with its selection bias) under the published names;
    back bitwise from the state dict and from an HF folder; config.json says num_nextn_predict_layers = 1 and
    transformers, which builds no MTP module, leaves mtp.* unread and computes the main logits as ours."""
    from meshformer.checkpointing.hf_folder import export_hf, lazy_from_hf, open_hf

    model = _model()
    state = to_hf_state_dict(model, "deepseek_v4")
    mtp = {k.removeprefix("mtp.0."): v for k, v in state.items() if k.startswith("mtp.0.")}
    shapes = {"e_proj.weight": (D, D), "h_proj.weight": (D, D), "enorm.weight": (D,), "hnorm.weight": (D,),
              "norm.weight": (D,), "hc_head_fn": (STREAMS, STREAMS * D), "hc_head_base": (STREAMS,),
              "hc_head_scale": (1,), "hc_attn_fn": ((2 + STREAMS) * STREAMS, STREAMS * D), "hc_ffn_scale": (3,),
              "attn_norm.weight": (D,), "ffn_norm.weight": (D,), "attn.wq_a.weight": (16, D),
              "attn.kv_norm.weight": (16,), "attn.attn_sink": (4,), "attn.wo_a.weight": (16, 32),
              "ffn.gate.weight": (4, D), "ffn.gate.bias": (4,), "ffn.experts.3.w1.weight": (16, D),
              "ffn.shared_experts.w2.weight": (D, 16)}
    assert {k: tuple(mtp[k].shape) for k in shapes} == shapes
    assert not [k for k in mtp if "compressor" in k or "indexer" in k or "tid2eid" in k]
    assert torch.equal(mtp["e_proj.weight"], model.mtp_layers[0].e_proj.weight)  # type: ignore[index]
    assert len(mtp) == sum(1 for k in model.state_dict() if k.startswith("mtp_layers.0.")) + 3 * 4 - 3
    ours = from_hf_state_dict(state, model.cfg, "deepseek_v4")
    expected = model.state_dict()
    assert ours.keys() == expected.keys() and all(torch.equal(ours[k], expected[k]) for k in ours)
    # names without the base model's prefix (layers.0..., as a base-model checkpoint has them): mtp.* stays outside
    base = {k.removeprefix("model."): v for k, v in state.items()}
    assert all(torch.equal(v, expected[k]) for k, v in from_hf_state_dict(base, model.cfg, "deepseek_v4").items())

    folder = export_hf(model.state_dict(), model.cfg, tmp_path / "hf", "deepseek_v4")
    assert config_to_hf(model.cfg, "deepseek_v4").num_nextn_predict_layers == 1
    cfg, arch, theirs = open_hf(folder)
    assert cfg.mtp.depth == 0 and (cfg.mtp.layer_type, cfg.mtp.mlp_type) == ("sliding_mqa", "moe")
    read = lazy_from_hf(theirs, model.cfg, arch, folder)  # the import with model.mtp.depth = 1 set
    assert all(torch.equal(read[k], expected[k]) for k in expected)
    at_depth_0 = lazy_from_hf(theirs, cfg, arch, folder)  # mtp.* left unread
    assert not [k for k in at_depth_0 if k.startswith("mtp_layers.")]
    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, output_loading_info=True,
                                                                  dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, model(ids), rtol=0, atol=1e-4)


def _rms(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight


def test_mtp_forward_equals_a_hand_written_reference_with_transformers_block():
    """Module 1's logits from the main stack's streams, written out by hand: each stream normed (hnorm) and projected
    (h_proj) plus the normed embedding of the token ahead through e_proj; then the block, as transformers'
    DeepseekV4DecoderLayer computes it (a sliding_attention / moe layer holding our exported MTP block); then the
    hc_head merge (sigmoid weights from the normed streams), the final norm and the shared head. Within 1e-6."""
    model = _model()
    n = model.cfg.n_layers
    hf_config = transformers.DeepseekV4Config(**{
        **TINY, "num_hidden_layers": n + 1, "layer_types": [*TINY["layer_types"], "sliding_attention"],
        "mlp_layer_types": [*TINY["mlp_layer_types"], "moe"]})
    hf = transformers.DeepseekV4ForCausalLM(hf_config).eval()
    state = to_hf_state_dict(model, "deepseek_v4")
    prefix = "mtp.0."
    merged = {k: v for k, v in state.items() if not k.startswith(prefix)}
    parts = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    block = {k: v for k, v in parts.items() if k.startswith(("attn", "ffn", "hc_attn", "hc_ffn"))}
    merged |= {f"model.layers.{n}.{k}": v for k, v in block.items()}  # the MTP block as transformers' layer n
    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(None, config=hf_config, state_dict=merged,
                                                                  output_loading_info=True, dtype=torch.float32)
    assert not any(info.values())
    hf = hf.eval()

    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(3))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
    with torch.no_grad():
        _, [(got, targets)] = model(ids, mtp_labels=labels)
        # the main stack's streams, as transformers' DeepseekV4Model runs its layers 0 .. n - 1
        inner = hf.model
        positions = torch.arange(T)[None]
        embeds = inner.embed_tokens(ids)
        mask = transformers.masking_utils.create_sliding_window_causal_mask(
            config=hf_config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=positions)
        rope = {kind: inner.rotary_emb(embeds, position_ids=positions, layer_type=kind)
                for kind in ("main", "compress")}
        streams = embeds.unsqueeze(2).expand(-1, -1, STREAMS, -1).contiguous()
        for layer in inner.layers[:n]:
            streams = layer(streams, position_embeddings=rope, position_ids=positions, attention_mask=mask,
                            input_ids=ids)
        ahead = torch.cat([ids[:, 1:], torch.zeros(2, 1, dtype=ids.dtype)], dim=1)
        e = _rms(inner.embed_tokens(ahead), parts["enorm.weight"]) @ parts["e_proj.weight"].T
        x = _rms(streams, parts["hnorm.weight"]) @ parts["h_proj.weight"].T + e[:, :, None]
        x = inner.layers[n](x, position_embeddings=rope, position_ids=positions, attention_mask=mask,
                            input_ids=ahead)
        flat = x.flatten(2)
        weights = torch.sigmoid(_rms(flat) @ parts["hc_head_fn"].T * parts["hc_head_scale"]
                                + parts["hc_head_base"]) + 1e-6
        h = (weights[..., None] * x).sum(dim=2)
        expected = _rms(h, parts["norm.weight"]) @ state["lm_head.weight" if "lm_head.weight" in state
                                                          else "head.weight"].T
    # our attention sums each query block's softmax over its window and entries only (1.01e-6 seen)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
    assert expected.std() > 0.1
    assert torch.equal(targets, torch.cat([labels[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1))
    # the module's projections of the streams matter: zeroing h_proj moves the logits
    with torch.no_grad():
        model.mtp_layers[0].h_proj.weight.zero_()  # type: ignore[index]
        _, [(moved, _)] = model(ids, mtp_labels=labels)
    assert (moved - got).abs().max() > 1e-3


def test_mtp_loss_joins_the_objective_and_reaches_the_streams():
    """Through the loss object as DeepSeek-V3's: the objective adds loss_weight x the module's mean token loss, and
    the gradient reaches the main blocks' mHC weights through the streams the module reads."""
    from meshformer.loss.cross_entropy import cross_entropy_sum
    from meshformer.parallel.parallel_model import ParallelModel

    model = _model().train()
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool), "labels": labels}
    parallel = ParallelModel(model, cross_entropy_sum, torch.device("cpu"))
    loss_sum, objective = parallel._training_loss_sums(batch)
    _, [(logits, targets)] = model(ids, torch.ones_like(ids, dtype=torch.bool), mtp_labels=labels)
    mtp_mean = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    tokens = (labels != IGNORE_INDEX).sum()
    aux = objective - loss_sum  # the other terms (routers' balance) plus the MTP term
    without_mtp = dataclasses.replace(model.cfg, mtp=dataclasses.replace(model.cfg.mtp, loss_weight=0.0))
    plain = Transformer(without_mtp).train()
    plain.load_state_dict(model.state_dict())
    plain_loss, plain_objective = ParallelModel(plain, cross_entropy_sum, torch.device("cpu"))._training_loss_sums(
        batch)
    torch.testing.assert_close(plain_loss, loss_sum)
    torch.testing.assert_close((aux - (plain_objective - plain_loss)) / tokens, 0.3 * mtp_mean, rtol=1e-5,
                               atol=1e-6)
    model.zero_grad()
    mtp_mean.backward()
    assert model.decoder_layers["1"].ffn_residual.weight.grad.abs().sum() > 0  # type: ignore[union-attr]
    assert model.decoder_merge.weight.grad is None  # the module reads the streams, not the main merge


@pytest.mark.parametrize(("table", "named"), [
    ({"model": {"mtp": {"depth": 1, "layer_type": "sliding"}}}, "model.mtp.layer_type='sliding'"),
    ({"model": {"mtp": {"depth": 1, "mlp_type": "hash"}}}, "model.mtp.mlp_type='hash'"),
], ids=["layer-type", "mlp-type"])
def test_refusals(table, named):
    with pytest.raises(ConfigError, match=named):
        config_from_dict(table)


def test_mtp_beside_mhc_is_accepted_under_tensor_parallel():
    """Its projections, block and merge have a tensor-parallel layout (parallel/tensor_parallel.py; parity rows
    v4mtp/* in tests/parity/test_parallel_parity.py)."""
    cfg = config_from_dict({"model": {"residual": {"kind": "mhc"}, "mtp": {"depth": 1}}, "parallel": {"tp": 2}})
    assert cfg.parallel.tp == 2 and cfg.model.mtp.depth == 1


def test_export_refuses_an_mtp_block_of_other_kinds():
    from meshformer.checkpointing.hf import incompatibilities

    cfg = _model().cfg
    other = dataclasses.replace(cfg, mtp=dataclasses.replace(cfg.mtp, layer_type="hca"))
    assert any(p.startswith("mtp_block=('hca', 'moe')") for p in incompatibilities(other, "deepseek_v4"))
    assert not incompatibilities(cfg, "deepseek_v4")


def test_fresh_module_initialises_and_counts_as_the_stack():
    """A fresh module's mixing weights start as the stack's (gains 1, biases 0, sinks 0) and the parameter count
    names every tensor it holds."""
    from meshformer.model.flops import count_params

    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**TINY))
    cfg = from_hf_model(hf).cfg
    model = Transformer(dataclasses.replace(cfg, mtp=dataclasses.replace(cfg.mtp, depth=2)))
    module = model.mtp_layers[1]  # type: ignore[index]
    for gain in (module.merge.gain, module.block.attn_residual.gain, module.block.ffn_residual.gain):
        assert torch.equal(gain, torch.ones_like(gain))
    for zero in (module.merge.bias, module.block.attn_residual.bias, module.block.attn.sinks):
        assert torch.equal(zero, torch.zeros_like(zero))
    assert count_params(model.cfg)["mtp"] == sum(p.numel() for p in model.mtp_layers.parameters())  # type: ignore[union-attr]
    assert count_params(model.cfg)["total"] == sum(p.numel() for p in model.parameters())
