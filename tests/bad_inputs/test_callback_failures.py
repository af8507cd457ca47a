"""A user's callback that fails (in a hook, at import, with a syntax error, in its constructor; `SystemExit(0)`
too) ends the run in one line naming `callbacks[i]`, its path and where it failed, with its traceback kept in the
run folder's diagnostics/; a value in ctx.metrics that is no number is one line naming the key and the callback,
and a 0-d tensor is taken as its float. Paths that importlib would take as relative imports are refused at the
config check."""

from __future__ import annotations

import json
import textwrap

import pytest
from helpers.data import shards

from meshformer.cli import main

CFG = "configs/tiny-gpt.toml"
TINY = ["model.d_model=32", "model.n_layers=1", "model.ffn.d_ff=64", "data.seq_len=32", "model.max_seq_len=64",
        "train.steps=2", "train.eval_interval=1", "train.eval_batches=1", "train.sample_interval=0",
        "logging.tensorboard=false", "logging.log_interval=1", "data.num_workers=0", "checkpoint.interval=0"]
FIX = "fix the callback or remove it from [[callbacks]]"

MODULE = '''
    import sys

    import torch

    from meshformer.train.callbacks import Callback


    class Raises(Callback):
        def __init__(self, hook: str, error: str) -> None:
            self.hook, self.error = hook, error

        def _maybe(self, hook):
            if hook == self.hook:
                raise {"ValueError": ValueError("the loss looks odd"), "SystemExit": SystemExit(0)}[self.error]

        def on_run_start(self, ctx):
            self._maybe("on_run_start")

        def on_step_end(self, ctx):
            self._maybe("on_step_end")

        def on_evaluation(self, ctx):
            self._maybe("on_evaluation")

        def on_run_end(self, ctx):
            self._maybe("on_run_end")


    class BadInit(Callback):
        def __init__(self) -> None:
            raise RuntimeError("no such device")


    class PutsMetric(Callback):
        def __init__(self, what: str, hook: str = "on_step_end") -> None:
            self.what, self.hook = what, hook

        def _put(self, ctx, hook):
            values = {"scalar": torch.tensor(2.5), "vector": torch.ones(3), "text": "high"}
            if hook == self.hook:
                ctx.metrics["user/x"] = values[self.what]

        def on_step_start(self, ctx):
            self._put(ctx, "on_step_start")

        def on_step_end(self, ctx):
            self._put(ctx, "on_step_end")
'''


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("callback_failures")
    folder = root / "modules"
    folder.mkdir()
    (folder / "cb_fail_hooks.py").write_text(textwrap.dedent(MODULE))
    (folder / "cb_fail_import.py").write_text("raise ZeroDivisionError('at import')\n")
    (folder / "cb_fail_syntax.py").write_text("class Broken(:\n    pass\n")
    (folder / "cb_fail_exit.py").write_text("import sys\nsys.exit(0)\n")
    return {"root": root, "modules": folder, "shards": shards(root)}


def _train(world, name: str, path: str, args: str = "{}", *extra: str) -> list[str]:
    return ["train", CFG, "--set", *TINY, f"logging.run_dir={world['root'] / name}", f"data.shards={world['shards']}",
            f'callbacks=[{{path="{path}", args={args}}}]', *extra]


