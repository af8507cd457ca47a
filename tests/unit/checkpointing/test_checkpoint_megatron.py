"""Megatron-Core torch_dist GPT checkpoints: our layout checked through plain DCP, and (when megatron-core is
installed) against Megatron's own loader, saver and forward pass."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import assert_bitwise
from helpers.common import free_port
from helpers.convert import megatron_with_extra_tensors

from meshformer.checkpointing import ConversionError
from meshformer.checkpointing.dcp_io import read_full_tensors, read_metadata, tensor_entries
from meshformer.checkpointing.megatron import export_megatron, import_megatron, pack_qkv
from meshformer.checkpointing.megatron_config import SAVED_CONFIG, megatron_incompatibilities
from meshformer.checkpointing.weights import read_weights, write_weights
from meshformer.cli import main
from meshformer.config import AttentionConfig, FfnConfig, ModelConfig, MoeConfig, NormConfig
from meshformer.model import Transformer
from meshformer.model.moe import is_moe_block

THIS = Path(__file__).resolve()
CASES = {
    "llama": ModelConfig(family="decoder", vocab_size=100, d_model=32, n_layers=2, position="rope",
                         tie_embeddings=False, bias=False, max_seq_len=64,
                         attention=AttentionConfig(n_heads=4, n_kv_heads=2),
                         ffn=FfnConfig(d_ff=64, activation="swiglu"), norm=NormConfig(kind="rmsnorm")),
    "gpt2": ModelConfig(family="decoder", vocab_size=100, d_model=32, n_layers=2, position="learned",
                        tie_embeddings=True, bias=True, max_seq_len=64, attention=AttentionConfig(n_heads=4),
                        ffn=FfnConfig(d_ff=64, activation="gelu"), norm=NormConfig(kind="layernorm")),
}
MOE_CASES = {  # every layer MoE (Megatron stacks layers), and dense + MoE mixed (Megatron saves each layer apart)
    "qwen3_moe": ModelConfig(family="decoder", vocab_size=100, d_model=32, n_layers=2, position="rope",
                             tie_embeddings=False, bias=False, max_seq_len=64,
                             attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True),
                             ffn=FfnConfig(d_ff=64, activation="swiglu"), norm=NormConfig(kind="rmsnorm"),
                             moe=MoeConfig(n_experts=4, experts_per_token=2, d_ff=24)),
    "deepseek_like": ModelConfig(family="decoder", vocab_size=100, d_model=32, n_layers=3, position="rope",
                                 tie_embeddings=True, bias=False, max_seq_len=64, mlp_types=["dense", "moe", "moe"],
                                 attention=AttentionConfig(n_heads=4, qkv_bias=True),
                                 ffn=FfnConfig(d_ff=64, activation="swiglu"), norm=NormConfig(kind="rmsnorm"),
                                 moe=MoeConfig(n_experts=4, experts_per_token=2, d_ff=24, n_shared_experts=2,
                                               router_score="sigmoid", router_groups=2, router_groups_per_token=1,
                                               router_bias_update_rate=1e-3)),
}


def _random_model(cfg: ModelConfig, seed: int = 1) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
        if cfg.moe.router_bias_update_rate:  # a bias that bias balancing has moved, so export must carry it
            for name, buffer in model.named_buffers():
                if name.endswith("expert_bias"):
                    buffer.normal_(0, 0.2)
    return model


def _exported(cfg: ModelConfig, tmp_path: Path, *options: str) -> tuple[Transformer, dict, Path]:
    """A random model, its weights folder (tmp_path/ours) and its export through the CLI (tmp_path/mcore)."""
    model = _random_model(cfg)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    write_weights(state, cfg, tmp_path / "ours")
    main(["convert", "export-megatron", str(tmp_path / "ours"), str(tmp_path / "mcore"), *options])
    return model, state, tmp_path / "mcore" / "iter_0000000"


@pytest.mark.parametrize("name", list(CASES))
def test_export_layout_and_round_trip(name, tmp_path):
    cfg = CASES[name]
    model, state, folder = _exported(cfg, tmp_path, "--pad-vocab-multiple", "128")
    assert (tmp_path / "mcore" / "latest_checkpointed_iteration.txt").read_text() == "0"
    assert json.loads((folder / "metadata.json").read_text())["sharded_backend"] == "torch_dist"

    # Read back with plain DCP: Megatron's names, layers stacked on dim 0, QKV interleaved per query group.
    shapes = {k: tuple(v.size) for k, v in tensor_entries(read_metadata(folder)).items()}
    fc1_rows = 2 * cfg.ffn.d_ff if cfg.ffn.activation == "swiglu" else cfg.ffn.d_ff
    qkv_rows = (cfg.attention.n_heads + 2 * cfg.kv_heads) * cfg.attention_head_dim
    assert shapes["embedding.word_embeddings.weight"] == (128, cfg.d_model)  # padded vocabulary
    assert shapes["decoder.layers.self_attention.linear_qkv.weight"] == (cfg.n_layers, qkv_rows, cfg.d_model)
    assert shapes["decoder.layers.self_attention.linear_qkv.layer_norm_weight"] == (cfg.n_layers, cfg.d_model)
    assert shapes["decoder.layers.mlp.linear_fc1.weight"] == (cfg.n_layers, fc1_rows, cfg.d_model)
    assert ("decoder.layers.mlp.linear_fc1.layer_norm_bias" in shapes) == (cfg.norm.kind == "layernorm")
    assert ("output_layer.weight" in shapes) == (not cfg.tie_embeddings)
    qkv = read_full_tensors(folder, ["decoder.layers.self_attention.linear_qkv.weight"])[
        "decoder.layers.self_attention.linear_qkv.weight"]
    attn = model.decoder_layers["1"].attn
    group_rows = (cfg.attention.n_heads // cfg.kv_heads + 2) * cfg.attention_head_dim
    first_group = qkv[1, :group_rows]  # layer 1, query group 0: its query heads, then its key head, then value
    per_group_q = cfg.attention.n_heads // cfg.kv_heads * cfg.attention_head_dim
    assert torch.equal(first_group[:per_group_q], attn.q_proj.weight[:per_group_q])
    head_dim = cfg.attention_head_dim
    assert torch.equal(first_group[per_group_q:per_group_q + head_dim], attn.k_proj.weight[:head_dim])
    assert torch.equal(qkv[1], pack_qkv(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                                        cfg.attention.n_heads, cfg.kv_heads))

    # ... and back, bitwise.
    main(["convert", "import-megatron", str(tmp_path / "mcore"), str(tmp_path / "back"), "--heads",
          str(cfg.attention.n_heads),
          "--vocab-size", str(cfg.vocab_size), "--max-seq-len", str(cfg.max_seq_len)])
    cfg_back, state_back = read_weights(tmp_path / "back")
    assert cfg_back.kv_heads == cfg.kv_heads and cfg_back.norm.kind == cfg.norm.kind
    assert cfg_back.ffn.activation == cfg.ffn.activation
    assert_bitwise(state_back, state)


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_moe_export_layout_and_round_trip(name, tmp_path):
    cfg = MOE_CASES[name]
    model, state, folder = _exported(cfg, tmp_path)
    shapes = {k: tuple(v.size) for k, v in tensor_entries(read_metadata(folder)).items()}
    e, f, d = cfg.moe.n_experts, cfg.expert_d_ff, cfg.d_model
    if name == "qwen3_moe":  # all layers alike: stacked on a layer axis, experts on the next
        assert shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (2, e, 2 * f, d)
        assert shapes["decoder.layers.self_attention.q_layernorm.weight"] == (2, 16)
        assert shapes["decoder.layers.self_attention.linear_proj.weight"] == (2, d, 4 * 16)
        layer1 = read_full_tensors(folder, ["decoder.layers.mlp.experts.experts.linear_fc1.weight"])[
            "decoder.layers.mlp.experts.experts.linear_fc1.weight"][1]
    else:  # block 0 dense, 1 and 2 MoE: a key per layer, as Megatron saves mixed layers
        assert "decoder.layers.0.mlp.linear_fc1.weight" in shapes and "decoder.layers.0.mlp.router.weight" not in shapes
        assert shapes["decoder.layers.1.mlp.router.expert_bias"] == (e,)
        assert shapes["decoder.layers.2.mlp.shared_experts.linear_fc1.weight"] == (2 * 2 * f, d)
        assert shapes["decoder.layers.1.self_attention.linear_qkv.bias"] == (3 * d,)
        assert "decoder.layers.1.self_attention.linear_proj.bias" not in shapes
        layer1 = read_full_tensors(folder, ["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"])[
            "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"]
    experts = model.decoder_layers["1"].ffn.experts  # expert 3's linear_fc1 is [gate; up] as (out, in) rows
    assert torch.equal(layer1[3], torch.cat([experts.gate_proj[3].T, experts.up_proj[3].T]))
    megatron_side = json.loads((tmp_path / "mcore" / "megatron_model_config.json").read_text())["transformer_config"]
    layers = [int(is_moe_block(cfg, i)) for i in range(cfg.n_layers)]
    assert megatron_side["moe_layer_freq"] == (1 if name == "qwen3_moe" else layers)

    main(["convert", "import-megatron", str(tmp_path / "mcore"), str(tmp_path / "back")])
    cfg_back, state_back = read_weights(tmp_path / "back")
    assert cfg_back == cfg
    assert_bitwise(state_back, state)


def test_a_bias_balanced_router_keeps_its_selection_bias_without_a_saved_config(tmp_path):
    """A checkpoint Megatron trained with bias balancing holds each router's expert_bias, which steers which experts
    a token picks: imported from the tensors alone (no config beside them), it is read, not replaced by zeros."""
    cfg = replace(MOE_CASES["qwen3_moe"],
                  moe=replace(MOE_CASES["qwen3_moe"].moe, router_score="sigmoid", router_bias_update_rate=1e-3))
    _, state, folder = _exported(cfg, tmp_path)
    (folder.parent / SAVED_CONFIG).unlink()  # as Megatron-LM itself writes it
    main(["convert", "import-megatron", str(tmp_path / "mcore"), str(tmp_path / "back"), "--heads", "4",
          "--experts-per-token", "2", "--max-seq-len", "64"])
    cfg_back, state_back = read_weights(tmp_path / "back")
    assert cfg_back.moe.router_score == "sigmoid" and cfg_back.moe.router_bias_update_rate > 0
    biases = [k for k in state if k.endswith("router.expert_bias")]
    assert biases and all(state[k].abs().sum() > 0 and torch.equal(state_back[k], state[k]) for k in biases)


def test_group_limited_routing_comes_from_the_options_without_a_saved_config(tmp_path):
    """The tensors do not record group-limited routing (DeepSeek-V3): without a config beside them it is taken from
    --router-groups / --router-groups-per-token, and the imported model then gives the exported model's logits."""
    cfg = MOE_CASES["deepseek_like"]
    model, _, folder = _exported(cfg, tmp_path)
    (folder.parent / SAVED_CONFIG).unlink()
    main(["convert", "import-megatron", str(tmp_path / "mcore"), str(tmp_path / "back"), "--heads", "4",
          "--experts-per-token", "2", "--max-seq-len", "64", "--router-groups", "2", "--router-groups-per-token", "1"])
    cfg_back, state_back = read_weights(tmp_path / "back")
    assert (cfg_back.moe.router_groups, cfg_back.moe.router_groups_per_token) == (2, 1)
    back = Transformer(cfg_back)
    back.load_state_dict(dict(state_back))
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(ids), model.eval()(ids))


