"""Folders for the conversion cases of #25: a tiny model as a weights folder, a Hugging Face folder and a
Megatron checkpoint, plus hostile or damaged copies (indexes naming files outside their folder, tensors the
index or the file lacks, absurd config.json values) and a folder of someone else's files."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from meshformer.checkpointing.dcp_io import read_metadata
from meshformer.checkpointing.hf_folder import export_hf
from meshformer.checkpointing.megatron import export_megatron
from meshformer.checkpointing.weights import CONFIG_FILE, write_weights
from meshformer.config import AttentionConfig, FfnConfig, MlaConfig, ModelConfig, MoeConfig, NormConfig, RopeConfig
from meshformer.config.migrate import model_from_flat
from meshformer.model import Transformer

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, max_seq_len=64, attention=AttentionConfig(n_heads=4),
                  ffn=FfnConfig(d_ff=64))
MOE_CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, position="rope", bias=False, max_seq_len=64,
                      attention=AttentionConfig(n_heads=4, qk_norm=True), ffn=FfnConfig(d_ff=32, activation="swiglu"),
                      norm=NormConfig(kind="rmsnorm"), moe=MoeConfig(n_experts=4))
# Gemma 3's blocks, but its windowed blocks rotate with the scaled global RoPE (no rope_local_theta)
GEMMA_SCALED_CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, scale_embeddings=True, position="rope",
                               layer_types=["sliding_attention", "full_attention"], bias=False, max_seq_len=64,
                               tie_embeddings=True, attention=AttentionConfig(n_heads=4, qk_norm=True, window=4),
                               ffn=FfnConfig(d_ff=32, activation="geglu"),
                               rope=RopeConfig(scaling="linear", factor=2.0),
                               norm=NormConfig(kind="rmsnorm", position="sandwich", weight_offset=1.0))
# a Llama with linearly scaled RoPE
ROPE_CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, position="rope", bias=False, max_seq_len=64,
                       attention=AttentionConfig(n_heads=4), ffn=FfnConfig(d_ff=32, activation="swiglu"),
                       rope=RopeConfig(scaling="linear", factor=2.0), norm=NormConfig(kind="rmsnorm"))
# gpt-oss's pieces (sinks, biased router and experts, the clamped SwiGLU): exported as GptOssForCausalLM
GPT_OSS_CFG = model_from_flat(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=16,
                              activation="swiglu_clamped", norm="rmsnorm", position="rope", bias=True, max_seq_len=64,
                              tie_embeddings=False, attention_sinks=True, attention_window=4, full_attention_every=2,
                              n_experts=4, experts_per_token=2, router_bias=True, expert_bias_terms=True)
DEEPSEEK_CFG = model_from_flat(vocab_size=64, d_model=32, n_heads=4, n_layers=2, d_ff=16, activation="swiglu",
                               norm="rmsnorm", position="rope", bias=False, max_seq_len=64, tie_embeddings=False,
                               layer_types=["mla"], mla=MlaConfig(kv_lora_rank=8, qk_nope_head_dim=4,
                                                                  qk_rope_head_dim=4, v_head_dim=4),
                               n_experts=4, experts_per_token=2, moe_first_dense=1, router_score="sigmoid")
SHARD = "model-00001-of-00001.safetensors"


def same_size_other_tokenizer(path: Path) -> Path:
    """The bundled tokenizer with two tokens' ids swapped, written to `path`: the same 4096 tokens, a different
    tokenizer (a size check alone cannot tell it from the bundled one)."""
    from meshformer.data import load_tokenizer

    raw = json.loads(load_tokenizer("bundled:kjv-bpe-4k").json)
    vocab = raw["model"]["vocab"]
    a, b = "\u0120the", "\u0120and"  # byte-level BPE spells a leading space \u0120
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(raw))
    return path


def indexed(src: Path, folder: Path, weight_map: dict[str, str], tensors: dict | None = None) -> Path:
    """A copy of the weights or HF folder `src` as one shard (`tensors`, default all) and an index `weight_map`."""
    shutil.copytree(src, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(load_file(src / "model.safetensors") if tensors is None else tensors, str(folder / SHARD))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _hf_with(src: Path, folder: Path, **values: object) -> Path:
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **values}))
    return folder


def _megatron_outside(src: Path, folder: Path) -> Path:
    """A copy of the Megatron checkpoint `src` whose .metadata names the original's data files by `../` paths."""
    shutil.copytree(src, folder)
    step = folder / "iter_0000000"
    metadata = read_metadata(step)
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=f"../../{src.name}/iter_0000000/"
                                                                                f"{info.relative_path}")
                             for index, info in metadata.storage_data.items()}
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    for data in step.glob("*.distcp"):
        data.unlink()
    return folder


