"""`meshformer train --nproc-per-node N` runs torchrun's agent itself: a failed rank ends as one `error:` line, never
torchrun's ChildFailedError report; real processes, as a user runs them. Also the debug switch's values."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.common import ROOT
from helpers.data import forge_shard, shards

CFG = "configs/tiny-gpt.toml"
TINY = ["model.d_model=32", "model.n_layers=1", "model.ffn.d_ff=64", "data.seq_len=32", "model.max_seq_len=64",
        "train.steps=2", "train.eval_interval=0", "train.sample_interval=0", "logging.tensorboard=false",
        "data.num_workers=0"]


def _meshformer(*args: str, env: dict[str, str] | None = None, pythonpath: tuple[Path, ...] = ()
                ) -> subprocess.CompletedProcess:
    path = os.pathsep.join(str(p) for p in (*pythonpath, ROOT))
    inherited = {key: value for key, value in os.environ.items() if key != "MESHFORMER_DEBUG"}
    full_env = {**inherited, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "meshformer.cli", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=300)


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    text = out.stdout + out.stderr
    lines = [line for line in text.splitlines() if "error:" in line]
    assert out.returncode != 0 and len(lines) == 1, text[-4000:]
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-4000:]
    assert lines[0].startswith("error: "), lines
    return lines[0]


def test_a_rank_that_reports_leaves_the_only_line(tmp_path):
    """A shard corrupted on disk (same size) passes the launcher's checks and fails in the ranks at step 1."""
    bad = shutil.copytree(shards(tmp_path), tmp_path / "corrupt")
    for shard in bad.glob("train-*.tar"):
        data = bytearray(shard.read_bytes())
        data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
        shard.write_bytes(bytes(data))
    out = _meshformer("train", CFG, "--nproc-per-node", "2", "--set", *TINY, f"logging.run_dir={tmp_path / 'run'}",
                      f"data.shards={bad}")
    line = _one_error_line(out)
    assert line.startswith("error: shard ") and "data.bad_shards='skip'" in line, line


def test_a_rank_failing_alone_leaves_one_line_not_its_peers_gloo_traceback(tmp_path):
    """Rank 0 alone fails with a user error at step 3 while rank 1 waits in a collective: rank 1's broken
    connection is the consequence, not news; the only line is rank 0's."""
    from helpers.cluster import INJECT

    out = _meshformer("train", CFG, "--nproc-per-node", "2", "--set", *TINY, "train.steps=4",
                      f"logging.run_dir={tmp_path / 'run'}", f"data.shards={shards(tmp_path)}",
                      env={"MF_TEST_FAIL_RANK": "0", "MF_TEST_FAIL_STEP": "3"}, pythonpath=(INJECT,))
    line = _one_error_line(out)
    assert line == "error: injected failure of rank 0 before step 3 — nothing to fix", line
    assert "Connection closed" not in out.stderr and "[rank1]" not in out.stderr, out.stderr[-3000:]


@pytest.mark.slow  # two ranks; the single-process case runs by default (test_bad_inputs.py)
def test_a_crafted_shard_member_is_one_line_at_two_ranks(tmp_path):
    """(#24) A member named `../...` (index and manifest forged to match) ended in torchrun's failure banner over
    each rank's `KeyError: 'tokens'`; now one line names the shard and the member."""
    forged = shutil.copytree(shards(tmp_path), tmp_path / "forged")
    for shard in range(len(list(forged.glob("train-*.tar")))):  # every shard: both ranks meet one at step 1
        forge_shard(forged, [["../000000000.tokens.u16"], *([f"{i:09d}.tokens.u16"] for i in (1, 2, 3))], shard)
    out = _meshformer("train", CFG, "--nproc-per-node", "2", "--set", *TINY, f"logging.run_dir={tmp_path / 'run'}",
                      f"data.shards={forged}")
    line = _one_error_line(out)
    assert line.startswith(f"error: shard {forged}/train-") and (": member '../000000000.tokens.u16' names a path "
                                                                 "outside the shard") in line, line


def test_a_rank_killed_by_a_signal_is_named_in_one_line(tmp_path):
    """Rank 1 dies of SIGKILL as it starts (a sitecustomize stands in for the out-of-memory killer)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, signal\n"
        "if os.environ.get('RANK') == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    out = _meshformer("train", CFG, "--nproc-per-node", "2", "--set", *TINY, f"logging.run_dir={tmp_path / 'run'}",
                      pythonpath=(hook,))
    line = _one_error_line(out)
    assert "rank 1" in line and "killed by SIGKILL (signal 9)" in line and "out-of-memory" in line, line


@pytest.mark.slow  # two ranks, ~35 s
def test_a_rank_killed_mid_run_is_named_not_its_peers_lost_connection(tmp_path):
    """Rank 1 dies of SIGKILL before step 3 while rank 0 trains on: rank 0's broken collective is the consequence;
    the one line names the signal that ended rank 1 (it printed nothing itself)."""
    from helpers.cluster import INJECT

    out = _meshformer("train", CFG, "--nproc-per-node", "2", "--set", *TINY, "train.steps=4",
                      f"logging.run_dir={tmp_path / 'run'}", f"data.shards={shards(tmp_path)}",
                      env={"MF_TEST_KILL_RANK": "1", "MF_TEST_KILL_STEP": "3"}, pythonpath=(INJECT,))
    line = _one_error_line(out)
    assert line.startswith("error: rank 1 (pid ") and "was killed by SIGKILL (signal 9)" in line, line
    assert "out of host memory? see `dmesg`" in line and "lost its connection" not in line, line


@pytest.mark.slow  # a launch per word, ~1 min
def test_debug_switch_takes_only_yes_words():
    bad = ("train", CFG, "--set", "train.steps=0")
    for value in ("0", "no", "false", "off", ""):
        out = _meshformer(*bad, env={"MESHFORMER_DEBUG": value})
        assert _one_error_line(out).startswith("error: train.steps must be positive"), value
    for value in ("1", "true", "yes", "ON"):
        out = _meshformer(*bad, env={"MESHFORMER_DEBUG": value})
        assert out.returncode != 0 and "Traceback" in out.stderr and "ConfigError" in out.stderr, value


def test_ctrl_c_stops_the_job_without_a_launcher_traceback(tmp_path):
    """The agent runs in our process and turns SIGINT into its SignalException: the launcher exits 130, quietly."""
    import signal
    import time

    hook = tmp_path / "hook"
    hook.mkdir()
    started = tmp_path / "rank0-started"
    (hook / "sitecustomize.py").write_text(
        f"import os, pathlib\nif os.environ.get('RANK') == '0':\n    pathlib.Path({str(started)!r}).touch()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(hook), str(ROOT))), "OMP_NUM_THREADS": "1"}
    env.pop("MESHFORMER_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "meshformer.cli", "train", CFG, "--nproc-per-node", "2", "--set",
                             *TINY, "train.steps=100000", f"logging.run_dir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert started.exists() and proc.returncode == 128 + signal.SIGINT, (proc.returncode, err[-3000:])
    assert "SignalException" not in err and "ChildFailedError" not in err, err[-3000:]