def test_a_tensor_with_no_counterpart_is_refused_not_dropped(tmp_path):
    """Megatron tensors meshformer has no place for (here a multi-token-prediction layer's norm) stop the import
    by name: the weights would otherwise be lost in silence."""
    cfg = CASES["llama"]
    _, _, folder = _exported(cfg, tmp_path)
    extra = megatron_with_extra_tensors(folder, tmp_path / "extra" / folder.name,
                                        {"mtp.layers.0.enorm.weight": torch.ones(cfg.d_model)})
    with pytest.raises(ConversionError, match=r"no meshformer counterpart.*mtp\.layers\.0\.enorm\.weight"):
        import_megatron(extra)


def test_a_training_checkpoint_with_its_optimizer_state_imports(tmp_path):
    """Megatron-LM saves the optimizer's state into the same torch_dist checkpoint (keys `optimizer.state.<name>.<
    parameter>`, or `optimizer.distributed...` by buckets): not model tensors, so neither imported nor refused."""
    cfg = CASES["llama"]
    _, state, folder = _exported(cfg, tmp_path)
    optimizer = {f"optimizer.state.{name}.{key}": torch.zeros(tuple(entry.size))
                 for key, entry in tensor_entries(read_metadata(folder)).items()
                 for name in ("exp_avg", "exp_avg_sq", "fp32_param")}
    optimizer["optimizer.distributed.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.exp_avg"] = torch.zeros(8)
    trained = megatron_with_extra_tensors(folder, tmp_path / "trained" / folder.name, optimizer)
    _, state_back = import_megatron(trained)
    assert_bitwise(dict(state_back), state)