def megatron_with_extra_tensors(step: Path, dest: Path, extra: dict) -> Path:
    """The Megatron checkpoint step folder `step` saved again at `dest` (a step folder) with the tensors `extra`
    beside its own, and the meshformer config saved beside it when it has one."""
    import torch.distributed.checkpoint as dcp

    from meshformer.checkpointing.dcp_io import read_full_tensors, tensor_entries
    from meshformer.checkpointing.megatron_config import SAVED_CONFIG

    tensors = read_full_tensors(step, list(tensor_entries(read_metadata(step))))
    dcp.save({**tensors, **extra}, checkpoint_id=str(dest), no_dist=True)
    if (step.parent / SAVED_CONFIG).is_file():
        shutil.copyfile(step.parent / SAVED_CONFIG, dest.parent / SAVED_CONFIG)
    return dest


def _megatron_extra(src: Path, folder: Path) -> Path:
    """A copy of the Megatron checkpoint `src` holding one tensor more than ours have (a multi-token-prediction
    layer's norm, as DeepSeek-V3-style Megatron runs save)."""
    import torch

    shutil.copytree(src, folder, ignore=shutil.ignore_patterns(".metadata", "*.distcp"))
    megatron_with_extra_tensors(src / "iter_0000000", folder / "iter_0000000",
                                {"mtp.layers.0.enorm.weight": torch.ones(CFG.d_model)})
    return folder


class _Code:
    """Pickles as a call of `print`: a pickle that runs code when loaded (weights_only loading refuses it)."""

    def __reduce__(self):
        return print, ("this pickle runs code",)


