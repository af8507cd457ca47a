"""Warm ranks (launcher/warm_rank.py): torchrun's worker start hands the ranks' command to a waiting interpreter of
the same local rank, and starts anything else the usual way."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch.distributed.elastic.multiprocessing.api as elastic_api

from meshformer.launcher import warm_rank
from meshformer.launcher.torchrun import _nproc_per_node, torchrun_command

# a stand-in warm rank: echoes the line it is handed, as JSON, to the file named in its argv
ECHO = "import sys; open(sys.argv[1], 'w').write(sys.stdin.readline())"


@pytest.fixture
def restore_torchrun():
    usual = elastic_api.get_subprocess_handler
    yield
    elastic_api.get_subprocess_handler = usual


def _stand_in(path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", ECHO, str(path)], stdin=subprocess.PIPE, start_new_session=True)


def test_the_ranks_command_goes_to_the_warm_rank_of_its_local_rank(tmp_path, restore_torchrun):
    warm = [_stand_in(tmp_path / "0.json"), _stand_in(tmp_path / "1.json")]
    warm_rank.adopt_warm_ranks(warm)
    args = (*warm_rank.RANK_COMMAND, "tiny-gpt", "--set", "train.steps=3")
    handler = elastic_api.get_subprocess_handler(entrypoint=sys.executable, args=args, env={"RANK": "1"},
                                                 stdout="", stderr="", local_rank_id=1)
    assert handler.proc is warm[1] and handler.local_rank_id == 1
    assert handler.proc.wait(30) == 0
    handed = json.loads((tmp_path / "1.json").read_text())
    assert handed["argv"] == ["tiny-gpt", "--set", "train.steps=3"]
    assert handed["env"]["RANK"] == "1" and handed["env"]["PATH"] == os.environ["PATH"]  # the agent's, as torchrun's
    assert handed["stdout"] is None and handed["stderr"] is None
    assert warm[0].poll() is None  # local rank 0's warm rank still waits
    warm[0].kill()
    warm[0].wait()


def test_another_command_or_a_dead_warm_rank_starts_the_usual_way(tmp_path, restore_torchrun):
    other, dead = _stand_in(tmp_path / "other.json"), _stand_in(tmp_path / "dead.json")
    dead.kill()
    dead.wait()
    warm_rank.adopt_warm_ranks([other, dead])
    # local rank 1: the ranks' command, but its warm rank died (`--help`: it exits at once)
    for local_rank, args in [(0, ("-c", "pass")), (1, (*warm_rank.RANK_COMMAND, "--help"))]:
        handler = elastic_api.get_subprocess_handler(entrypoint=sys.executable, args=args, env={}, stdout="",
                                                     stderr="", local_rank_id=local_rank)
        assert handler.proc not in (other, dead)
        assert handler.proc.wait(60) == 0
    assert other.wait(30) != 0 and not (tmp_path / "other.json").exists()  # the unused warm rank was ended


def test_the_standby_agent_starts_one_warm_rank_per_local_rank():
    command = torchrun_command("tiny-gpt", nproc_per_node=3)
    assert _nproc_per_node(command[3:]) == 3


def test_a_process_is_named_by_its_rank_or_by_the_rank_a_warm_rank_became():
    named = subprocess.Popen([sys.executable, "-c", "import sys, time; from meshformer.launcher.warm_rank import "
                              "_name_process; _name_process('rank7'); print(flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, env={**os.environ, "RANK": ""})
    plain = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, env={**os.environ, "RANK": "3"})
    try:
        for process in (named, plain):
            assert process.stdout is not None
            process.stdout.readline()
        assert warm_rank.process_rank(named.pid) == 7
        assert warm_rank.process_rank(plain.pid) == 3
        assert warm_rank.process_rank(os.getpid()) is None or "RANK" in os.environ
    finally:
        for process in (named, plain):
            process.kill()
            process.wait()