def test_mismatches_are_explained(tmp_path):
    bert = ModelConfig(family="encoder", vocab_size=64, d_model=32, n_layers=1, head_transform=True, output_bias=True,
                       attention=AttentionConfig(n_heads=4), ffn=FfnConfig(d_ff=64),
                       norm=NormConfig(position="post", embedding=True))
    write_weights(Transformer(bert).state_dict(), bert, tmp_path / "bert")
    with pytest.raises(SystemExit, match="cannot be written as a Megatron-Core GPT checkpoint: family='encoder'"):
        main(["convert", "export-megatron", str(tmp_path / "bert"), str(tmp_path / "out")])
    moe = MOE_CASES["qwen3_moe"]
    unmapped = [  # what Megatron-Core's GPTModel cannot express: refused by name, never dropped
        (replace(CASES["llama"], rope=replace(CASES["llama"].rope, scaling="llama3")), "rope_scaling='llama3'"),
        # Gemma's and OLMo 2's block options
        (replace(CASES["llama"], norm=replace(CASES["llama"].norm, weight_offset=1.0)), "norm_weight_offset=1.0"),
        (replace(CASES["llama"], logit_softcap=30.0), "logit_softcap"),
        (replace(CASES["llama"], attention=replace(CASES["llama"].attention, softcap=50.0)), "attention_softcap"),
        (replace(CASES["llama"], norm=replace(CASES["llama"].norm, position="sandwich")), "sandwich"),
        (replace(CASES["llama"], ffn=replace(CASES["llama"].ffn, activation="geglu")), "activation='geglu'"),
        (replace(CASES["llama"],
                 attention=replace(CASES["llama"].attention, qk_norm=True,
                                   qk_norm_scope="projection")), "qk_norm_scope='projection'"),
        (replace(CASES["gpt2"], attention=replace(CASES["gpt2"].attention, qk_norm=True)), "qk_norm with LayerNorm"),
        (replace(CASES["gpt2"], attention=replace(CASES["gpt2"].attention, qkv_bias=False)),
         "linear biases without Q/K/V biases"),
        (replace(moe, bias=True), "mixture-of-experts with model.bias"),
        (replace(moe, moe=replace(moe.moe, router_score="sigmoid", router_renormalize=False)),
         "router_score='sigmoid'"),
        (replace(moe, moe=replace(moe.moe, router_bias_update_rate=1e-3)), "bias balancing"),
        (replace(moe, moe=replace(moe.moe, router_groups=2, router_renormalize=False, experts_per_token=4)),
         "router_groups_per_token=1"),
        (replace(moe, moe=replace(moe.moe, router_groups=2)), "group-limited softmax routing with router_renormalize"),
    ]
    for cfg, named in unmapped:
        problems = megatron_incompatibilities(cfg)
        assert len(problems) == 1 and named in problems[0], (named, problems)
    # MoE with linear biases: Hugging Face's MoE architectures refuse them too, so the fix is the config
    biased = replace(moe, bias=True)
    write_weights(Transformer(biased).state_dict(), biased, tmp_path / "moe-bias")
    with pytest.raises(SystemExit) as info:
        main(["convert", "export-megatron", str(tmp_path / "moe-bias"), str(tmp_path / "out-moe")])
    assert "train it with model.bias=false" in str(info.value.code) and "export-hf" not in str(info.value.code)
    model = Transformer(moe)  # a router bias Megatron would not keep (no bias balancing) is not dropped
    model.decoder_layers["1"].ffn.router.expert_bias.fill_(0.5)
    with pytest.raises(ConversionError, match=r"decoder_layers.1.ffn.router.expert_bias is non-zero"):
        export_megatron(model.state_dict(), moe, tmp_path / "biased")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed "
                    "(pip install megatron-core==0.16.1 psutil)")
