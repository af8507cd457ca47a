"""Hugging Face model folders (config.json + safetensors) <-> meshformer weights folders and checkpoints.

The name and layout mapping lives in hf.py; this module only reads and writes folders. Export goes through
transformers' own `save_pretrained`, so what it writes is exactly what `from_pretrained` expects. Import
reads the tensors directly (safetensors, or pytorch_model.bin with weights_only=True), without building
the HF model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from meshformer.checkpointing.checkpoint_errors import ConversionError
from meshformer.checkpointing.hf_adapter import find_adapter, get_adapter
from meshformer.checkpointing.hf_config_values import check_layer_types, check_values, note
from meshformer.checkpointing.mapping import iter_export
from meshformer.checkpointing.sharded_safetensors import (
    DEFAULT_MAX_SHARD_SIZE,
    SafetensorsFolder,
    ShardedWriter,
    has_safetensors,
)
from meshformer.config import ModelConfig, validate_model
from meshformer.data import Tokenizer
from meshformer.errors import ConfigError
from meshformer.folders import check_links

# a link leaving a model folder: with `convert import-hf` an option follows it; checkpoint.init_from reads the folder
LINKS_FIX = ("copy the linked files into the folder (cp -L), or pass --follow-links to `convert import-hf` if you "
             "mean to read them where they are")

if TYPE_CHECKING:
    from meshformer.checkpointing.hf import Arch
    from meshformer.model.families.naming import Rule


def export_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig, out_dir: Path, arch: Arch | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, tokenizer: Tokenizer | None = None,
              source: Mapping[str, Any] | None = None) -> Path:
    """Write a folder that transformers loads with AutoModelFor...from_pretrained; returns the folder.

    Tensors go out one at a time (read from `state` on access, mapped, written into HF-style shards); tied
    duplicates are left out, as save_pretrained leaves them out, and transformers re-ties them on load.
    `tokenizer` (the model's) goes with them, for AutoTokenizer, and names BOS/EOS/pad in both configs.
    config.json names the model class (`architectures`) and the weights' dtype (`dtype`, and `torch_dtype` for
    serving tools that read that name). `source`, the config.json of the Hugging Face folder the weights came
    from, gives its special-token ids and every key that leaves the function alone (`complete_config`).
    """
    from meshformer.checkpointing import hf

    try:
        arch = arch or hf.infer_arch(cfg)
        hf.check_compatible(cfg, arch)
    except ValueError as err:
        raise ConversionError(f"cannot export to Hugging Face: {err}", "choose another --arch, or leave it out to "
                              "pick the one that matches") from None
    try:
        hf.check_exportable(state, arch)
    except ValueError as err:  # no architecture holds these values: the message carries its own fix
        raise ConversionError(f"cannot export to Hugging Face: {err}") from None
    out_dir = Path(out_dir)
    hf_config = hf.config_to_hf(cfg, arch)
    if tokenizer is not None:
        _export_tokenizer(tokenizer, hf_config, cfg, out_dir)
    meta = _meta_view(state)
    dtype = next((meta[name].dtype for name in meta if meta[name].is_floating_point()), torch.float32)
    hf_config = complete_config(hf_config, arch, dtype, source)
    if tokenizer is not None:  # the ids config.json ends up with (the source folder's where it names them)
        _generation_config(hf_config).save_pretrained(str(out_dir))
    hf_config.save_pretrained(str(out_dir))
    # serving tools written for transformers 4 read the weights' dtype as torch_dtype
    config_file = out_dir / "config.json"
    written = json.loads(config_file.read_text())
    written["torch_dtype"] = written.get("dtype")
    config_file.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    # the files are planned from a pass on meta tensors (shapes only), then each tensor streams to disk
    writer = ShardedWriter(out_dir, dict(hf_tensors(meta, cfg, arch)), max_shard_size)
    for name, tensor in hf_tensors(state, cfg, arch):
        writer.add(name, tensor)
    writer.close()
    return out_dir


_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
# config.json keys that describe the file or the weights rather than the model: written for the export itself
_OWN_KEYS = ("architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "model_type",
             "quantization_config", "auto_map")


def complete_config(hf_config: Any, arch: Arch, dtype: torch.dtype, source: Mapping[str, Any] | None) -> Any:
    """`hf_config` naming its model class and `dtype`, with what `source` (the config.json of the folder the
    weights came from) holds that meshformer does not model: its special-token ids where it sets them and, from a
    folder of the same architecture, keys this config lacks and any other value that leaves the model config the
    same (e.g. use_cache, output_router_logits). A value that would change the function is the exported model's."""
    from huggingface_hub.errors import StrictDataclassError

    from meshformer.checkpointing import hf

    hf_config.architectures = [get_adapter(arch).model_class]
    hf_config.dtype = dtype
    if not source:
        return hf_config
    cls = type(hf_config)
    merged = hf_config.to_dict()
    merged.update({key: source[key] for key in _SPECIAL_IDS if source.get(key) is not None})
    function = hf.config_from_hf(hf_config)
    for key, value in source.items() if source.get("model_type") == arch else ():
        if key in _OWN_KEYS or key in _SPECIAL_IDS or merged.get(key) == value:
            continue
        trial = {**merged, key: value}
        try:
            if hf.config_from_hf(cls.from_dict(trial)) == function:
                merged = trial
        except (ValueError, TypeError, KeyError, AttributeError, StrictDataclassError):
            continue  # a value transformers or meshformer refuses: the export keeps its own
    return cls.from_dict(merged)


