"""Weights and configs between meshformer's `Transformer` and Hugging Face transformers' models.

    hf_model = to_hf_model(model)            # LlamaForCausalLM, GPT2LMHeadModel, T5ForConditionalGeneration, ...
    model = from_hf_model(hf_model)          # and back; logits agree (tests/unit/model/test_model_references.py)

Each architecture is one package meshformer/models/<model_type>/ whose adapter (checkpointing/hf_adapter.py) says
how its config maps both ways, what its tensors are called, what it refuses and what it requires of our config;
this module applies whichever adapter a model_type (or a config's features) selects and names none.

The name maps read and write tensors as save_pretrained stores them (what Hub checkpoints hold); in-memory models
go through transformers' own conversion to its modules' layout (from_pretrained / revert_weight_conversion).
`transformers` is imported lazily: it is a development dependency.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from meshformer.checkpointing.formats import Arch
from meshformer.checkpointing.hf_adapter import (
    ANY,
    HFAdapter,
    adapters,
    features,
    get_adapter,
    ignored_names,
    undeclared_options,
)
from meshformer.checkpointing.mapping import (
    ZERO_ON_IMPORT,
    export_tensors,
    finish_import,
    import_tensors,
    our_shapes,
)
from meshformer.config import ModelConfig, MtpConfig

if TYPE_CHECKING:
    from meshformer.model import Transformer
    from meshformer.model.families.naming import Rule

V = TypeVar("V")  # what a state dict maps names to (tensors, or the names themselves)


# ----------------------------------------------------------------------------- configs


def config_from_hf(hf_config: Any) -> ModelConfig:
    """The meshformer ModelConfig computing the same function as an HF config of one of `ARCHS`."""
    return get_adapter(hf_config.model_type).config_from_hf(hf_config)


def config_to_hf(cfg: ModelConfig, arch: Arch | None = None) -> Any:
    """A transformers config for `cfg` (checked with `check_compatible` first)."""
    arch = arch or infer_arch(cfg)
    check_compatible(cfg, arch)
    return get_adapter(arch).config_to_hf(cfg)


def incompatibilities(cfg: ModelConfig, arch: Arch) -> list[str]:
    """What keeps `cfg` from being expressed as `arch`, one 'key=value (needs ...)' line each."""
    adapter = get_adapter(arch)
    have = {**features(cfg), **(adapter.extra_features(cfg) if adapter.extra_features else {})}
    problems = []
    for key, need in adapter.requirements.items():
        if need == ANY:
            continue
        allowed = need if isinstance(need, set) else {need}
        if have[key] not in allowed:
            problems.append(f"{key}={have[key]!r} (needs {' or '.join(map(repr, sorted(allowed, key=str)))})")
    return problems + [f"{option} (no declaration lets a {arch} export write it)"
                       for option in undeclared_options(cfg, adapter)]


def check_compatible(cfg: ModelConfig, arch: Arch) -> None:
    problems = incompatibilities(cfg, arch)
    if problems:
        raise ValueError(f"this model cannot be expressed as {arch}: " + ", ".join(problems))


def infer_arch(cfg: ModelConfig) -> Arch:
    reasons = {arch: incompatibilities(cfg, arch) for arch in adapters()}
    for arch, problems in reasons.items():
        if not problems:
            return arch
    raise ValueError("no Hugging Face architecture matches this config: "
                     + " | ".join(f"{a}: {'; '.join(p)}" for a, p in reasons.items()))


class _ModelClasses(Mapping[str, str]):
    """model_type -> the transformers class export builds, from the registered adapters."""

    def __getitem__(self, arch: str) -> str:
        return get_adapter(arch).model_class

    def __iter__(self) -> Iterator[str]:
        return iter(adapters())

    def __len__(self) -> int:
        return len(adapters())


_MODEL_CLASSES: Mapping[str, str] = _ModelClasses()


# ----------------------------------------------------------------------------- state dicts


def name_rules(cfg: ModelConfig, arch: Arch) -> list[Rule]:
    """The tensor-name rules between `cfg`'s model and the HF architecture `arch`."""
    return get_adapter(arch).rules(cfg)


def derived_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig,
                    adapter: HFAdapter) -> Iterator[tuple[str, torch.Tensor]]:
    """The foreign tensors outside the name rules (`HFAdapter.derived`), from ours."""
    for derived in adapter.derived:
        yield from derived.to_theirs(state[derived.ours].detach(), cfg).items()


def to_hf_state_dict(model: Transformer, arch: Arch | None = None) -> dict[str, torch.Tensor]:
    """HF-named tensors for a meshformer `Transformer` (tied duplicates included, as HF state dicts have them)."""
    cfg: ModelConfig = model.cfg
    arch = arch or infer_arch(cfg)
    check_compatible(cfg, arch)
    ours = model.state_dict()
    check_exportable(ours, arch)
    out = export_tensors(ours, name_rules(cfg, arch))
    out.update(derived_tensors(ours, cfg, get_adapter(arch)))
    return out


