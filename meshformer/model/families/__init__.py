"""Model families: one module each, registered here. See `spec.py` for what a family declares."""

from __future__ import annotations

from meshformer.model.families import decoder, encoder, encoder_decoder
from meshformer.model.families.spec import FamilySpec

FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (decoder.SPEC, encoder.SPEC, encoder_decoder.SPEC)}


def get_family_spec(name: str) -> FamilySpec:
    if name not in FAMILIES:
        raise ValueError(f"unknown model.family {name!r}; registered families: {sorted(FAMILIES)}")
    return FAMILIES[name]


__all__ = ["FAMILIES", "FamilySpec", "get_family_spec"]
