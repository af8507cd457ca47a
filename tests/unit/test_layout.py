"""`tests/unit/` mirrors the package (tests/README.md, "Unit tests mirror the package"): a test file sits in the folder
named after the package folder it tests (`unit/model/` for `meshformer/model/`, `unit/models/<arch>/` for
`meshformer/models/<arch>/`), or in `unit/bench/` and `unit/docs/` for the scripts and pages outside the package; a
file directly in `unit/` tests a top-level module and is named after it (`test_folders.py` for `folders.py`), or is
this one."""

from __future__ import annotations

from pathlib import Path

from helpers.common import ROOT

UNIT = ROOT / "tests" / "unit"
PACKAGE = ROOT / "meshformer"
OUTSIDE_THE_PACKAGE = {"bench", "docs"}  # repository folders whose scripts and pages unit tests check
TREE = "test_layout.py"  # this file: it tests the tests' own tree, so it sits at its top


def misplaced(unit: Path, package: Path) -> list[str]:
    """The test files under `unit` that sit outside the mirror of `package`, each with what the rule wants."""
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    found = []
    for path in sorted(unit.rglob("test_*.py")):
        folder = path.parent.relative_to(unit)
        if folder == Path("."):
            named = any(path.stem == f"test_{m}" or path.stem.startswith(f"test_{m}_") for m in modules)
            if path.name != TREE and not named:
                found.append(f"{path.relative_to(unit)}: move it to unit/<package folder>/ (or name it after a "
                             "top-level module: test_<module>[_what].py)")
        elif not (package / folder).is_dir() and folder.parts[0] not in OUTSIDE_THE_PACKAGE:
            found.append(f"{path.relative_to(unit)}: meshformer/{folder.as_posix()}/ does not exist")
    return found


def test_every_unit_test_file_sits_in_the_mirror_of_the_package():
    assert misplaced(UNIT, PACKAGE) == []


def test_a_file_outside_the_mirror_is_named(tmp_path):
    package, unit = tmp_path / "meshformer", tmp_path / "unit"
    for folder in (package / "model", unit / "model", unit / "modle", unit / "bench"):
        folder.mkdir(parents=True)
    (package / "folders.py").write_text("")
    for name in ("model/test_moe.py", "modle/test_moe2.py", "bench/test_tables.py", "test_folders_claims.py",
                 "test_moe.py"):
        (unit / name).write_text("")
    assert [line.split(":")[0] for line in misplaced(unit, package)] == ["modle/test_moe2.py", "test_moe.py"]
