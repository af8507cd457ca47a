"""DeepSeek Sparse Attention (model/dsa.py) against transformers' DeepseekV32Attention and GlmMoeDsaAttention given the
same weights (sequences longer than the indexer's top-k, padded and document masks), dense MLA where top-k covers
every key, the indexer cache in generation, context-parallel pieces, and the indexer's objective: its KL gradient,
the model's gradient untouched by it, and the dense warm-up that trains only the indexers."""

from __future__ import annotations

import re

import pytest
import torch

from meshformer.config.migrate import model_from_flat
from meshformer.loss.layer_terms import bind_layer_terms
from meshformer.model import Transformer
from meshformer.model.attention import SequenceChunk
from meshformer.model.config import DsaConfig, MlaConfig
from meshformer.model.dsa import IndexedKVCache, SparseLatentAttention, dsa_layers, set_token_count
from meshformer.model.masks import build_mask
from meshformer.model.mla import MultiHeadLatentAttention
from meshformer.model.positions import RotaryEmbedding

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32  # noqa: E402
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

T, TOPK = 12, 5
# our names -> transformers'
NAMES = {"q_a_proj": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b_proj": "q_b_proj",
         "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b_proj": "kv_b_proj",
         "o_proj": "o_proj"}
MODULES = {"deepseek_v32": (transformers.DeepseekV32Config, hf_v32.DeepseekV32Attention,
                            hf_v32.DeepseekV32RotaryEmbedding, False),
           "glm_moe_dsa": (transformers.GlmMoeDsaConfig, hf_glm.GlmMoeDsaAttention,
                           hf_glm.GlmMoeDsaRotaryEmbedding, True)}


def _cfg(topk: int = TOPK, interleave: bool = False, **dsa):
    return model_from_flat(
        d_model=32, n_heads=4, position="rope", max_seq_len=32, bias=False, layer_types=["dsa"], vocab_size=64,
        n_layers=2, rope_theta=500.0,
        mla=MlaConfig(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
        dsa=DsaConfig(n_heads=8, head_dim=8, topk=topk, rope_interleave=interleave, **dsa))


def _pair(arch: str, topk: int = TOPK):
    """(their module, their rotary embedding, ours, our rotary) with the same perturbed weights."""
    config_cls, attention_cls, rotary_cls, interleave = MODULES[arch]
    hf_cfg = config_cls(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                        kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, index_topk=topk,
                        index_n_heads=8, index_head_dim=8, max_position_embeddings=32,
                        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, num_hidden_layers=1)
    hf_cfg._attn_implementation = "eager"
    theirs = attention_cls(hf_cfg, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.2) + (p.dim() == 1))
    cfg = _cfg(topk, interleave)
    ours = SparseLatentAttention(cfg).eval()
    state = theirs.state_dict()
    ours.load_state_dict({name: state[name if name.startswith("indexer.") else
                                      f"{NAMES[name.split('.')[0]]}.weight"] for name in ours.state_dict()})
    rotary = RotaryEmbedding(cfg.rope_dim, cfg.max_seq_len, cfg.rope.theta)
    return theirs, rotary_cls(hf_cfg), ours, rotary


def _inputs():
    x = torch.randn(3, T, 32, generator=torch.Generator().manual_seed(1))
    padding = torch.ones(3, T, dtype=torch.bool)
    padding[1, 9:], padding[2, 4:] = False, False
    documents = torch.tensor([[0] * 4 + [1] * 8, [0] * T, [0] * T])
    return x, padding, build_mask(T, T, causal=True, key_padding=padding, documents=documents)


