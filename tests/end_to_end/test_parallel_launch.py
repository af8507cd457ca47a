"""torchrun launches: single node through the CLI, two agents forming one job, and failures that name a rank."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.common import CONFIGS, ROOT, free_port

from meshformer.launcher.torchrun import torchrun_command, torchrun_env

WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "parallel_worker.py")
TINY = ["model.d_model=32", "model.n_layers=2", "model.ffn.d_ff=64", "data.seq_len=32", "data.batch_size=4",
        "train.steps=2", "train.eval_interval=2", "train.eval_batches=1", "train.sample_interval=0",
        "logging.log_interval=1", "logging.tensorboard=false"]


def run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**torchrun_env(2), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def test_torchrun_command_lines():
    single = torchrun_command("c.toml", ["train.steps=5"], nproc_per_node=4)
    assert "--standalone" in single and "--nproc-per-node=4" in single
    assert single[-5:] == ["-m", "meshformer.train", "c.toml", "--set", "train.steps=5"]
    # the agent and the ranks with Python's safe path: a torch.py in the working folder shadows nothing
    assert single[:4] == [sys.executable, "-P", "-m", "meshformer.launcher.torchrun"]
    assert single[single.index("--no-python"):][:5] == ["--no-python", sys.executable, "-P", "-u", "-m"]
    multi = torchrun_command("c.toml", nproc_per_node=8, nnodes=2, rdzv_endpoint="10.0.0.1:29400")
    assert "--rdzv-backend=c10d" in multi and "--rdzv-endpoint=10.0.0.1:29400" in multi and "--nnodes=2" in multi
    assert "--standalone" not in multi
    assert torchrun_env(2)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    with pytest.raises(ValueError):
        torchrun_command("c.toml", nproc_per_node=0)


@pytest.mark.slow
def test_cli_starts_torchrun_and_only_rank0_logs(tmp_path):
    cmd = [sys.executable, "-m", "meshformer.cli", "train", str(CONFIGS / "tiny-gpt.toml"), "--nproc-per-node", "2",
           "--set", *TINY, f"logging.run_dir={tmp_path}", "parallel.tp=2"]
    out = run(cmd)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "--standalone" in text and "--nproc-per-node=2" in text
    steps = [line for line in text.splitlines() if "step " in line and "/2 |" in line]
    assert steps and all("[rank0]" in line for line in steps), steps
    assert "tp=2 (world 2)" in text


@pytest.mark.slow
def test_two_agents_on_loopback_form_one_pipeline_job(tmp_path):
    port = free_port()
    common = torchrun("--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=mf-{port}", "-m", "meshformer.train",
                      str(CONFIGS / "tiny-gpt.toml"), "--set", *TINY, f"logging.run_dir={tmp_path}", "parallel.pp=2")
    env = {**torchrun_env(1), "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(common, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    text = "\n".join(outputs)
    assert "pp=2 x dp_replicate=1 x dp_shard=1 x tp=1 (world 2)" in text  # one job over both agents
    assert (tmp_path / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_failing_rank_is_named():
    out = run(torchrun("--standalone", "--nproc-per-node=2", WORKER, "fail"))
    assert out.returncode != 0
    assert "[rank 1/2] uncaught ValueError" in out.stderr
    assert "injected failure on rank 1" in out.stderr


@pytest.mark.slow
def test_a_hang_ends_naming_the_stuck_collective():
    out = run(torchrun("--standalone", "--nproc-per-node=2", WORKER, "hang"))
    assert out.returncode != 0
    assert "[rank 0/2] uncaught RuntimeError: rank 0: collective gloo:all_reduce" in out.stderr
    assert "did not complete within 4s" in out.stderr


@pytest.mark.slow
def test_worker_fsdp_step_matches_across_ranks():
    out = run(torchrun("--standalone", "--nproc-per-node=2", WORKER, "ok"))
    assert out.returncode == 0, out.stderr[-2000:]
    found = re.findall(r"worker rank (\d) of 2: loss (\S+)", out.stdout)
    assert sorted(rank for rank, _ in found) == ["0", "1"] and len({loss for _, loss in found}) == 1, out.stdout

