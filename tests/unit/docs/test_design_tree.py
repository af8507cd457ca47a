"""docs/design.md's tree and words are generated (tools/design_tree.py) and current; the naming rule they state holds
for the package's file names; a renamed module's old import path works, warning once with the new path."""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from collections import defaultdict

import pytest
from helpers.common import ROOT

from meshformer.renamed import MOVED

sys.path.insert(0, str(ROOT / "tools"))
import design_tree

SHARED_ROLES = {"__init__.py", "__main__.py", "cli.py", "hf.py"}  # one role in many packages (the page's rule)


def test_the_design_page_is_current():
    assert design_tree.render(design_tree.PAGE.read_text()) == design_tree.PAGE.read_text(), \
        "regenerate it: python tools/design_tree.py"


def test_a_module_name_means_one_thing():
    package = ROOT / "meshformer"
    stand_ins = {name.replace(".", "/") + ".py" for name in MOVED}
    by_name = defaultdict(list)
    for path in package.rglob("*.py"):
        relative = path.relative_to(ROOT).as_posix()
        if path.name not in SHARED_ROLES and relative not in stand_ins:
            by_name[path.name].append(path.relative_to(package).as_posix())
    repeated = {name: sorted(paths) for name, paths in by_name.items() if len(paths) > 1}
    # a block component shares its name with the layer it declares
    for name, paths in list(repeated.items()):
        if set(paths) == {f"model/components/{name}", f"model/{name}"}:
            del repeated[name]
    assert repeated == {}


@pytest.mark.slow  # first imports of the new modules (torchft's among them) when run alone: ~7 s
def test_an_old_import_path_works_and_warns_once(monkeypatch):
    """Each old path, imported twice as if for the first time, gives the new module and one FutureWarning naming the
    new path."""
    for old, new in MOVED.items():
        monkeypatch.delitem(sys.modules, old, raising=False)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            first, second = importlib.import_module(old), importlib.import_module(old)
        assert first is second is importlib.import_module(new), old
        assert [w.category for w in seen] == [FutureWarning], (old, [str(w.message) for w in seen])
        assert new in str(seen[0].message) and "removed in" in str(seen[0].message)


def test_the_new_paths_import_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for new in MOVED.values():
            importlib.import_module(new)


def test_a_retired_word_stays_retired():
    """No module of the package or script of bench/ spells a retired name in its old meaning (docs/design.md's Words);
    only the line that belongs to its deprecation path (`renamed_attribute(...)`, `renamed_names(...)`, `renamed`)
    names it."""
    found = []
    for pattern, _, word in design_tree.RETIRED:
        for path in [*(ROOT / "meshformer").rglob("*.py"), *(ROOT / "bench").glob("*.py")]:
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(pattern, line) and not re.search(r"\brenamed(_\w+)?\b", line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()} (now: {word})")
    assert found == []


def _old_and_new() -> list[tuple[str, object, object]]:
    """(label, a function reading the old name, the new name's value) for each renamed attribute and module name."""
    from meshformer.data.shards import Manifest
    from meshformer.loss import token_loss
    from meshformer.loss.token_loss import LossSpec
    from meshformer.model.positions import RopeScaling
    from meshformer.models.qwen3_next.hf import ADAPTER
    from meshformer.train import loss_choice

    spec = LossSpec("chunked")
    manifest = Manifest("pairs", 0, "uint16", {}, {})
    scaling = RopeScaling("yarn", 4.0)
    return [("HFAdapter.hf_layer_types", lambda: ADAPTER.layer_kinds, ADAPTER.hf_layer_types),
            ("LossSpec.method", lambda: spec.kind, spec.method),
            ("token_loss.LossMethod", lambda: token_loss.LossKind, token_loss.LossMethod),
            ("loss_choice.loss_method", lambda: loss_choice.loss_kind, loss_choice.loss_method),
            ("Manifest.record_type", lambda: manifest.kind, manifest.record_type),
            ("RopeScaling.method", lambda: scaling.kind, scaling.method)]


def test_a_renamed_name_works_and_warns_once(monkeypatch):
    """Each old attribute or module name, read twice as if for the first time, gives the new one's value and one
    FutureWarning naming the new name."""
    from meshformer import renamed

    for new, read_old, value in _old_and_new():
        monkeypatch.setattr(renamed, "_warned_attributes", set())  # as if first read in this process
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            first, second = read_old(), read_old()  # type: ignore[no-untyped-call]
        assert first == second == value, new
        assert [w.category for w in seen] == [FutureWarning], (new, [str(w.message) for w in seen])
        assert new in str(seen[0].message) and "removed in" in str(seen[0].message), str(seen[0].message)


def test_a_module_without_the_old_name_still_raises():
    from meshformer.train import loss_choice

    with pytest.raises(AttributeError, match="no attribute 'loss_kinds'"):
        loss_choice.loss_kinds  # noqa: B018