@pytest.mark.parametrize("arch", list(MODULES))
def test_dsa_matches_transformers_attention(arch):
    """Same outputs at the real tokens; the selection bites (dense MLA differs), and the first row whose allowed
    keys outnumber top-k exists in every batch row."""
    theirs, their_rotary, ours, rotary = _pair(arch)
    x, padding, mask = _inputs()
    positions = torch.arange(T)
    cos, sin = their_rotary(x, positions[None])
    additive = torch.zeros(mask.mask.shape).masked_fill(~mask.mask, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = theirs(x, position_embeddings=(cos, sin), attention_mask=additive)[0]
        got = ours(x, mask, rope=rotary(positions))
    torch.testing.assert_close(got[padding], expected[padding], rtol=0, atol=1e-5)
    assert expected.std() > 0.1
    ours.topk = T  # every key: dense MLA
    with torch.no_grad():
        dense = ours(x, mask, rope=rotary(positions))
    assert (dense[padding] - got[padding]).abs().max() > 1e-2


def test_topk_covering_every_key_is_dense_mla():
    cfg = _cfg(topk=T)
    torch.manual_seed(0)
    ours = SparseLatentAttention(cfg).eval()
    mla = MultiHeadLatentAttention(cfg).eval()
    mla.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("indexer.")})
    x, _, mask = _inputs()
    rotary = RotaryEmbedding(cfg.rope_dim, cfg.max_seq_len, cfg.rope.theta)
    with torch.no_grad():
        assert torch.equal(ours(x, mask, rope=rotary(torch.arange(T))), mla(x, mask, rope=rotary(torch.arange(T))))