def _generation_config(hf_config: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(**{key: getattr(hf_config, key, None) for key in _SPECIAL_IDS
                               if getattr(hf_config, key, None) is not None})


def _export_tokenizer(tokenizer: Tokenizer, hf_config: Any, cfg: ModelConfig, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json (BOS/EOS/pad/unk/mask by name) through transformers' own fast
    tokenizer, and the special ids in `hf_config` (saved by the caller, with generation_config.json)."""
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    ids = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "pad": tokenizer.pad_id, "unk": tokenizer.unk_id,
           "mask": tokenizer.mask_id}
    tokens = {f"{role}_token": tokenizer.hf.id_to_token(i) for role, i in ids.items() if i is not None}
    fast = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tokenizer.json),
                                   model_max_length=cfg.max_seq_len, **tokens)
    fast.save_pretrained(str(out_dir))
    special = {f"{role}_token_id": ids[role] for role in ("bos", "eos", "pad")}
    if getattr(hf_config, "is_encoder_decoder", False):  # T5 starts decoding from BOS, as meshformer does
        special["decoder_start_token_id"] = tokenizer.bos_id
    for key, value in special.items():
        setattr(hf_config, key, value)


def _meta_view(state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """`state` as meta tensors of the same shapes and dtypes, read from file headers where `state` can."""
    from meshformer.checkpointing.safetensors_io import LazyState

    meta = state.meta if isinstance(state, LazyState) else (lambda name: state[name].to("meta"))
    return LazyState(list(state), meta)


def hf_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: Arch) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) one at a time, tied aliases left out, then those the adapter derives (BERT's tables)."""
    from meshformer.checkpointing import hf

    yield from iter_export(state, [rule for rule in hf.name_rules(cfg, arch) if not rule.alias])
    yield from hf.derived_tensors(state, cfg, get_adapter(arch))


def hf_source(folder: Path, follow_links: bool = False,
              dequantize_to: torch.dtype = torch.float32) -> Mapping[str, torch.Tensor]:
    """The tensors of an HF folder, read on access: model.safetensors or a sharded index (pytorch_model.bin,
    a single pickle, is loaded whole with weights_only=True). A quantized folder (config.json's
    quantization_config: FP8 blocks or MXFP4) reads as its unquantized tensors, in `dequantize_to`."""
    from meshformer.checkpointing.quantized import DequantizedFolder, quantization_config
    from meshformer.checkpointing.safetensors_io import LazyState

    folder = Path(folder)
    if has_safetensors(folder):
        files = SafetensorsFolder(folder, follow_links)
        quant = quantization_config(folder)
        if quant is not None:
            read = DequantizedFolder(files, quant, dequantize_to, folder)
            return LazyState(read.keys(), read.get, read.meta)
        return LazyState(files.keys(), files.get, files.meta)
    if (folder / "pytorch_model.bin").is_file():
        return _read_pickled(folder / "pytorch_model.bin")
    raise ConversionError(f"{folder} has no model.safetensors, model.safetensors.index.json or "
                          "pytorch_model.bin; point at a folder written by save_pretrained")


def _read_pickled(path: Path) -> Mapping[str, torch.Tensor]:
    """A pytorch_model.bin loaded with weights_only=True: tensors only, never code. A pickle holding anything else
    (or a damaged file) is refused in one line."""
    import pickle

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError) as err:
        # torch's refusal spans paragraphs; what follows "WeightsUnpickler error:" names what the pickle holds
        found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(err))
        reason = found.group(1).split(". ")[0] if found else (str(err).strip().splitlines() or [repr(err)])[0]
        raise ConversionError(f"{path} is not a plain file of tensors that loads without running code ({reason})",
                              "get the model's model.safetensors instead, or convert the file to safetensors where "
                              "you trust its source") from None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConversionError(f"{path} holds no state dict of tensors", "point at a folder save_pretrained wrote")
    return state


