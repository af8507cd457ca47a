"""Regenerate docs/design.md's "The tree" and "Words" sections: the tree from the package itself (each module's and
package's docstring, first sentence), the words from `WORDS` below. tests/unit/docs/test_design_tree.py checks the
page is current.

    python tools/design_tree.py            # rewrite docs/design.md in place
    python tools/design_tree.py --check    # exit 1 if the page is out of date
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "design.md"
PACKAGE = ROOT / "meshformer"
WIDTH = 118
COLUMN = 24  # where the comments start
DEPTH = 2  # package levels shown below meshformer/ (deeper packages: one line each)
COLLAPSED = {"models"}  # one folder per architecture: the folder's line says how many

# The tree's lines outside the package.
OUTSIDE = [
    ("configs/", "bundled configs: tiny ones for CPU, published models (README lists them)"),
    ("bench/", "benchmarks, as ratios against a reference in the same run; tables into docs/benchmarks/"),
    ("tests/", "by layer (tests/README.md): unit/ (mirrors the package), parity/, end_to_end/, bad_inputs/, "
               "helpers/"),
    ("tools/", "scripts that rebuild the bundled corpus and tokenizer, conversions, this page's generated parts"),
]

NAMING_RULE = (
    "One name, one meaning. A word below means only what it says here, in code, config keys and docs; a module's "
    "file name is unique in the package (a second meaning gets a second name), so a path names one thing, except "
    "where one name means one role in many packages: `__init__.py`, `__main__.py`, `cli.py` (a package's commands), "
    "`hf.py` (Hugging Face conversion: the shared one in `checkpointing/`, each architecture's in its folder), "
    "and `model/components/<name>.py`, the block component "
    "that declares `model/<name>.py`'s layer (tests/unit/docs/test_design_tree.py keeps the rule). A rename "
    "keeps the old Python import path or attribute working for two releases, with one FutureWarning per name per "
    "process naming the new one (`meshformer/renamed.py`, `meshformer/model/config_compat.py`); old TOML keys "
    "migrate (`meshformer/config/migrate.py`)."
)

# word -> its one meaning (sorted when rendered)
WORDS: dict[str, str] = {
    "plan": "only the memory planner (`planner/`, the `meshformer plan` command)",
    "ParallelModel": "the model as parallelized for a rank (`MeshParallelModel`, `PipelineParallelModel`), built "
                     "by `parallelize`",
    "TensorParallelRules": "a family's tensor-parallel styles",
    "StagePieces": "the pieces each pipeline stage holds",
    "layout": "the parallel layout (`ParallelDims`); the checkpoint folder's files are `checkpointing/directory.py`",
    "Loss": "the training objective every layout calls: the token loss plus the weighted auxiliary terms "
            "(`loss/objective.py`)",
    "LossSpec": "which token loss a run uses, before it is bound to a rank's vocabulary shard (`loss/token_loss.py`)",
    "model": "`model/`: the plain PyTorch model, its blocks and components; `models/`: one folder per Hugging Face "
             "architecture (`model_type`), the adapters that import and export it. The pair keeps its names: the "
             "architecture folders are found by package name at run time (`checkpointing/formats.py`, "
             "`MODELS_PACKAGE`) and named in every architecture's docs and tests, and each of their modules would "
             "need a stand-in; the singular is the one model, the plural the many it is converted from and to",
    "expert bias": "the router's `expert_bias` buffer, the selection bias that balances expert load (DeepSeek-V3's "
                   "aux-loss-free balancing, `model.moe.router_bias_update_rate`), a checkpoint key; the experts' "
                   "own projection biases are `model.moe.expert_linear_bias` (gpt-oss)",
    "errors": "`errors.py`: the one-line error surface of every command; a package's own error classes are "
              "`<package>_errors.py` (`checkpointing/checkpoint_errors.py`, `checkpointing/save_errors.py`)",
    "progress": "`progress.py`: the progress bar of long commands; `checkpointing/conversion_progress.py`: the "
                "conversions' use of it",
    "fault tolerance": "`runtime/fault_tolerance.py`: replica groups on torchft; `train/replica_step.py`: the "
                       "trainer's side of a replica group's step",
    "kind": "a block component's registered name (`model/components/`: `layer_types` / `mlp_types` values), and the "
            "`kind` key of the `[model.norm]`, `[model.residual]` tables, which picks one of their variants; other "
            "choices have their own word below",
    "loss method": "which computation of the token loss a run uses, `train.loss` with \"auto\" resolved (`LossMethod`, "
                   "`LossSpec.method`, `loss_choice.loss_method`)",
    "contents": "what a folder of ours holds: as its marker file says (`folders.mark`, `folders.scratch`), and for "
                "a checkpoint, as its trainer_state.json's `contents` says: \"training\" (weights, optimizer and "
                "trainer state) or \"weights\" (weights alone; `train_state.saved_contents`)",
    "scaling method": "how the rotary frequencies are rescaled for a longer context, `model.rope.scaling`: \"none\", "
                      "\"linear\", \"llama3\" or \"yarn\" (Hugging Face's rope_type; `RopeScaling.method`)",
    "layer term": "a loss term computed inside a layer (MoE balance and router z-losses, DSA's indexer loss): the "
                  "layer hands it over, the objective weighs and logs it (`loss/layer_terms.py`)",
    "update": "which update rule a parameter group of Muon or NorMuon takes, `group[\"update\"]`: \"muon\" (the "
              "matrices) or \"adamw\" (`optim/muon.py`)",
    "record type": "what a record of prepared shards holds: \"packed\" (token records) or \"pairs\" (src, tgt) "
                   "(`Manifest.record_type`, a data source's `record_type`); the manifest file keeps the key `kind`, "
                   "as its format was released",
    "hf_layer_types": "the `layer_types` values of a Hugging Face config.json an architecture's adapter imports "
                      "(`HFAdapter.hf_layer_types`)",
}

# Retired spellings: (a regex of the old spelling in its old meaning, that spelling, the word that replaced it).
# Listed under "Words"; tests/unit/docs/test_design_tree.py fails when one reappears in the package outside its
# deprecation path (a quoted old key is its entry in a table of renames).
RETIRED: list[tuple[str, str, str]] = [
    (r"\blayer_kinds\b", "`HFAdapter.layer_kinds`", "`hf_layer_types`"),
    (r"\bLossKind\b", "`LossKind`", "`LossMethod`"),
    (r"\bloss_kind\b", "`loss_kind`", "`loss_method`"),
    (r"\bLossSpec\(kind=", "`LossSpec.kind`", "`LossSpec.method`"),
    (r"(?<!\")\b(moe|cfg)\.expert_bias_terms\b", "`model.moe.expert_bias_terms`", "`model.moe.expert_linear_bias`"),
    (r"\b(manifest|source|s)\.kind\b", "`Manifest.kind`", "`Manifest.record_type`"),
    (r'group\["kind"\]|\bkind="(muon|adamw)"', "a Muon group's `\"kind\"`", '`"update"`'),
    (r"\bscaling\.kind\b|RopeScaling\(kind=", "`RopeScaling.kind`", "`RopeScaling.method`"),
    (r'"kind": "(training|weights)"|get\("kind"\) == "training"', "trainer_state.json's `\"kind\"`",
     '`"contents"`'),
]


def _summary(path: Path) -> str:
    """The first sentence of a module's docstring (a package: its __init__.py's)."""
    source = path / "__init__.py" if path.is_dir() else path
    if not source.is_file():
        readme = path / "README.md"
        return readme.read_text().splitlines()[0].lstrip("# ") if readme.is_file() else ""
    doc = ast.get_docstring(ast.parse(source.read_text())) or ""
    first = " ".join(doc.split("\n\n", 1)[0].split())
    depth = 0
    for i, char in enumerate(first):  # the first sentence: up to a . : or ; outside brackets, before a space
        depth += (char in "([") - (char in ")]")
        if char in ".:;" and depth == 0 and (i + 1 == len(first) or first[i + 1] == " "):
            return first[:i]
    return first


def _line(prefix: str, name: str, comment: str, bar: str) -> list[str]:
    """`prefix + name`, then `# comment` from COLUMN, wrapped onto lines that continue the tree's bars."""
    head = prefix + name
    if not comment:
        return [head]
    start = max(COLUMN, len(head) + 1)
    wrapped = textwrap.wrap(comment, WIDTH - start - 2) or [""]
    lines = [head.ljust(start) + "# " + wrapped[0]]
    lines += [bar.ljust(start) + "#   " + more for more in wrapped[1:]]
    return lines