def check_exportable(state: Mapping[str, torch.Tensor], arch: Arch) -> None:
    """Values no Hugging Face architecture here can hold: a nonzero expert selection bias (DeepSeek-V3's
    auxiliary-loss-free balancing shifts which experts a token picks) where the architecture has no such term."""
    if get_adapter(arch).holds_selection_bias:
        return
    for name in state:
        if ZERO_ON_IMPORT.search(name) and state[name].any():
            raise ValueError(f"{arch}: {name} is nonzero (a selection bias from model.moe.router_bias_update_rate, "
                             f"which {arch} has no place for: without it the model would pick other experts); only "
                             "a model trained without bias balancing can be converted")


def _normalize_names(hf_state: Mapping[str, V], arch: Arch) -> Mapping[str, V]:
    """Names as the LM-head models of transformers 5 use them: base-model checkpoints lack the adapter's base prefix;
    older checkpoints may spell names the old way (`HFAdapter.old_names`). Names the adapter refuses
    (`HFAdapter.refused_names`) end the import here, before any rule misses its tensor."""
    adapter = get_adapter(arch)
    for pattern, why in adapter.refused_names:
        found = next((k for k in hf_state if re.search(pattern, k)), None)
        if found is not None:
            raise ValueError(f"{arch}: {found}: {why}")
    prefix = adapter.base_prefix
    if prefix and not any(k.startswith(prefix) for k in hf_state):
        hf_state = {(k if k.startswith(adapter.keep_prefix) else prefix + k): v for k, v in hf_state.items()}
    if adapter.old_names is not None:
        hf_state = {adapter.old_names(k): v for k, v in hf_state.items()}
    return hf_state


def from_hf_state_dict(hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: Arch) -> dict[str, torch.Tensor]:
    """Our state dict (strict-loadable into `Transformer(cfg)`) from an HF state dict of `arch`.

    Accepts the LM-head model's names and base-model checkpoints (no "transformer."/"bert."/"model." prefix,
    BERT's gamma/beta). Every HF tensor must be used: anything with no counterpart raises instead of being
    dropped, except weightless buffers and what the adapter ignores (BERT's pooler / next-sentence head).
    """
    check_compatible(cfg, arch)
    hf_state = _normalize_names(hf_state, arch)
    shapes = our_shapes(cfg)
    out, used = import_tensors(hf_state, name_rules(cfg, arch), shapes, f"Hugging Face {arch}")
    for derived in get_adapter(arch).derived:
        out[derived.ours] = derived.to_ours({k: hf_state[k] for k in derived.reads if k in hf_state}).contiguous()
    return finish_import(out, cfg, shapes, unused_names(hf_state, used, arch), f"Hugging Face {arch}")


def unused_names(names: Iterable[str], used: set[str], arch: Arch) -> list[str]:
    """HF names no rule reads, other than weightless buffers and what the adapter ignores; the foreign tensors of
    its derived tensors count as read."""
    adapter = get_adapter(arch)
    used = used | {name for derived in adapter.derived for name in derived.reads}
    ignored = ignored_names(adapter)
    return [k for k in names if k not in used and not ignored.search(k)]


def to_hf_model(model: Transformer, arch: Arch | None = None) -> Any:
    """A Hugging Face model (in `model`'s dtype and train/eval mode) holding copies of its weights.

    Loaded by transformers' own from_pretrained from the checkpoint-named tensors, so its conversions to the
    modules' layout apply exactly as for a folder (e.g. Mixtral's per-expert linears into one fused tensor)."""
    import transformers

    arch = arch or infer_arch(model.cfg)
    state = to_hf_state_dict(model, arch)
    if model.cfg.mtp.depth:  # transformers builds no multi-token prediction modules: their tensors stay out
        main = {rule.theirs for rule in name_rules(replace(model.cfg, mtp=MtpConfig()), arch)}
        state = {name: tensor for name, tensor in state.items() if name in main}
    hf_model, info = getattr(transformers, _MODEL_CLASSES[arch]).from_pretrained(
        None, config=config_to_hf(model.cfg, arch), state_dict=state, output_loading_info=True,
        dtype=next(iter(state.values())).dtype)
    problems = {kind: names for kind, names in info.items() if names}
    if problems:  # a bug in our name maps: transformers would leave such weights random or drop them
        raise ValueError(f"transformers did not load the exported {arch} tensors exactly: {problems}")
    return hf_model.train(model.training)


def from_hf_model(hf_model: Any) -> Transformer:
    """A meshformer `Transformer` computing what a transformers model of one of `ARCHS` computes."""
    from transformers.core_model_loading import revert_weight_conversion

    from meshformer.model import Transformer

    cfg = config_from_hf(hf_model.config)
    # the tensors as save_pretrained writes them (checkpoint names and layout), which is what the name maps read
    hf_state = revert_weight_conversion(hf_model, dict(hf_model.state_dict()))
    state = from_hf_state_dict(hf_state, cfg, hf_model.config.model_type)
    model = Transformer(cfg).to(next(iter(state.values())).dtype)
    model.load_state_dict(state, strict=True)
    return model.train(hf_model.training)