def lazy_from_hf(theirs: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: Arch,
                 folder: Path | None = None) -> Mapping[str, torch.Tensor]:
    """Our tensors computed from `theirs` on access (one foreign tensor read per tensor of ours).

    Names and shapes are checked up front, without reading data: every foreign tensor must be used (or be a known
    weightless buffer), every tensor of ours must have a source of the shape the config gives it. A foreign tensor
    holding NaN or inf is refused when read (`refuse_nonfinite`).
    """
    from meshformer.checkpointing import hf
    from meshformer.checkpointing.mapping import ZERO_ON_IMPORT, check_names, import_tensors, our_shapes
    from meshformer.checkpointing.safetensors_io import LazyState

    hf.check_compatible(cfg, arch)
    original = hf._normalize_names({k: k for k in theirs}, arch)  # normalised name -> name in the files
    shapes = our_shapes(cfg)
    source = f"Hugging Face {arch}"
    rules = hf.name_rules(cfg, arch)
    derived = {d.ours: d for d in get_adapter(arch).derived}  # our tensors read from several of theirs
    rules_of: dict[str, list[Rule]] = {}  # our tensor -> the rules giving it (one, or one per expert)
    for rule in rules:
        if rule.alias:
            continue
        if rule.theirs not in original:
            raise KeyError(f"{source} state dict lacks {rule.theirs!r} (needed for {', '.join(rule.ours)})")
        for name in rule.ours:
            rules_of.setdefault(name, []).append(rule)
    ours = [*rules_of, *derived]
    check_names(ours, cfg, shapes, hf.unused_names(original, {r.theirs for r in rules}, arch), source)
    tied = cfg.tie_embeddings and "output.weight" in shapes

    def reader(theirs: Mapping[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
        def foreign(names: Iterable[str], ours: str) -> dict[str, torch.Tensor]:
            """The foreign tensors named, as the files hold them, each refused if it holds NaN or inf."""
            tensors = {k: theirs[original[k]] for k in names}
            for k, tensor in tensors.items():
                refuse_nonfinite(tensor, original[k], ours, folder)
            return tensors

        def read(name: str) -> torch.Tensor:
            if tied and name == "output.weight":
                name = "tok_embeddings.weight"
            if name in derived:
                reads = [k for k in derived[name].reads if k in original]
                return derived[name].to_ours(foreign(reads, name)).contiguous()
            if ZERO_ON_IMPORT.search(name) and name not in rules_of:  # no foreign tensor holds it
                return torch.zeros(shapes[name])
            mine = rules_of[name]
            try:
                return import_tensors(foreign([r.theirs for r in mine], name), mine, shapes, source)[0][name]
            except ValueError as err:  # a shape that does not fit the config
                raise ConversionError(str(err)) from None
        return read

    # shapes and dtypes come from the same mapping run on meta tensors: writers plan files without reading data,
    # and every tensor's shape is checked against the config here, before anything is read or allocated
    meta = reader(_meta_view(theirs))
    for name in shapes:
        try:
            meta(name)
        except ConversionError as err:
            raise ConversionError(f"cannot import {folder or 'the folder'}: {err.what}", err.fix) from None
    return LazyState(list(shapes), reader(theirs), meta)


def refuse_nonfinite(tensor: torch.Tensor, theirs: str, ours: str, folder: Path | None) -> None:
    """A tensor of a Hugging Face folder holding NaN or inf ends an import (and checkpoint.init_from) in one line
    naming it: a model computed from it would only produce NaN."""
    if tensor.is_meta or not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
        return
    raise ConversionError(f"the tensor {theirs!r} of {folder or 'the folder'} (meshformer's {ours!r}) holds NaN or "
                          "inf values, so a model imported or trained from it computes NaN",
                          "restore or re-download the folder's weights, or point at another folder")


def open_hf(folder: Path, follow_links: bool = False,
            dequantize_to: torch.dtype = torch.float32) -> tuple[ModelConfig, Arch, Mapping[str, torch.Tensor]]:
    """(our config, the architecture, its tensors read on access under their own names) of a Hugging Face
    folder: only config.json and the files' headers are read. Its files must lie in it (or, for a hub cache
    snapshot, in the cache's blobs/) unless `follow_links`. Quantized tensors read dequantized to `dequantize_to`."""
    from meshformer.checkpointing import hf

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ConversionError(f"{folder} has no config.json; point at a Hugging Face model folder")
    if not follow_links:
        check_links(folder, [p for p in folder.iterdir() if p.is_file()], what=f"Hugging Face folder {folder}",
                    fix=LINKS_FIX)
    theirs = hf_source(folder, follow_links, dequantize_to)
    raw, hf_config = _read_config(folder / "config.json", len(theirs))
    text = getattr(hf_config, "text_config", None)
    if find_adapter(hf_config.model_type) is None and find_adapter(getattr(text, "model_type", None)):
        # a multimodal folder whose language model we convert: its adapter leaves the other towers unread
        hf_config, raw = text, raw.get("text_config") or {}
    try:
        adapter = find_adapter(hf_config.model_type)
        if adapter is not None:  # (an unknown model_type is refused next, naming the supported ones)
            check_layer_types(hf_config, raw, adapter)
        cfg = hf.config_from_hf(hf_config)
    except (ValueError, KeyError) as err:
        raise ConversionError(f"cannot import {folder}: {err}") from None
    try:  # a model the trainer would refuse is not written (nor generated from)
        validate_model(cfg, f"hf:{folder}")
    except ConfigError as err:
        raise ConversionError(f"cannot import {folder}: its config.json gives {err.what}", "fix that value in "
                              "config.json, or point at the folder save_pretrained wrote") from None
    return cfg, hf_config.model_type, theirs


def import_hf(folder: Path, *, show_progress: bool | None = None, follow_links: bool = False,
              dequantize_to: torch.dtype = torch.float32) -> tuple[ModelConfig, Mapping[str, torch.Tensor]]:
    """(our config, our tensors read on access) from a Hugging Face folder of one of `hf.ARCHS`; a quantized
    folder's weights come dequantized to `dequantize_to` (fp32 or bf16)."""
    cfg, arch, theirs = open_hf(folder, follow_links, dequantize_to)
    try:
        return cfg, lazy_from_hf(theirs, cfg, arch, folder)
    except (ValueError, KeyError) as err:
        raise ConversionError(f"cannot import {folder}: {err}") from None


def _read_config(path: Path, n_tensors: int) -> tuple[dict[str, Any], Any]:
    """(config.json as written, transformers' config of it), its values checked first (`check_values`); a value
    transformers rejects is named too."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    fix = "fix that value in config.json, or point at the folder save_pretrained wrote"
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("it is not a JSON object")
        notes = check_values(raw, n_tensors)
        hf_config = AutoConfig.from_pretrained(str(path.parent))
    except (ValueError, TypeError, KeyError, StrictDataclassError) as err:
        raise ConversionError(f"{path}: {_first_line(err)}", fix) from None
    note(notes)
    return raw, hf_config


def _first_line(err: BaseException) -> str:
    """transformers' validation errors span lines (the key on the first); the one-line form keeps it."""
    return " ".join(str(err).split("\n", 2)[:2])