def test_against_megatron_core(tmp_path):
    """Megatron loads our export and computes our logits; we import Megatron's own save and compute its logits."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(THIS.parents[3]), str(THIS.parents[2])))}
    proc = subprocess.run([sys.executable, str(THIS), str(tmp_path), str(free_port())], capture_output=True,
                          text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == set(CASES) | set(MOE_CASES)
    for name, diffs in results.items():
        assert diffs["export_then_megatron"] < 1e-5, (name, diffs)
        assert diffs["megatron_then_import"] < 1e-5, (name, diffs)


# ----------------------------------------------------------------------------- the megatron side (a subprocess)


def _megatron_reference(out_dir: str, port: str) -> None:
    import contextlib
    import warnings
    from functools import partial

    import torch.nn.functional as F

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    # megatron-core 0.16.1 calls these unconditionally; on a CPU-only torch they must be stubbed.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # no CUDA RNG states on CPU
    import megatron.core.transformer.moe.moe_utils as moe_utils

    moe_utils.te_general_gemm = None  # 0.16.1 names it only where Transformer Engine is installed
    functions = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "gelu_tanh": partial(F.gelu, approximate="tanh")}
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16)[None].expand(2, -1)
    causal = torch.triu(torch.ones(16, 16), 1).bool()[None, None]  # Megatron's default mask is built on CUDA
    results = {}
    for name, cfg in {**CASES, **MOE_CASES}.items():
        ours = _random_model(cfg)
        export = Path(out_dir) / f"export_{name}"
        export_megatron(ours.state_dict(), cfg, export, pad_vocab_multiple=128)
        # The Megatron model is the one our export describes (megatron_model_config.json), as a user would build it
        described = json.loads((export / "megatron_model_config.json").read_text())
        transformer = {**described["transformer_config"], "use_cpu_initialization": True, "hidden_dropout": 0.0,
                       "attention_dropout": 0.0, "params_dtype": torch.float32}
        transformer["activation_func"] = functions[transformer["activation_func"]]
        if cfg.moe.n_experts:
            transformer["moe_token_dispatcher_type"] = "allgather"  # alltoall makes CUDA streams

        def megatron_model(seed: int, transformer=transformer, gpt=described["gpt_model"]) -> GPTModel:
            torch.manual_seed(seed)
            tcfg = TransformerConfig(**transformer)
            spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False,
                                              normalization=tcfg.normalization)
            return GPTModel(tcfg, spec, **gpt).eval()

        megatron = megatron_model(2)
        loaded = dist_checkpointing.load(megatron.sharded_state_dict(), str(export / "iter_0000000"))
        megatron.load_state_dict(loaded, strict=False)
        with torch.no_grad():
            export_diff = (megatron(ids, positions, attention_mask=causal)[..., :100] - ours(ids)).abs().max().item()

        megatron = megatron_model(3)
        with torch.no_grad():
            for param in megatron.parameters():
                param.normal_(0, 0.2)
            for buffer_name, buffer in megatron.named_buffers():
                if buffer_name.endswith("expert_bias"):
                    buffer.normal_(0, 0.2)
        folder = Path(out_dir) / f"megatron_{name}"
        folder.mkdir()
        dist_checkpointing.save(megatron.sharded_state_dict(), str(folder))
        if cfg.moe.router_groups > 1:  # what tensors cannot say (grouped routing): the config saved beside them
            (folder / "meshformer_model_config.json").write_text((export / "meshformer_model_config.json").read_text())
            imported_cfg, state = import_megatron(folder)
        else:
            imported_cfg, state = import_megatron(folder, n_heads=cfg.attention.n_heads, vocab_size=100,
                                                  max_seq_len=cfg.max_seq_len, norm_eps=cfg.norm.eps,
                                                  experts_per_token=cfg.moe.experts_per_token
                                                  if cfg.moe.n_experts else None)
        imported = Transformer(imported_cfg).eval()
        imported.load_state_dict(state, strict=True)
        with torch.no_grad():
            reference = megatron(ids, positions, attention_mask=causal)[..., :100]
            import_diff = (reference - imported(ids)).abs().max().item()
        results[name] = {"export_then_megatron": export_diff, "megatron_then_import": import_diff}
    (Path(out_dir) / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":  # the main guard matters: megatron's saver starts multiprocessing helpers
    sys.path.insert(0, str(THIS.parents[2]))
    _megatron_reference(*sys.argv[1:])
