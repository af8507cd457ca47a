"""[fault_tolerance] and `--replica-groups` mistakes: one line `error: <what> — <fix>` before any work."""

from __future__ import annotations

import sys

import pytest

from meshformer.cli import main

CFG = "configs/tiny-gpt.toml"


def _train(tmp, *overrides: str) -> list[str]:
    return ["train", CFG, "--set", f"logging.run_dir={tmp}/run", "train.steps=2", *overrides]


FT = ("fault_tolerance.enabled=true", "fault_tolerance.replica_groups=2")
CASES = [
    ("min-replicas", ("fault_tolerance.replica_groups=2", "fault_tolerance.min_replicas=3"), [],
     ["fault_tolerance.min_replicas=3", "min_replicas from 1 to replica_groups"]),
    ("timeout", ("fault_tolerance.heartbeat_timeout_s=0",), [],
     ["fault_tolerance.heartbeat_timeout_s=0.0", "positive"]),
    ("lighthouse-address", ("fault_tolerance.lighthouse=host:29510",), [], ["fault_tolerance.lighthouse", "http://"]),
    ("method", ("fault_tolerance.method=gossip",), [], ["fault_tolerance.method", "diloco"]),
    ("qk-clip", (*FT, "optim.qk_clip_threshold=100"), [], ["qk_clip_threshold", "drift apart", "drop"]),
    ("router-bias", (*FT, "model.moe.router_bias_update_rate=0.001"), [],
     ["router_bias_update_rate", "drift apart", "=0"]),
    ("no-replica-id", FT, [], ["MESHFORMER_REPLICA_ID is not set", "--replica-groups 2"]),
    ("replica-id-range", FT, [("MESHFORMER_REPLICA_ID", "2")], ["MESHFORMER_REPLICA_ID='2' names no group", "0 to 1"]),
    ("no-lighthouse", FT, [("MESHFORMER_REPLICA_ID", "0")], ["no Lighthouse", "meshformer lighthouse"]),
]


@pytest.mark.parametrize("overrides, env, words", [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_fault_tolerance_mistake_is_one_line(overrides, env, words, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MESHFORMER_REPLICA_ID", raising=False)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    for key, value in env:
        monkeypatch.setenv(key, value)
    _one_line(_train(tmp_path, *overrides), words, capsys)


def test_replica_groups_option_and_missing_torchft(tmp_path, monkeypatch, capsys):
    _one_line(["train", CFG, "--replica-groups", "-1"], ["--replica-groups=-1", "from 1 to"], capsys)
    _one_line(["train", CFG, "--replica-groups", "2", "--nnodes", "2"], ["--nnodes must be 1", "meshformer lighthouse"],
              capsys)
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    monkeypatch.setenv("MESHFORMER_REPLICA_ID", "0")
    _one_line(_train(tmp_path, *FT), ["needs torchft, which is not installed", "pip install 'meshformer[ft]'"], capsys)
    _one_line(["train", CFG, "--replica-groups", "2"], ["needs torchft", "meshformer[ft]"], capsys)
    _one_line(["lighthouse"], ["needs torchft", "meshformer[ft]"], capsys)


def _one_line(argv: list[str], words: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    code = info.value.code
    assert code not in (0, None), f"exit status {code!r}"
    err = capsys.readouterr().err + (f"{code}\n" if isinstance(code, str) else "")
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])
