"""Quantized Hugging Face folders read as plain weights: each quantized tensor is dequantized as it is read.

Two published layouts, named by config.json's quantization_config.quant_method:

- "fp8" (DeepSeek-V3 / Kimi K2 and their kin): `<name>.weight` float8 e4m3 with `<name>.weight_scale_inv` float32,
  one scale per weight_block_size block (128 x 128): weight = e4m3 value * scale of its block.
- "mxfp4" (gpt-oss): `<name>_blocks` uint8 (E, out, in / 32, 16), two e2m1 values per byte (low nibble first),
  with `<name>_scales` uint8 (E, out, in / 32), one e8m0 exponent (2^(s - 127)) per 32 values; the dequantized
  tensor is `<name>`, stored (E, in, out) as the unquantized experts are.

The folder then reads as if it held `<name>.weight` / `<name>` in the dtype asked for (fp32 or bf16), one tensor
at a time. Why not torch.distributed.checkpoint's QuantizedHuggingFaceStorageReader, which knows both layouts: it
is a DCP storage reader, filling a preallocated state dict through a load plan; each load re-reads every shard's
header, it needs a sharded index (no single model.safetensors), it keeps the quantized names and the (out, in)
expert layout, and a dcp.load of a tiny gpt-oss folder's MXFP4 experts through it (torch 2.13) returned values
other than the format's past the first few.
Our import streams one named tensor at a time through the name maps, so the arithmetic (a few lines per format)
is done here, per tensor, on the files' own reader (`SafetensorsFolder`); the FP8 results are tested equal to
torch's reader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from meshformer.checkpointing.checkpoint_errors import ConversionError
from meshformer.checkpointing.sharded_safetensors import SafetensorsFolder

METHODS = ("fp8", "mxfp4")
FP8_SCALE = ".weight_scale_inv"
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"
MX_GROUP = 32  # values sharing one e8m0 scale
# e2m1 codes 0..15: sign bit, then 2 exponent bits and 1 mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quantization_config(folder: Path) -> dict[str, Any] | None:
    """config.json's quantization_config (the language model's, for a multimodal folder), or None. A config.json
    that does not parse is left to the config reader, which names the problem."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    return quant if isinstance(quant, dict) else None