def _damaged_weights(hf: Path, tmp: Path) -> None:
    """(#33) Copies of the HF folder `hf` whose weights file is cut short, has a header whose length lies, or is a
    pickled pytorch_model.bin that runs code."""
    import struct

    import torch

    data = (hf / "model.safetensors").read_bytes()
    lying = struct.pack("<Q", 10**12) + data[8:]
    for name, content in {"truncated": data[: len(data) // 2], "header-lies": lying}.items():
        shutil.copytree(hf, tmp / f"cv-hf-{name}")
        (tmp / f"cv-hf-{name}" / "model.safetensors").write_bytes(content)
    shutil.copytree(hf, tmp / "cv-hf-pickle", ignore=shutil.ignore_patterns("model.safetensors"))
    torch.save({"wte.weight": _Code()}, tmp / "cv-hf-pickle" / "pytorch_model.bin")


def mxfp4_experts(folder: Path) -> Path:
    """The gpt-oss folder `folder` with its experts' weights stored under the names the Hub's MXFP4 checkpoints use
    (gate_up_proj_blocks / _scales, down_proj_blocks / _scales; the values are placeholders)."""
    tensors = load_file(folder / "model.safetensors")
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors.pop(name)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = weight.to(torch.uint8), weight[..., 0].to(torch.uint8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def fp8_blocks(folder: Path) -> Path:
    """The DeepSeek-V3 folder `folder` with a block scale beside each linear weight, as the Hub's FP8 checkpoints
    store them (weight_scale_inv; the values are placeholders)."""
    tensors = load_file(folder / "model.safetensors")
    for name in [k for k in tensors if k.endswith("proj.weight")]:
        tensors[name.replace(".weight", ".weight_scale_inv")] = torch.ones(1)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def convert_case_files(tmp: Path) -> None:
    """The folders, named cv-*, under `tmp`."""
    state = Transformer(CFG).state_dict()
    weights, hf = tmp / "cv-weights", tmp / "cv-hf"
    write_weights(state, CFG, weights)
    export_hf(state, CFG, hf)
    export_megatron(state, CFG, tmp / "cv-mc")
    _megatron_outside(tmp / "cv-mc", tmp / "cv-mc-outside")
    _megatron_extra(tmp / "cv-mc", tmp / "cv-mc-extra")
    tensors = load_file(weights / "model.safetensors")
    shutil.copy(weights / "model.safetensors", tmp / "cv-elsewhere.safetensors")
    indexed(weights, tmp / "cv-index-outside", dict.fromkeys(tensors, "../cv-elsewhere.safetensors"))
    indexed(weights, tmp / "cv-index-absolute", dict.fromkeys(tensors, str(tmp / "cv-elsewhere.safetensors")))
    indexed(weights, tmp / "cv-index-drops", {k: SHARD for k in tensors if k != "tok_embeddings.weight"})
    indexed(weights, tmp / "cv-index-lies", dict.fromkeys(tensors, SHARD),
             {k: v for k, v in tensors.items() if k != "tok_embeddings.weight"})
    shutil.copy(hf / "model.safetensors", tmp / "cv-hf-elsewhere.safetensors")
    indexed(hf, tmp / "cv-hf-outside", dict.fromkeys(load_file(hf / "model.safetensors"),
                                                       "../cv-hf-elsewhere.safetensors"))
    _damaged_weights(hf, tmp)
    shutil.copytree(hf, tmp / "cv-hf-linked", ignore=shutil.ignore_patterns("model.safetensors"))
    (tmp / "cv-hf-linked" / "model.safetensors").symlink_to(tmp / "cv-hf-elsewhere.safetensors")
    for name, values in {"zero-heads": {"n_head": 0}, "zero-width": {"n_embd": 0}, "list": {"n_layer": [2]},
                         "string": {"n_embd": "32"}, "eps-string": {"layer_norm_epsilon": "small"},
                         "heads-divide": {"n_head": 5}, "layers": {"n_layer": 10**9}}.items():
        _hf_with(hf, tmp / f"cv-hf-{name}", **values)
    # an MoE model (exported as Qwen3-MoE: it has QK-norm), and a Qwen3-MoE whose dense block is not a prefix
    moe = Transformer(MOE_CFG).state_dict()
    write_weights(moe, MOE_CFG, tmp / "cv-moe-weights")
    export_hf(moe, MOE_CFG, tmp / "cv-moe-hf")
    _hf_with(tmp / "cv-moe-hf", tmp / "cv-moe-hf-dense-last", mlp_only_layers=[1])
    # an OLMoE (QK-norm over the whole projections) that clamps q / k / v
    olmoe = dataclasses.replace(MOE_CFG, attention=dataclasses.replace(MOE_CFG.attention, qk_norm_scope="projection"))
    export_hf(Transformer(olmoe).state_dict(), olmoe, tmp / "cv-olmoe-hf")
    _hf_with(tmp / "cv-olmoe-hf", tmp / "cv-olmoe-hf-clip", clip_qkv=8.0)
    write_weights(Transformer(GEMMA_SCALED_CFG).state_dict(), GEMMA_SCALED_CFG, tmp / "cv-gemma-scaled-weights")
    # a gpt-oss folder whose experts are stored as the Hub's MXFP4 blocks and scales
    mxfp4_experts(export_hf(Transformer(GPT_OSS_CFG).state_dict(), GPT_OSS_CFG, tmp / "cv-gpt-oss-mxfp4"))
    # a DeepSeek-V3 folder stored in FP8 blocks with their scales
    fp8_blocks(export_hf(Transformer(DEEPSEEK_CFG).state_dict(), DEEPSEEK_CFG, tmp / "cv-deepseek-fp8"))
    # (#33) config.json values transformers loads but the trainer refuses: import-hf must refuse them too
    _hf_with(tmp / "cv-moe-hf", tmp / "cv-moe-hf-top-k", num_experts_per_tok=8)
    rope = export_hf(Transformer(ROPE_CFG).state_dict(), ROPE_CFG, tmp / "cv-rope-hf")
    rope_parameters = json.loads((rope / "config.json").read_text())["rope_parameters"]
    for name, values in {"factor": {"factor": -8.0}, "nan": {"factor": float("nan")},
                         "theta": {"rope_theta": 0.0}}.items():
        _hf_with(rope, tmp / f"cv-rope-hf-{name}", rope_parameters={**rope_parameters, **values})
    user = tmp / "cv-user"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work\n")
    (user / CONFIG_FILE).write_text("{}\n")  # a name of ours, in a folder we did not write
    same_size_other_tokenizer(tmp / "cv-other-tokenizer.json")