def test_the_cache_holds_the_indexer_keys_and_decodes_as_the_whole_sequence():
    _, _, ours, rotary = _pair("deepseek_v32")
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = ours(x, build_mask(T, T, causal=True), rope=rotary(torch.arange(T)))
        cache = IndexedKVCache()
        steps = [ours(x[:, :3], build_mask(3, 3, causal=True), rope=rotary(torch.arange(3)), cache=cache)]
        for t in range(3, T):
            steps.append(ours(x[:, t:t + 1], build_mask(1, t + 1, q_offset=t, causal=True),
                              rope=rotary(torch.arange(t, t + 1)), cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-5)
    assert cache.index_k is not None and cache.index_k.shape == (2, 1, T, 8)


def test_context_parallel_pieces_equal_the_whole_sequence():
    """Two ranks' pieces, simulated: each gather returns both ranks' latents, rotary keys and indexer keys in rank
    order; the late pieces see more keys than top-k."""
    _, _, ours, rotary = _pair("glm_moe_dsa")
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(3))
    count = 2
    positions = [SequenceChunk(i, count, lambda t: t).positions(T // count, x.device) for i in range(count)]
    with torch.no_grad():
        whole = ours(x, build_mask(T, T, causal=True), rope=rotary(torch.arange(T)))
        sent = []
        for p in positions:  # what each rank hands its three gathers
            seen = []
            ours(x[:, p], build_mask(T // count, T, q_positions=p, causal=True), rope=rotary(p),
                 chunk=SequenceChunk(0, 1, lambda t, s=seen: s.append(t) or torch.cat([t] * count, dim=2)))
            sent.append(seen)
        for i, mine in enumerate(positions):
            gathered = iter([torch.cat([s[j] for s in sent], dim=2) for j in range(3)])
            chunk = SequenceChunk(i, count, lambda t, g=gathered: next(g))
            got = ours(x[:, mine], build_mask(T // count, T, q_positions=mine, causal=True), rope=rotary(mine),
                       chunk=chunk)
            torch.testing.assert_close(got, whole[:, mine], rtol=0, atol=1e-5)


def _reference_kl(ours: SparseLatentAttention, x, mask, padding, rotary, dense: bool) -> torch.Tensor:
    """Summed over the real queries: KL(p || softmax(I)) with p the heads' attention probabilities summed and
    renormalised, over the keys attention read, written out from the module's weights."""
    q_latent = ours.q_a_norm(ours.q_a_proj(x)).detach()
    rope = rotary(torch.arange(T))
    keys = ours.indexer.keys(x.detach(), rope)
    scores = ours.indexer(x.detach(), q_latent, keys, rope)
    allowed = mask.mask[:, 0]
    if not dense:
        top = scores.detach().masked_fill(~allowed, float("-inf")).topk(TOPK, dim=-1).indices
        allowed = allowed & torch.zeros_like(allowed).scatter(-1, top, True)
    ours.capture_weights = True
    with torch.no_grad():
        ours.eval()
        ours.topk = T if dense else TOPK
        ours(x, mask, rope=rope)
        ours.topk = TOPK
        ours.train()
    ours.capture_weights = False
    p = ours.weights.sum(1)
    p = p / p.sum(-1, keepdim=True)
    log_q = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.where(allowed, p * (p.clamp(min=1e-30).log() - log_q), 0.0).sum(-1)[padding].sum()


@pytest.mark.parametrize("stage", ["sparse", "warmup"])
def test_the_indexer_learns_the_kl_and_the_model_never_sees_it(stage):
    """The indexer's gradient is the KL's (times loss_weight over the step's tokens); every other gradient is the
    one without the indexer's loss."""
    torch.manual_seed(0)
    ours = SparseLatentAttention(_cfg(stage=stage)).train()
    bind_layer_terms([ours], {"dsa/indexer_loss": 2.0})  # the objective's weight
    x, padding, mask = _inputs()
    rotary = RotaryEmbedding(4, 32, 500.0)
    set_token_count([ours], torch.tensor(30))
    ours(x, mask, rope=rotary(torch.arange(T)), padding=padding).square().sum().backward()
    grads = {k: p.grad.clone() for k, p in ours.named_parameters()}
    assert ours.last_loss is not None and ours.last_loss > 0
    ours.zero_grad()
    (2.0 / 30 * _reference_kl(ours, x, mask, padding, rotary, dense=stage == "warmup")).backward()
    for name, p in ours.indexer.named_parameters():
        torch.testing.assert_close(grads[f"indexer.{name}"], p.grad, rtol=1e-4, atol=1e-7)
        assert p.grad.abs().max() > 0
    ours.zero_grad()
    bind_layer_terms([ours], {"dsa/indexer_loss": 0.0})
    ours(x, mask, rope=rotary(torch.arange(T))).square().sum().backward()
    for name, p in ours.named_parameters():
        if not name.startswith("indexer."):
            assert torch.equal(grads[name], p.grad), name


def test_warmup_attends_densely_and_trains_only_the_indexers():
    torch.manual_seed(0)
    model = Transformer(_cfg(stage="warmup"))
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".attn.indexer." in name for name in trained)
    sparse = Transformer(_cfg())
    sparse.load_state_dict(model.state_dict())
    dense = Transformer(_cfg(topk=T))
    dense.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, T))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids), dense.eval()(ids))
        assert not torch.equal(sparse.eval()(ids), dense(ids))
    bind_layer_terms([model], {"dsa/indexer_loss": 1.0})  # the objective's weight, as a layout binds it
    model.train()(ids).sum().backward()  # the language-model loss reaches only the indexers, through their loss
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model.parameters() if p.requires_grad)
    assert len(dsa_layers([model])) == 2


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.dsa.topk=0"], "model.dsa.topk=0 must be positive"),
    (["model.dsa.head_dim=8"], "model.dsa.head_dim=8 is narrower than the rotary width model.mla.qk_rope_head_dim=16"),
    (["model.dsa.loss_weight=-1"], "model.dsa.loss_weight=-1.0 must be at least 0"),
    (['model.layer_types=["dsa", "mla"]'], "mixes dsa with other token mixers"),
    (["model.attention.n_kv_heads=2"], "model.attention.n_kv_heads is set, but dsa blocks do not use it"),
])
def test_bad_dsa_configs_get_one_line(overrides, message):
    from meshformer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny-dsa", overrides)


def test_queries_without_a_latent_are_refused_in_one_line():
    from meshformer.config import ConfigError, config_from_dict

    raw = {"model": {"family": "decoder", "position": "rope", "layer_types": ["dsa"], "bias": False,
                     "mla": {"kv_lora_rank": 12}},
           "data": {"seq_len": 16, "batch_size": 2}, "train": {"device": "cpu"}}
    with pytest.raises(ConfigError, match=re.escape("model.mla.q_lora_rank is unset")):
        config_from_dict(raw)


