"""Training-loop callbacks: the hooks run in their documented order with their documented arguments, a user's
callback from the config runs on the ranks it declares in a 2-rank run, and its state survives a stop and resume."""

from __future__ import annotations

import json
import logging
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import cluster
from helpers.common import CONFIGS, ROOT, SMALL

from meshformer.checkpointing.directory import step_dir_name
from meshformer.config import ConfigError, load_config
from meshformer.train.callbacks import Callback, CallbackContext, Callbacks, loaded_line
from meshformer.train.trainer import Trainer


class Recorder(Callback):
    """Records every hook call: (hook, step, what the hook was given)."""

    def __init__(self, calls: list[tuple], tag: str, order: int) -> None:
        self.calls, self.tag = calls, tag
        self.order = order  # type: ignore[misc]  # per instance here: two recorders around the built-ins

    def _add(self, hook: str, ctx: CallbackContext, **seen: object) -> None:
        self.calls.append((self.tag, hook, ctx.step, seen))

    def on_run_start(self, ctx):
        self._add("on_run_start", ctx)

    def on_step_start(self, ctx):
        self._add("on_step_start", ctx, stats=ctx.stats is not None)

    def on_optimizer_step(self, ctx, applied):
        self._add("on_optimizer_step", ctx, applied=float(applied))

    def on_step_end(self, ctx):
        loss = None if ctx.stats is None else float(ctx.stats.loss_sum)
        self._add("on_step_end", ctx, log_step=ctx.log_step, metrics=sorted(ctx.metrics), loss=loss)
        if self.tag == "late" and ctx.log_step:
            ctx.metrics["user/double_step"] = 2.0 * ctx.step  # written with the step's metrics (order 90 writes)

    def on_evaluation(self, ctx):
        self._add("on_evaluation", ctx, eval_loss=ctx.eval_loss)

    def on_checkpoint(self, ctx):
        self._add("on_checkpoint", ctx, saved=ctx.saved)

    def on_run_end(self, ctx):
        self._add("on_run_end", ctx, saved=ctx.saved)


class Elsewhere(Callback):
    ranks = (1,)  # never rank 0: a 1-process run never calls it

    def on_step_end(self, ctx):
        raise AssertionError("ran on a rank it did not declare")


def test_hooks_run_in_order_with_their_arguments(tmp_path):
    cfg = load_config(CONFIGS / "tiny-gpt.toml", [*SMALL, "train.steps=4", "logging.log_interval=2",
                                                 "train.eval_interval=2", "checkpoint.interval=2",
                                                 "logging.tensorboard=false", "data.num_workers=0",
                                                 f"logging.run_dir={tmp_path}"])
    calls: list[tuple] = []
    early, late = Recorder(calls, "early", order=5), Recorder(calls, "late", order=50)
    result = Trainer(cfg, callbacks=[late, Elsewhere(), early]).fit()

    hooks = [(tag, hook, step) for tag, hook, step, _ in calls]
    per_step = ["on_step_start", "on_optimizer_step", "on_step_end", "on_evaluation", "on_checkpoint"]
    expected = [("early", "on_run_start", 0), ("late", "on_run_start", 0)]
    for step in range(1, 5):
        expected += [(tag, hook, step) for hook in per_step for tag in ("early", "late")]
    expected += [("early", "on_run_end", 4), ("late", "on_run_end", 4)]
    assert hooks == expected

    seen = {(tag, hook, step): args for tag, hook, step, args in calls}
    assert seen["early", "on_step_start", 1] == {"stats": False}
    assert all(seen["late", "on_optimizer_step", s]["applied"] == 1.0 for s in range(1, 5))
    # Step metrics (order 10) fill ctx.metrics on logging steps: after the early callback, before the late one.
    assert seen["early", "on_step_end", 2]["metrics"] == []
    assert {"train/loss", "train/lr", "perf/step_time_s", "perf/data_wait_s"} <= set(seen["late", "on_step_end", 2][
        "metrics"])
    assert not seen["late", "on_step_end", 1]["log_step"] and seen["late", "on_step_end", 1]["metrics"] == []
    assert seen["late", "on_step_end", 4]["log_step"]
    assert all(seen["late", "on_step_end", s]["loss"] > 0 for s in range(1, 5))
    # The held-out loss (order 10) runs at eval steps before the late callback's evaluation hook.
    assert seen["early", "on_evaluation", 2]["eval_loss"] is None
    assert seen["late", "on_evaluation", 2]["eval_loss"] > 0
    assert seen["late", "on_evaluation", 4]["eval_loss"] == result.eval_loss
    # The cadence (order 40) saved step 2 (not 4: that is the final save) before the late callback's hook.
    checkpoints = tmp_path / "checkpoints"
    assert seen["early", "on_checkpoint", 2]["saved"] is None
    assert seen["late", "on_checkpoint", 2]["saved"] == checkpoints / step_dir_name(2)
    assert seen["late", "on_checkpoint", 4]["saved"] is None
    assert seen["late", "on_run_end", 4]["saved"] == checkpoints / step_dir_name(4)
    # A metric a callback adds is written with the step's metrics.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in rows if "train/loss" in row]
    assert [(row["step"], row["user/double_step"]) for row in logged] == [(2, 4.0), (4, 8.0)]
    assert [h["user/double_step"] for h in result.history] == [4.0, 8.0]