def _one_line(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    code = info.value.code
    assert isinstance(code, str), f"exit status {code!r}: {capsys.readouterr().err[-3000:]}"
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error:" not in err, err[-3000:]  # the only error line is the exit's
    return code


CASES = [  # (id, path, args, where it failed, exception shown)
    ("hook-ValueError", "cb_fail_hooks:Raises", '{hook="on_step_end", error="ValueError"}', "in on_step_end",
     "ValueError: the loss looks odd"),
    ("hook-SystemExit-0", "cb_fail_hooks:Raises", '{hook="on_evaluation", error="SystemExit"}', "in on_evaluation",
     "SystemExit: 0"),
    ("run-start-SystemExit-0", "cb_fail_hooks:Raises", '{hook="on_run_start", error="SystemExit"}',
     "in on_run_start", "SystemExit: 0"),
    ("constructor", "cb_fail_hooks:BadInit", "{}", "in its constructor", "RuntimeError: no such device"),
    ("import", "cb_fail_import:X", "{}", "at import of cb_fail_import", "ZeroDivisionError: at import"),
    ("syntax", "cb_fail_syntax:X", "{}", "at import of cb_fail_syntax", "SyntaxError: "),
    ("import-exit", "cb_fail_exit:X", "{}", "at import of cb_fail_exit", "SystemExit: 0"),
]


@pytest.mark.parametrize("path, args, where, shown", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_a_failing_callback_is_one_line_with_its_traceback_kept(world, capsys, monkeypatch, one_thread, path, args,
                                                                where, shown):
    monkeypatch.syspath_prepend(str(world["modules"]))
    name = f"run-{path.replace(':', '-')}-{where.replace(' ', '-')}"
    line = _one_line(_train(world, name, path, args), capsys)
    assert line.startswith(f"error: callbacks[0] ({path}) raised {where}: {shown}"), line
    assert line.endswith(f" — {FIX}"), line
    kept = world["root"] / name / "diagnostics" / "callback-rank0.txt"
    assert f"(traceback in {kept})" in line, line
    trace = kept.read_text()
    assert "Traceback (most recent call last)" in trace and shown.split(":")[0] in trace, trace
    assert not (world["root"] / name / "final").exists()  # a failed callback is no finished run


@pytest.mark.parametrize("path", [".mod:X", "../../x:X", "pkg/mod:X", "mod:X.Y", "pkg..mod:X"])
def test_a_path_that_is_no_module_name_is_refused_at_the_check(world, capsys, path):
    line = _one_line(_train(world, "run-badpath", path), capsys)
    assert line.startswith(f"error: callbacks[0].path = {path!r} is not \"module:ClassName\""), line
    assert "PYTHONPATH" in line and "Traceback" not in line, line
    assert not (world["root"] / "run-badpath" / "metrics.jsonl").exists()  # refused before any work


@pytest.mark.parametrize("what, hook, kind", [("vector", "on_step_end", "a tensor of shape (3,)"),
                                             ("text", "on_step_start", "a str ('high')")])
def test_a_metric_that_is_no_number_names_the_key_and_the_callback(world, capsys, monkeypatch, one_thread, what,
                                                                    hook, kind):
    monkeypatch.syspath_prepend(str(world["modules"]))
    args = f'{{what="{what}", hook="{hook}"}}'
    line = _one_line(_train(world, f"run-metric-{what}", "cb_fail_hooks:PutsMetric", args), capsys)
    assert line.startswith(f"error: callbacks[0] (cb_fail_hooks:PutsMetric) put {kind} in ctx.metrics['user/x'] "
                           f"in {hook} — put numbers there"), line


def test_a_0d_tensor_metric_is_logged_as_its_float(world, monkeypatch, one_thread):
    monkeypatch.syspath_prepend(str(world["modules"]))
    run = world["root"] / "run-metric-scalar"
    main(_train(world, "run-metric-scalar", "cb_fail_hooks:PutsMetric", '{what="scalar"}'))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["user/x"] for row in rows if "user/x" in row] == [2.5, 2.5]


def test_a_callback_given_from_python_is_named_by_its_class(world, one_thread):
    from meshformer.config import load_config
    from meshformer.train.callbacks import Callback, CallbackError
    from meshformer.train.trainer import Trainer

    class Exits(Callback):
        def on_step_end(self, ctx):
            raise SystemExit(0)

    run = world["root"] / "run-python"
    cfg = load_config(CFG, [*TINY, f"logging.run_dir={run}", f"data.shards={world['shards']}"])
    with pytest.raises(CallbackError) as err:
        Trainer(cfg, callbacks=[Exits()]).fit()
    qualname = f"{__name__}:{Exits.__qualname__}"
    assert err.value.one_line() == (
        f"the callback Exits ({qualname}) raised in on_step_end: SystemExit: 0 (traceback in "
        f"{run / 'diagnostics' / 'callback-rank0.txt'}) — fix the callback or leave it out of the trainer's callbacks")
