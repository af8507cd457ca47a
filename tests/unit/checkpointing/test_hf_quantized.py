"""Quantized Hugging Face folders (DeepSeek-V3's FP8 blocks, gpt-oss's MXFP4 experts) import dequantized: the
weights equal a dequantization written here from the formats' definitions, and the imported model's logits equal
transformers' on the same dequantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.hf_models import VOCAB, hf_model
from safetensors.torch import load_file, save_file

from meshformer.checkpointing import ConversionError
from meshformer.checkpointing.hf_folder import hf_source, import_hf
from meshformer.checkpointing.init_from import load_init_weights, resolve_init_from
from meshformer.cli import main
from meshformer.config import CheckpointConfig, Config, DataConfig
from meshformer.model import Transformer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

FP8_BLOCK = [16, 16]  # smaller than the published 128 so the tiny model's weights span several (and partial) blocks
E4M3_MAX = 448.0
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ----------------------------------------------------------------------------- the formats, from their definitions


def e4m3_value(byte: int) -> float:
    """OCP FP8 E4M3: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def e2m1_value(code: int) -> float:
    """OCP MX FP4 E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 0x8 else 1.0
    exponent, mantissa = (code >> 1) & 0x3, code & 0x1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


def reference_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """Each element's e4m3 value times the float32 scale of the block (row // b0, col // b1) holding it."""
    table = torch.tensor([e4m3_value(b) for b in range(256)], dtype=torch.float32)
    values = table[weight.view(torch.uint8).long()]
    rows = torch.arange(weight.shape[0]) // block[0]
    cols = torch.arange(weight.shape[1]) // block[1]
    return values * scale_inv[rows[:, None], cols[None, :]]


def reference_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Byte k of a 16-byte block holds values 2k (low nibble) and 2k + 1 (high nibble) of its 32; each value times
    2^(e8m0 - 127); stored (E, out, in), returned (E, in, out) as gpt-oss's unquantized experts are."""
    table = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float32)
    E, out, groups, _ = blocks.shape
    values = torch.empty(E, out, groups, 32)
    values[..., 0::2] = table[(blocks & 0xF).long()]
    values[..., 1::2] = table[(blocks >> 4).long()]
    values = values * torch.pow(2.0, scales.float() - 127)[..., None]
    return values.reshape(E, out, groups * 32).transpose(1, 2)


# ----------------------------------------------------------------------------- writing the quantized folders


def quantize_fp8(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block quantization: each block scaled so its largest magnitude is e4m3's 448."""
    rows, cols = weight.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    scale = torch.empty(nr, nc)
    for i in range(nr):
        for j in range(nc):
            tile = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / E4M3_MAX
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight / full).to(torch.float8_e4m3fn), scale


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, in, out) -> gpt-oss's (E, out, in / 32, 16) packed bytes and (E, out, in / 32) e8m0 exponents."""
    stored = weight.transpose(1, 2).float()
    E, out, n_in = stored.shape
    groups = stored.reshape(E, out, n_in // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scaled = groups / torch.pow(2.0, exponent)[..., None]
    magnitudes = torch.tensor(E2M1)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) | ((scaled < 0).long() << 3)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)