class DequantizedFolder:
    """A quantized folder's tensors under their unquantized names, dequantized to `dtype` on each read (nothing
    cached: a model never sits in memory twice). Scales are paired with their weights up front, from the headers."""

    def __init__(self, files: SafetensorsFolder, quant: dict[str, Any], dtype: torch.dtype, folder: Path) -> None:
        method = quant.get("quant_method")
        if method not in METHODS:
            raise ConversionError(f"{folder}/config.json: quantization_config.quant_method={method!r} is not a "
                                  f"layout meshformer reads (it reads {', '.join(METHODS)})", "dequantize the model "
                                  "in transformers, save_pretrained it unquantized, and import that folder")
        self.files, self.method, self.dtype, self.folder = files, method, dtype, folder
        names = files.keys()
        self.scales: dict[str, str] = {}  # our name -> its scale tensor
        self.stored: dict[str, str] = {}  # our name -> the quantized tensor in the files
        if method == "fp8":
            block = quant.get("weight_block_size") or (128, 128)
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise ConversionError(f"{folder}/config.json: quantization_config.weight_block_size={block!r} is "
                                      "not two positive block sizes", "set it to the folder's [rows, columns] "
                                      "blocks (DeepSeek-V3: [128, 128])")
            self.block = (int(block[0]), int(block[1]))
            for name in names:
                if name.endswith(FP8_SCALE):
                    weight = name[: -len(FP8_SCALE)] + ".weight"
                    self._pair(weight, weight, name, names)
            for name in names:
                if name not in self.stored and files.meta(name).dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    self._missing(name, name[: -len(".weight")] + FP8_SCALE)
        else:
            for name in names:
                if name.endswith(MX_SCALES):
                    base = name[: -len(MX_SCALES)]
                    self._pair(base, base + MX_BLOCKS, name, names)
            for name in names:
                if name.endswith(MX_BLOCKS) and name[: -len(MX_BLOCKS)] not in self.stored:
                    self._missing(name, name[: -len(MX_BLOCKS)] + MX_SCALES)
        hidden = set(self.stored.values()) | set(self.scales.values())
        self._names = [n for n in names if n not in hidden] + list(self.stored)
        for name in self.stored:
            self.meta(name)  # every scale's shape checked against its weight's, before any data is read

    def _pair(self, ours: str, stored: str, scale: str, names: list[str]) -> None:
        if stored not in self.files:
            raise ConversionError(f"{self.folder} holds the scale {scale!r} but not the weight {stored!r} it "
                                  "scales", "copy every file of the folder (and its index) again whole")
        self.stored[ours], self.scales[ours] = stored, scale

    def _missing(self, stored: str, scale: str) -> None:
        raise ConversionError(f"{self.folder}: the {self.method} weight {stored!r} has no scale tensor {scale!r}",
                              "copy every file of the folder (and its index) again whole")

    def keys(self) -> list[str]:
        return list(self._names)

    def meta(self, name: str) -> torch.Tensor:
        if name not in self.stored:
            return self.files.meta(name)
        weight, scale = self.files.meta(self.stored[name]), self.files.meta(self.scales[name])
        if self.method == "fp8":
            want = tuple(-(-size // block) for size, block in zip(weight.shape, self.block, strict=False))
            shape = tuple(weight.shape)
            ok = weight.dim() == 2 and tuple(scale.shape) == want
        else:
            *prefix, groups, half = weight.shape
            want = (*prefix, groups)
            shape = (*prefix[:-1], groups * half * 2, prefix[-1]) if prefix else ()
            ok = weight.dim() == 4 and weight.dtype == torch.uint8 and tuple(scale.shape) == want \
                and half * 2 == MX_GROUP
        if not ok:
            raise ConversionError(f"{self.folder}: {self.scales[name]!r} has shape {tuple(scale.shape)} for the "
                                  f"{self.method} weight {self.stored[name]!r} of shape {tuple(weight.shape)} "
                                  f"(expected {want})", "copy the folder again whole, or point at an "
                                  "unquantized one")
        return torch.empty(shape, dtype=self.dtype, device="meta")

    def get(self, name: str) -> torch.Tensor:
        if name not in self.stored:
            return self.files.get(name)
        weight, scale = self.files.get(self.stored[name]), self.files.get(self.scales[name])
        if self.method == "fp8":
            return dequantize_fp8(weight, scale, self.block, self.dtype)
        return dequantize_mxfp4(weight, scale, self.dtype)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:
    """(rows, cols) float8 * its (ceil(rows / b0), ceil(cols / b1)) block scales, in fp32, then `dtype`."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float().mul_(scale).to(dtype)


MX_CHUNK = 1 << 20  # 16-byte blocks dequantized at a time: bounds the index temporaries of a 100 GB expert tensor


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., out, groups, 16) packed e2m1 bytes with (..., out, groups) e8m0 exponents -> (..., in, out), computed
    in fp32 (exact: e2m1 times a power of two), then `dtype`."""
    *prefix, groups, half = blocks.shape
    lut = torch.tensor(E2M1, dtype=torch.float32)
    out = torch.empty(*prefix, groups, half * 2)
    packed, exponents, values = blocks.reshape(-1, half), scales.reshape(-1, 1), out.view(-1, half * 2)
    for start in range(0, packed.shape[0], MX_CHUNK):
        chunk, rows = packed[start:start + MX_CHUNK], values[start:start + MX_CHUNK]
        rows[:, 0::2] = lut[(chunk & 0x0F).long()]  # the low nibble holds the even element
        rows[:, 1::2] = lut[(chunk >> 4).long()]
        rows.copy_(torch.ldexp(rows, exponents[start:start + MX_CHUNK].to(torch.int32) - 127))
    stored = out.view(*prefix, groups * half * 2).transpose(-1, -2)
    return torch.empty(stored.shape, dtype=dtype).copy_(stored)  # (..., in, out) laid out contiguously, in `dtype`
