"""Multi-head latent attention (model/mla.py) against transformers' DeepseekV3Attention given the same weights: both
query paths, both rotary layouts, YaRN with DeepSeek's mscale, padded and document masks, every backend, the
compressed generation cache and context-parallel pieces."""

from __future__ import annotations

import pytest
import torch

from meshformer.config import MlaConfig
from meshformer.config.migrate import model_from_flat
from meshformer.model.attention import KVCache, SequenceChunk
from meshformer.model.masks import build_mask
from meshformer.model.mla import MultiHeadLatentAttention
from meshformer.model.positions import RopeScaling, RotaryEmbedding

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.8}
# our names -> DeepseekV3Attention's
NAMES = {"q_proj": "q_proj", "q_a_proj": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b_proj": "q_b_proj",
         "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b_proj": "kv_b_proj",
         "o_proj": "o_proj"}


def _pair(q_lora_rank: int | None, interleave: bool, rope: dict, backend: str = "sdpa"):
    """(theirs, ours, our rotary tables) with the same perturbed weights."""
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
        kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=interleave,
        max_position_embeddings=32, rope_parameters=dict(rope), attention_bias=False)
    hf_cfg._attn_implementation = "eager"
    theirs = hf_ds.DeepseekV3Attention(hf_cfg, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.2) + (p.dim() == 1))
    scaled = rope["rope_type"] != "default"
    cfg = model_from_flat(
        d_model=32, n_heads=4, position="rope", max_seq_len=32, bias=False, layer_types=["mla"],
        attention_backend=backend, rope_theta=rope["rope_theta"],
        **({"rope_scaling": "yarn", "rope_scaling_factor": rope["factor"], "rope_attention_factor": 1.0,
            "rope_original_max_seq_len": rope["original_max_position_embeddings"]} if scaled else {}),
        mla=MlaConfig(q_lora_rank=q_lora_rank, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                      v_head_dim=6, rope_interleave=interleave, mscale_all_dim=rope.get("mscale_all_dim", 0.0)))
    ours = MultiHeadLatentAttention(cfg).eval()
    state = theirs.state_dict()
    ours.load_state_dict({name: state[f"{NAMES[name.split('.')[0]]}.weight"] for name in ours.state_dict()})
    rotary = RotaryEmbedding(cfg.rope_dim, cfg.max_seq_len, cfg.rope.theta, RopeScaling.from_config(cfg))
    return hf_cfg, theirs, ours, rotary


def _theirs(hf_cfg, theirs, x, allowed, positions):
    cos, sin = hf_ds.DeepseekV3RotaryEmbedding(hf_cfg)(x, positions[None])
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return theirs(x, position_embeddings=(cos, sin), attention_mask=additive)[0]


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize(("q_lora_rank", "interleave", "rope"), [
    (16, True, YARN), (None, True, YARN), (16, False, {"rope_type": "default", "rope_theta": 500.0}),
    (None, False, YARN)], ids=["lora-interleaved-yarn", "direct-interleaved-yarn", "lora-half-split", "direct-yarn"])
def test_mla_matches_deepseek_v3_attention(q_lora_rank, interleave, rope, backend):
    hf_cfg, theirs, ours, rotary = _pair(q_lora_rank, interleave, rope, backend)
    x = torch.randn(3, 12, 32, generator=torch.Generator().manual_seed(1))
    padding = torch.ones(3, 12, dtype=torch.bool)
    padding[1, 8:], padding[2, 3:] = False, False
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 12, [0] * 12])
    mask = build_mask(12, 12, causal=True, key_padding=padding, documents=documents)
    positions = torch.arange(12)
    with torch.no_grad():
        expected = _theirs(hf_cfg, theirs, x, mask.mask, positions)
        got = ours(x, mask, rope=rotary(positions))
    torch.testing.assert_close(got[padding], expected[padding], rtol=0, atol=1e-5)
    assert expected.std() > 0.1
    if rope.get("mscale_all_dim"):  # the mscale^2 correction is in force, not 1
        assert ours.scale > 1.2 * (8 + 4) ** -0.5


def test_mla_cache_holds_the_latent_and_decodes_as_the_whole_sequence():
    _, _, ours, rotary = _pair(16, True, YARN)
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = ours(x, build_mask(10, 10, causal=True), rope=rotary(torch.arange(10)))
        cache = KVCache()
        steps = [ours(x[:, :6], build_mask(6, 6, causal=True), rope=rotary(torch.arange(6)), cache=cache)]
        for t in range(6, 10):
            steps.append(ours(x[:, t:t + 1], build_mask(1, t + 1, q_offset=t, causal=True),
                              rope=rotary(torch.arange(t, t + 1)), cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-5)
    # per token: the latent (12) and one rotary key (4), not 4 heads of keys (12) and values (6)
    assert cache.k is not None and cache.v is not None
    assert (cache.k.shape, cache.v.shape) == ((2, 1, 10, 12), (2, 1, 10, 4))


def test_mla_context_parallel_pieces_equal_the_whole_sequence():
    """Two ranks' pieces, simulated: each rank's gather returns both ranks' compressed tensors in rank order, as an
    all-gather along the sequence does; every rank's rows equal the single-process output."""
    _, _, ours, rotary = _pair(None, True, YARN)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    count = 2
    positions = [SequenceChunk(i, count, lambda t: t).positions(4, x.device) for i in range(count)]
    with torch.no_grad():
        whole = ours(x, build_mask(8, 8, causal=True), rope=rotary(torch.arange(8)))
        sent = [_compressed(ours, x[:, p], rotary(p)) for p in positions]  # what each rank hands its gather
        for i, mine in enumerate(positions):
            gathered = iter([torch.cat([s[j] for s in sent], dim=2) for j in range(2)])  # latents, then rotary keys
            chunk = SequenceChunk(i, count, lambda t, g=gathered: next(g))
            got = ours(x[:, mine], build_mask(4, 8, q_positions=mine, causal=True), rope=rotary(mine), chunk=chunk)
            torch.testing.assert_close(got, whole[:, mine], rtol=0, atol=1e-5)


def _compressed(ours: MultiHeadLatentAttention, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed latent, rotated shared key) of x, each (B, 1, T, width)."""
    latent, k_rope = ours.kv_a_proj(x).split([ours.kv_rank, ours.rope_dim], dim=-1)
    b, t, _ = x.shape
    return ours.kv_a_norm(latent).view(b, 1, t, -1), ours._rotate(k_rope.view(b, 1, t, -1), rope)