def _quantized_folder(arch: str, folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """(the quantized tensors as written, the folder): a tiny random model saved by transformers, its weights then
    rewritten in the published layout, with config.json's quantization_config."""
    hf_model(arch).save_pretrained(str(folder))
    tensors = load_file(str(folder / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if arch == "deepseek_v3" and name.startswith("model.layers.") and name.endswith("proj.weight"):
            out[name], out[name + "_scale_inv"] = quantize_fp8(tensor, FP8_BLOCK)  # linears; router, norms stay
        elif arch == "gpt_oss" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(tensor)
        else:
            out[name] = tensor
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": FP8_BLOCK} if arch == "deepseek_v3" else
                                     {"quant_method": "mxfp4", "modules_to_not_convert": [
                                         "model.layers.*.self_attn", "model.layers.*.mlp.router",
                                         "model.embed_tokens", "lm_head"]})
    (folder / "config.json").write_text(json.dumps(config))
    return out, folder


def _reference(written: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The unquantized tensors the folder stands for, dequantized by the reference functions above."""
    ref = {}
    for name, tensor in written.items():
        if name.endswith("_scale_inv") or name.endswith("_scales"):
            continue
        if name + "_scale_inv" in written:
            ref[name] = reference_fp8(tensor, written[name + "_scale_inv"], FP8_BLOCK)
        elif name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            ref[base] = reference_mxfp4(tensor, written[base + "_scales"])
        else:
            ref[name] = tensor
    return ref


@pytest.fixture(scope="module", params=["deepseek_v3", "gpt_oss"])
def quantized(request, tmp_path_factory):
    written, folder = _quantized_folder(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, written, folder


# ----------------------------------------------------------------------------- the tests


def test_quantized_tensors_read_as_their_reference_dequantization(quantized):
    _arch, written, folder = quantized
    reference = _reference(written)
    n_quantized = sum(name.endswith(("_scale_inv", "_scales")) for name in written)
    assert n_quantized >= 2
    theirs = hf_source(folder)
    assert sorted(theirs) == sorted(reference)  # scales are consumed, blocks read under the unquantized names
    for name, expected in reference.items():
        got = theirs[name]
        assert got.shape == expected.shape and theirs.meta(name).shape == expected.shape, name
        assert got.is_contiguous(), name
        if expected.is_floating_point() and name not in written:  # MXFP4: exact (e2m1 times a power of two)
            assert got.dtype == torch.float32 and torch.equal(got, expected), name
        elif name + "_scale_inv" in written:  # FP8: the same fp32 product
            assert got.dtype == torch.float32 and torch.equal(got, expected), name
        else:
            assert torch.equal(got, expected), name
    bf16 = hf_source(folder, dequantize_to=torch.bfloat16)
    name = next(n for n in reference if n not in written or n + "_scale_inv" in written)
    assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], reference[name].bfloat16())


def test_quantized_import_matches_transformers_on_the_dequantized_weights(quantized, tmp_path):
    arch, written, folder = quantized
    # transformers' model on the reference weights: an unquantized folder it loads with from_pretrained
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    config = json.loads((plain / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in _reference(written).items()}, str(plain / "model.safetensors"),
              metadata={"format": "pt"})
    theirs = getattr(transformers, type(hf_model(arch)).__name__).from_pretrained(str(plain), dtype=torch.float32)
    cfg, state = import_hf(folder)
    ours = Transformer(cfg).eval()
    ours.load_state_dict(state, strict=True)
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        expected = theirs.eval()(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, mask.bool())
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-4)
    assert expected.std() > 0.1


def test_quantized_folder_converts_from_the_command_line_and_exports_unquantized(quantized, tmp_path):
    from meshformer.checkpointing.weights import read_weights

    _arch, written, folder = quantized
    main(["convert", "import-hf", str(folder), str(tmp_path / "w"), "--dtype", "bf16"])
    _, state = read_weights(tmp_path / "w")
    _, imported = import_hf(folder, dequantize_to=torch.bfloat16)
    assert sorted(state) == sorted(imported)
    for name in state:
        assert torch.equal(state[name], imported[name]), name
    assert any(t.dtype == torch.bfloat16 for t in state.values())

    main(["convert", "export-hf", str(tmp_path / "w"), str(tmp_path / "out")])
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    exported = hf_source(tmp_path / "out")
    reference = _reference(written)
    assert sorted(exported) == sorted(reference)  # the unquantized names, no scales
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor.to(exported[name].dtype)), name


def test_init_from_reads_a_quantized_folder_dequantized(quantized):
    arch, _written, folder = quantized
    cfg = resolve_init_from(Config(data=DataConfig(seq_len=32), checkpoint=CheckpointConfig(init_from=f"hf:{folder}")))
    model = Transformer(cfg.model)
    assert load_init_weights([model], cfg) == arch
    _, imported = import_hf(folder)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, imported[name]), name


def test_unknown_method_missing_or_misshapen_scale_are_refused_in_one_line(quantized, tmp_path):
    _arch, written, folder = quantized
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], "quant_method": "awq"}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"quant_method='awq' is not a layout meshformer reads") as err:
        import_hf(bad)
    assert "\n" not in str(err.value)

    shutil.copy(folder / "config.json", bad / "config.json")
    scale = next(name for name in written if name.endswith(("_scale_inv", "_scales")))
    save_file({k: v for k, v in written.items() if k != scale}, str(bad / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"has no scale tensor") as err:
        import_hf(bad)
    assert "\n" not in str(err.value) and scale in str(err.value)

    save_file({**written, scale: written[scale][..., :1].contiguous()}, str(bad / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"has shape .* \(expected .*\)") as err:
        import_hf(bad)
    assert "\n" not in str(err.value) and scale in str(err.value)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process, as intended
def test_fp8_dequantization_equals_torch_checkpoint_reader(tmp_path):
    """torch.distributed.checkpoint's QuantizedHuggingFaceStorageReader (which needs a sharded index) dequantizes
    the same FP8 folder to the same tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    written, folder = _quantized_folder("deepseek_v3", tmp_path / "fp8")
    ours = hf_source(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict.fromkeys(written, "model.safetensors")}))
    loaded = {name: torch.empty(written[name].shape) for name in written if name + "_scale_inv" in written}
    dcp.load(loaded, storage_reader=QuantizedHuggingFaceStorageReader(str(folder), block_size=FP8_BLOCK[0]))
    assert len(loaded) > 10
    for name, tensor in loaded.items():
        assert torch.equal(ours[name], tensor), name