def _children(folder: Path) -> list[Path]:
    items = [p for p in folder.iterdir() if ((p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py")
             and not p.name.startswith((".", "_"))]
    return sorted(items, key=lambda p: (p.is_dir(), p.name))


def _tree(folder: Path, prefix: str, depth: int) -> list[str]:
    lines: list[str] = []
    items = _children(folder)
    for i, path in enumerate(items):
        last = i == len(items) - 1
        branch, bar = ("└── ", "    ") if last else ("├── ", "│   ")
        name = path.name + ("/" if path.is_dir() else "")
        comment = _summary(path)
        if path.is_dir() and path.name in COLLAPSED:
            n = sum(1 for p in path.iterdir() if p.is_dir() and (p / "__init__.py").exists())
            comment = f"{comment} ({n} folders)"
        below = prefix + bar + ("│" if path.is_dir() and depth > 1 and path.name not in COLLAPSED else "")
        lines += _line(prefix + branch, name, comment, below)
        if path.is_dir() and depth > 1 and path.name not in COLLAPSED:
            lines += _tree(path, prefix + bar, depth - 1)
    return lines


def tree() -> str:
    lines = _line("", "meshformer/", "the package", "│")
    lines += _tree(PACKAGE, "", DEPTH)
    for name, comment in OUTSIDE:
        lines += _line("", name, comment, "")
    return "\n".join(line.rstrip() for line in lines)


def words() -> str:
    rule = textwrap.fill(NAMING_RULE, WIDTH)
    items = [textwrap.fill(f"- **{word}**: {meaning}.", WIDTH, subsequent_indent="  ", break_on_hyphens=False)
             for word, meaning in sorted(WORDS.items(), key=lambda item: item[0].lower())]
    retired = textwrap.fill("Retired spellings (a deprecated alias keeps each working for two releases): " + "; ".join(
        f"{old} is now {word}" for _, old, word in RETIRED) + ".", WIDTH)
    return rule + "\n\n" + "\n".join(items) + "\n\n" + retired


def render(page: str) -> str:
    """The page with its generated sections replaced."""
    page = re.sub(r"(## The tree\n\n```\n).*?(\n```\n)", lambda m: m.group(1) + tree() + m.group(2), page,
                  count=1, flags=re.S)
    return re.sub(r"(## Words\n\n).*?(\n\n## )", lambda m: m.group(1) + words() + m.group(2), page, count=1,
                  flags=re.S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    current = PAGE.read_text()
    wanted = render(current)
    if args.check:
        sys.exit(0 if wanted == current else 1)
    PAGE.write_text(wanted)


if __name__ == "__main__":
    main()