def test_callbacks_do_not_change_the_weights(tmp_path):
    """Parity: a run with hook-heavy callbacks ends with the weights of a run without them."""
    overrides = [*SMALL, "train.steps=3", "logging.log_interval=1", "logging.tensorboard=false",
                 "data.num_workers=0"]
    plain = Trainer(load_config(CONFIGS / "tiny-gpt.toml", [*overrides, f"logging.run_dir={tmp_path / 'a'}"]))
    plain.fit()
    calls: list[tuple] = []
    hooked = Trainer(load_config(CONFIGS / "tiny-gpt.toml", [*overrides, f"logging.run_dir={tmp_path / 'b'}"]),
                     callbacks=[Recorder(calls, "early", 5), Recorder(calls, "late", 50)])
    hooked.fit()
    for (name, a), (_, b) in zip(plain.model.state_dict().items(), hooked.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


class Counter(Callback):
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


class NoLoad(Callback):
    def state_dict(self) -> dict:
        return {}


class NotOnZero(Counter):
    ranks = (1,)


def test_declarations_are_checked_and_state_is_named_per_callback():
    with pytest.raises(ConfigError, match="no load_state_dict"):
        Callbacks([NoLoad()], rank=0)
    with pytest.raises(ConfigError, match="does not run on rank 0"):
        Callbacks([NotOnZero()], rank=1)
    with pytest.raises(ConfigError, match="is not a meshformer.train.callbacks.Callback"):
        Callbacks([object()], rank=0)  # type: ignore[list-item]
    bad_ranks = Counter()
    bad_ranks.ranks = "some"  # type: ignore[misc]
    with pytest.raises(ConfigError, match="declares ranks='some'"):
        Callbacks([bad_ranks], rank=0)
    first, second = Counter(), Counter()
    first.count, second.count = 3, 7
    state = Callbacks([first, second], rank=0).state
    assert state is not None and state.state_dict() == {"Counter": {"count": 3}, "Counter#2": {"count": 7}}
    assert Callbacks([Recorder([], "x", 1)], rank=0).state is None  # no state: no checkpoint component


@pytest.mark.parametrize("entry, words", [
    ({"path": "no_such_module_for_callbacks:Cb"}, ["cannot import 'no_such_module_for_callbacks'", "PYTHONPATH"]),
    ({"path": "meshformer.train.callbacks"}, ["is not \"module:ClassName\"", "my_package.my_module:MyCallback"]),
    ({"path": "meshformer.train.callbacks:Nope"}, ["'Nope' not found", "subclass"]),
    ({"path": "meshformer.train.callbacks:CallbackContext"}, ["is not a Callback subclass", "subclass"]),
    ({"path": "meshformer.train.builtin_callbacks:StepMetrics", "args": {"every": 2}},
     ["callbacks[0].args do not fit StepMetrics", "keyword arguments"]),
])
def test_a_bad_callbacks_table_is_a_config_error(tmp_path, entry, words):
    from meshformer.config import config_from_dict
    from meshformer.train.preflight import preflight

    cfg = config_from_dict({"callbacks": [entry], "logging": {"run_dir": str(tmp_path)}})
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    assert all(word in str(err.value) for word in words), str(err.value)


COUNTER_MODULE = '''
    import json, os, signal
    from pathlib import Path

    from meshformer.train.callbacks import Callback


    class StepCounter(Callback):
        """Counts the steps it saw, across resumes (its state is checkpointed)."""

        def __init__(self, out: str, start: int = 0) -> None:
            self.out, self.count = Path(out), start

        def on_step_end(self, ctx):
            self.count += 1
            if ctx.step == int(os.environ.get("STOP_AT_STEP", "0")):
                os.kill(os.getpid(), signal.SIGTERM)  # a stop signal: the run saves and exits 143

        def on_run_end(self, ctx):
            result = {"step": ctx.step, "count": self.count}
            (self.out / f"rank{ctx.rank}-{os.environ['RUN_NAME']}.json").write_text(json.dumps(result))

        def state_dict(self):
            return {"count": self.count}

        def load_state_dict(self, state):
            self.count = state["count"]


    class RankZeroNote(Callback):
        ranks = "zero"

        def on_run_start(self, ctx):
            (Path(os.environ["OUT"]) / f"zero-ran-on-rank{ctx.rank}").write_text("")
'''


def test_a_config_callback_runs_on_two_ranks_and_its_state_survives_a_resume(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    work = tmp_path_factory.mktemp("callbacks")
    (work / "my_callbacks.py").write_text(textwrap.dedent(COUNTER_MODULE))
    out = work / "out"
    out.mkdir()
    config = work / "with-callbacks.toml"
    config.write_text(Path(cluster.CONFIG).read_text() + textwrap.dedent(f"""
        [[callbacks]]
        path = "my_callbacks:StepCounter"
        args = {{out = "{out}"}}

        [[callbacks]]
        path = "my_callbacks:RankZeroNote"
    """))
    run_dir = work / "run"

    def launch(name: str, **env: str) -> tuple[int, str]:
        environ = {**cluster.worker_env(), "RUN_NAME": name, "OUT": str(out), **env}
        environ.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")  # the launcher sets its own grace period
        cmd = [sys.executable, "-m", "meshformer.cli", "train", str(config), "--nproc-per-node", "2", "--set",
               *cluster.overrides(base, run_dir)]
        log = work / f"{name}.log"
        proc = cluster.start(cmd, environ, log)
        try:
            code = cluster.finish([proc], 300)[0]
        finally:
            cluster.kill_tree(proc.pid)
        return code, log.read_text(errors="replace")

    code, text = launch("first", STOP_AT_STEP="6")
    assert code == 143, text[-4000:]
    # beside the config file, not on PYTHONPATH: every rank imported it; rank 0 confirmed each callback once
    assert str(work) not in cluster.worker_env().get("PYTHONPATH", "")
    for line in ("callbacks: loaded my_callbacks:StepCounter (ranks all, order 50)",
                 "callbacks: loaded my_callbacks:RankZeroNote (ranks zero, order 50)"):
        assert text.count(line) == 1, text[-4000:]
    stopped = {rank: json.loads((out / f"rank{rank}-first.json").read_text()) for rank in (0, 1)}
    at = stopped[0]["step"]
    assert 6 <= at < cluster.CLUSTER_STEPS and stopped[1]["step"] == at, stopped
    assert stopped[0]["count"] == stopped[1]["count"] == at
    assert sorted(p.name for p in out.glob("zero-ran-*")) == ["zero-ran-on-rank0"]

    code, text = launch("second")
    assert code == 0, text[-4000:]
    assert f"resumed from {run_dir / 'checkpoints' / step_dir_name(at)}" in text, text[-3000:]
    resumed = {rank: json.loads((out / f"rank{rank}-second.json").read_text()) for rank in (0, 1)}
    # The counter continued from the checkpoint on both ranks: every step of the run counted once.
    assert resumed == {rank: {"step": cluster.CLUSTER_STEPS, "count": cluster.CLUSTER_STEPS} for rank in (0, 1)}
    state = json.loads((run_dir / "checkpoints" / step_dir_name(at) / "trainer_state.json").read_text())
    assert state["callbacks"] == {"StepCounter": {"count": at}}


def test_the_documented_callback_example_runs_from_the_config(tmp_path, monkeypatch, caplog):
    """As the page shows it: the module beside the config file, no PYTHONPATH, started from another folder; the run
    confirms the callback in one line."""
    text = (ROOT / "docs" / "extending" / "index.md").read_text()
    section = text[text.index("## Callbacks"):]
    section = section[:section.index("\n## ", 1)]
    module = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    table = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    (tmp_path / "my_callbacks.py").write_text(module)
    monkeypatch.delitem(sys.modules, "my_callbacks", raising=False)  # imported by this test alone
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = tmp_path / "run.toml"
    config.write_text((CONFIGS / "tiny-gpt.toml").read_text() + "\n" + table)
    cfg = load_config(config, [*SMALL, "train.steps=4", "logging.log_interval=1", "checkpoint.interval=2",
                               "logging.tensorboard=false", "data.num_workers=0",
                               f"logging.run_dir={tmp_path / 'run'}"])
    assert str(tmp_path) not in sys.path and cfg.callbacks[0].folder == str(tmp_path)
    caplog.set_level(logging.INFO)
    result = Trainer(cfg).fit()
    loaded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("callbacks: loaded")]
    assert loaded == ["callbacks: loaded my_callbacks:LossSpikes (ranks zero, order 50)"]
    assert sys.modules["my_callbacks"].__file__ == str(tmp_path / "my_callbacks.py")
    assert str(tmp_path) not in sys.path  # only the named module came from the folder
    spikes = [h["train/loss_spikes"] for h in result.history]
    assert len(spikes) == 4 and spikes == sorted(spikes)
    state = json.loads((tmp_path / "run" / "checkpoints" / step_dir_name(4) / "trainer_state.json").read_text())
    assert state["callbacks"]["LossSpikes"]["spikes"] == spikes[-1]
    assert state["callbacks"]["LossSpikes"]["last"] == pytest.approx(result.final_loss)


def test_a_callback_module_comes_from_the_config_files_folder_and_shadows_nothing(tmp_path, monkeypatch):
    from meshformer.train.callbacks import check_config_callbacks, config_callbacks

    plugin = tmp_path / "cfg" / "plugins"
    (plugin / "cb_pkg_for_test").mkdir(parents=True)
    (plugin / "cb_pkg_for_test" / "__init__.py").write_text("")
    (plugin / "cb_pkg_for_test" / "mod.py").write_text(
        "from meshformer.train.callbacks import Callback\n\n\nclass Noted(Callback):\n    ranks = (0,)\n")
    (plugin / "json.py").write_text("raise AssertionError('a folder file shadowed the json module')\n")
    (plugin / "cb_not_named.py").write_text("")
    config = tmp_path / "cfg" / "run.toml"
    config.write_text('[[callbacks]]\npath = "cb_pkg_for_test.mod:Noted"\nfolder = "plugins"\n')
    for name in ("cb_pkg_for_test", "cb_pkg_for_test.mod"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(config)
    assert cfg.callbacks[0].folder == str(plugin)  # relative to the config file, not the current folder
    assert loaded_line(config_callbacks(cfg)[0]) == "callbacks: loaded cb_pkg_for_test.mod:Noted (ranks 0, order 50)"
    json.dumps({})  # the folder's json.py was never imported
    with pytest.raises(ImportError):
        __import__("cb_not_named")  # the folder is not on sys.path
    config.write_text('[[callbacks]]\npath = "json:Noted"\nfolder = "plugins"\n')
    with pytest.raises(ConfigError, match="has the name of the module 'json' the run already imported"):
        check_config_callbacks(load_config(config))
