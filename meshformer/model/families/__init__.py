"""Model families: one module each, registered here. See `spec.py` for what a family declares.

Adding a family: write `<name>.py` ending in `SPEC = ...` and add it to the tuple below; config validation,
the model, parallelism, checkpointing and training all read the registry.
"""

from __future__ import annotations

import difflib

from meshformer.errors import ConfigError
from meshformer.model.families import decoder, encoder, encoder_decoder
from meshformer.model.families.spec import FamilySpec

FAMILIES: dict[str, FamilySpec] = {}


def register_family(spec: FamilySpec) -> FamilySpec:
    """Make `spec` the family called `spec.name` (model.family = "<name>")."""
    if spec.name in FAMILIES and FAMILIES[spec.name] is not spec:
        raise ValueError(f"a model family called {spec.name!r} is already registered")
    FAMILIES[spec.name] = spec
    return spec


for _spec in (decoder.SPEC, encoder.SPEC, encoder_decoder.SPEC):
    register_family(_spec)


def get_family_spec(name: str) -> FamilySpec:
    if name not in FAMILIES:
        close = difflib.get_close_matches(name, FAMILIES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown model.family {name!r}",
                          f"{hint}registered families: {sorted(FAMILIES)} (model/families/__init__.py)")
    return FAMILIES[name]


__all__ = ["FAMILIES", "FamilySpec", "get_family_spec", "register_family"]