def _has(module: torch.nn.Module, path: str) -> bool:
    try:
        return isinstance(module.get_submodule(path), torch.nn.Module)
    except AttributeError:
        return False


def test_tensor_parallel_rules_name_the_modules_it_builds():
    """Every rule but the direct query projection's names a submodule (the indexer's scores point included)."""
    from meshformer.model.components import TOKEN_MIXERS

    cfg = _cfg()
    kind = TOKEN_MIXERS["dsa"]
    module = kind.build(cfg, causal=True)
    present = {path for path in kind.tp_rules(cfg) if path == "" or _has(module, path)}
    assert set(kind.tp_rules(cfg)) - present == {"q_proj"} and "indexer.scores_grad" in present
    assert kind.cache_per_token(cfg) == 12 + 4 + 8


def test_the_bench_table_and_its_flops():
    """bench/dsa_vs_mla.py: the two sides differ only in the token mixer, DSA declaring the indexer's FLOPs on top of
    MLA's; its rows as the page shows them."""
    from helpers.common import load_script

    bench = load_script("bench/dsa_vs_mla.py")
    dsa, mla = bench.configs()
    assert (dsa.layer_types, mla.layer_types) == (["dsa"], ["mla"]) and dsa.dsa.topk == bench.TOPK
    assert bench.forward_flops(dsa, 512) > bench.forward_flops(mla, 512)
    columns, rows = bench.table([{"seq": 512, "topk": 256, "dsa_gflops": 1.8, "mla_gflops": 1.6, "dsa_ms": 30.0,
                                  "mla_ms": 20.0, "dsa_over_mla": 1.5, "load_1min": 1.0}])
    assert len(columns) == len(rows[0]) and rows[0][1] == "256 of up to 512" and rows[0][5] == "1.50"


def test_planned_peak_within_tolerance_of_measured():
    """The planner's peak for a dsa model (the indexer's scores on top of MLA's activations; math backend) within
    bench/plan_validation.py's tolerance of a measured training step whose sequences are longer than top-k."""
    from plan_validation import TOLERANCE, validation_config

    from meshformer.planner.measure import measure_step_peak
    from meshformer.planner.search import plan_layout

    mla = {"q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
    cfg = validation_config({"model": {"layer_types": ["dsa"], "attention": {"n_heads": 8, "backend": "math"},
                                       "mla": mla, "dsa": {"n_heads": 4, "head_dim": 16, "topk": 32}}}, seq=128)
    predicted, measured = plan_layout(cfg, 1).peak, measure_step_peak(cfg)["peak"]
    assert abs(predicted / measured - 1) < TOLERANCE, (predicted, measured)


def test_the_indexer_loss_is_logged_per_layer_as_the_objective_declares():
    """A training step's metrics hold "dsa/<layer>/indexer_loss" for each block that runs an indexer (the mean KL per
    real query of its latest forward), not for a dsa_shared block; an objective without the term logs none."""
    from dataclasses import replace

    from meshformer.loss.cross_entropy import cross_entropy_sum
    from meshformer.loss.objective import Loss
    from meshformer.parallel.parallel_model import ParallelModel

    cfg = replace(_cfg(topk=4), n_layers=3, layer_types=["dsa", "dsa_shared", "dsa"])
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, T + 1))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    plan = ParallelModel(Transformer(cfg), cross_entropy_sum, torch.device("cpu"))
    plan.forward_backward(batch, torch.tensor(float(2 * T)))
    scalars = plan.moe_scalars()
    assert set(scalars) == {"dsa/decoder_layers.0/indexer_loss", "dsa/decoder_layers.2/indexer_loss"}
    for name, layer in plan.named_dsa_layers:
        if name.endswith("2.attn"):
            assert layer.last_loss is not None and scalars["dsa/decoder_layers.2/indexer_loss"] == pytest.approx(
                float(layer.last_loss))
    assert all(v > 0 for v in scalars.values())
    plain = ParallelModel(Transformer(cfg), Loss(cross_entropy_sum), torch.device("cpu"))
    plain.forward_backward(batch, torch.tensor(float(2 * T)))
    assert plain.moe_scalars() == {}
