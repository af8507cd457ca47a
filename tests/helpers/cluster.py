"""Shared pieces of the test_cluster_*.py files: tiny data and config, torchrun agents, the reference run.

Every multi-process test trains the same tiny 2-rank job (CLUSTER_STEPS steps, a checkpoint every 4) and
compares its final weights bitwise with one uninterrupted run of two torchrun agents over 127.0.0.1
(`reference_run`, made once per session): an interrupted, restarted or requeued run that lost or repeated
data, or restored any state wrongly, ends with different weights.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers.common import CONFIGS, ROOT, free_port
from meshformer.launcher.torchrun import TORCHRUN, torchrun_command, torchrun_env

INJECT = Path(__file__).resolve().parent / "cluster_inject"  # sitecustomize.py: MF_TEST_* faults
CONFIG = str(CONFIGS / "tiny-gpt.toml")
CLUSTER_STEPS = 16
CHECKPOINT_EVERY = 4

_CACHE: dict[str, Path] = {}


def shards(base: Path) -> Path:
    """A few prepared shards of the bundled corpus (once per session)."""
    if "shards" not in _CACHE:
        from meshformer.data import prepare
        from meshformer.data.sources import BUNDLED_CORPORA

        out = base / "cluster-shards"
        if not (out / "manifest.json").exists():
            with gzip.open(BUNDLED_CORPORA["bundled:kjv"], "rt", encoding="utf-8") as fh:
                docs = [json.loads(line)["text"] for _, line in zip(range(12), fh)]
            corpus = base / "cluster-corpus.jsonl"
            corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
            prepare(corpus, out, tokenizer="bundled:kjv-bpe-4k", record_len=33, eval_fraction=0.1, seed=7,
                    shard_records=41, progress=False)
        _CACHE["shards"] = out
    return _CACHE["shards"]


def overrides(base: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"data.shards={shards(base)}", "data.seq_len=32", "data.batch_size=4", "data.num_workers=0",
        "data.shuffle_shards=2", "model.max_seq_len=32", "model.d_model=32", "model.attention.n_heads=2",
        "model.n_layers=2",
        "model.ffn.d_ff=64", "train.device=cpu", f"train.steps={CLUSTER_STEPS}", "train.eval_interval=0",
        "train.sample_interval=0", "schedule.warmup_steps=2", "logging.log_interval=4", f"logging.run_dir={run_dir}",
        f"checkpoint.interval={CHECKPOINT_EVERY}", "checkpoint.keep_last=10", "checkpoint.preempt_check_interval=1",
        *extra,
    ]


def worker_env(**faults: str) -> dict[str, str]:
    """torchrun's environment (the launcher's), one thread per rank on 2 shared cores, optional MF_TEST_* faults."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}
    env = {**torchrun_env(1), **env}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(INJECT) if faults else "", str(ROOT),
                                                     os.environ.get("PYTHONPATH", "")) if p)
    env.update(faults)
    return env


def agent_command(run_overrides: list[str], port: int, *, rdzv_id: str, max_restarts: int = 0,
                  extra: list[str] | None = None) -> list[str]:
    """One agent of a 2-node job (1 rank per node): the launcher's torchrun command, plus agent options."""
    cmd = torchrun_command(CONFIG, run_overrides, nproc_per_node=1, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}",
                           rdzv_id=rdzv_id, max_restarts=max_restarts)
    if extra:
        at = len(TORCHRUN)
        cmd[at:at] = extra
    return cmd


def start(cmd: list[str], env: dict[str, str], log: Path, prefix: list[str] | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        return subprocess.Popen([*(prefix or []), *cmd], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit codes; whatever still runs after `timeout` is killed (with its workers) and reported as -9."""
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            codes.append(-9)
    return codes


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun starts its workers in sessions of their own)."""
    for child in children(pid):
        kill_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def children(pid: int) -> list[int]:
    """Direct child processes of `pid` (from /proc: no psutil needed)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def wait_for(predicate, timeout: float, what: str, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)


def logs(*paths: Path) -> str:
    return "\n".join(f"----- {p}\n{p.read_text(errors='replace')}" for p in paths if p.exists())


def run_two_agents(base: Path, run_dir: Path, *extra: str, timeout: float = 150.0) -> tuple[list[int], str]:
    """An uninterrupted 2-node job on loopback; (exit codes, logs)."""
    port, env = free_port(), worker_env()
    cmds = [agent_command(overrides(base, run_dir, *extra), port, rdzv_id=f"ref{port}") for _ in range(2)]
    paths = [run_dir.parent / f"{run_dir.name}-agent{i}.log" for i in range(2)]
    codes = finish([start(cmd, env, path) for cmd, path in zip(cmds, paths)], timeout)
    return codes, logs(*paths)


def reference_run(base: Path) -> Path:
    """The uninterrupted run every other multi-process test compares with (once per session)."""
    if "reference" not in _CACHE:
        run_dir = base / "cluster-reference"
        codes, text = run_two_agents(base, run_dir)
        assert codes == [0, 0], f"reference run failed: {codes}\n{text[-6000:]}"
        _CACHE["reference"] = run_dir
        _CACHE["reference_log"] = run_dir.parent / "reference.log"
        _CACHE["reference_log"].write_text(text)
    return _CACHE["reference"]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def assert_same_weights(run_dir: Path, reference: Path) -> None:
    got, want = final_weights(run_dir), final_weights(reference)
    assert set(got) == set(want)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, (f"final weights differ from the uninterrupted run in {differ[:4]} (max |diff| "
                        f"{max((got[k] - want[k]).abs().max().item() for k in differ):.3g}): data was lost or "
                        "repeated, or some state was not restored")
