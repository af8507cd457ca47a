"""Multi-node torchrun: two agents over 127.0.0.1, two network namespaces, and an elastic restart after SIGKILL."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from helpers.cluster import (
    CLUSTER_STEPS,
    agent_command,
    assert_same_weights,
    children,
    finish,
    kill_tree,
    logs,
    overrides,
    reference_run,
    start,
    wait_for,
    worker_env,
)
from helpers.common import free_port

from meshformer.checkpointing.directory import committed_steps, step_dir_name
from meshformer.launcher.torchrun import torchrun_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp()


def test_two_agents_over_loopback_form_one_job(base):
    run_dir = reference_run(base)
    text = (run_dir.parent / "reference.log").read_text()
    # One job of two nodes: rank 0 logs a world of 2 and every step; the final weights and checkpoints exist.
    assert "(world 2)" in text and f"step {CLUSTER_STEPS:>6}/{CLUSTER_STEPS}" in text, text[-3000:]
    assert committed_steps(run_dir / "checkpoints")[-1] == CLUSTER_STEPS
    assert (run_dir / "final" / "model.safetensors").is_file()
    state = run_dir / "checkpoints" / step_dir_name(CLUSTER_STEPS) / "trainer_state.json"
    assert json.loads(state.read_text())["world_size"] == 2


def test_launcher_sets_the_elastic_restart_workaround(monkeypatch):
    # torch 2.13 elastic restarts fail without it (pytorch issue 135712); the user need not know.
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    assert torchrun_env(2)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def _resumed_steps(text: str) -> list[int]:
    return [int(step) for step in re.findall(r"resumed from \S+ \(step (\d+)", text)]


def test_killed_worker_and_lost_node_restart_and_resume_without_lost_or_repeated_data(base, tmp_path):
    """A worker SIGKILLed mid-run, later a whole node lost and replaced: the job resumes both times."""
    reference = reference_run(base)
    run_dir, port = tmp_path / "run", free_port()
    checkpoints = run_dir / "checkpoints"
    env = worker_env(MF_TEST_STEP_SLEEP_S="0.3")  # long enough to interrupt twice
    # Node 0 hosts the rendezvous store, so losing node 1 does not take the store with it; 1-s heartbeats let
    # the rendezvous drop the lost node after 3 s instead of torch's default 15 s.
    host, other = (agent_command(overrides(base, run_dir), port, rdzv_id=f"kill{port}", max_restarts=2,
                                 extra=[f"--rdzv-conf=is_host={flag},keep_alive_interval=1,keep_alive_max_attempt=3"])
                   for flag in (1, 0))
    paths = [tmp_path / f"node{i}.log" for i in range(3)]
    agents = [start(host, env, paths[0]), start(other, env, paths[1])]
    try:
        # 1. SIGKILL one worker: torchrun stops the others and restarts the workers of both nodes.
        wait_for(lambda: committed_steps(checkpoints), 120, "the first checkpoint")
        first_kill = committed_steps(checkpoints)[-1]
        assert first_kill < CLUSTER_STEPS, "the run ended before it could be interrupted"
        workers = children(agents[1].pid)
        assert workers, "node 1's agent has no worker process"
        os.kill(workers[0], signal.SIGKILL)
        # 2. Once resumed and past another checkpoint, node 1 dies (agent and worker); a replacement joins.
        wait_for(lambda: _resumed_steps(logs(*paths)) and committed_steps(checkpoints)[-1] > first_kill, 120,
                 "the restarted job to save another checkpoint")
        second_kill = committed_steps(checkpoints)[-1]
        assert second_kill < CLUSTER_STEPS, "the run ended before the node could be lost"
        kill_tree(agents[1].pid)  # the node's agent and its worker, at once
        agents[1].wait()
        agents.append(start(other, env, paths[2]))
    finally:
        codes = finish([agents[0], agents[-1]], 150)
        for agent in agents:
            if agent.poll() is None:
                kill_tree(agent.pid)
    text = logs(*paths)
    assert codes == [0, 0], f"agents exited with {codes}\n{text[-6000:]}"
    resumed = _resumed_steps(text)
    assert len(resumed) == 2, text[-4000:]  # each restart loaded a checkpoint: at or after the interruption
    assert first_kill <= resumed[0] < CLUSTER_STEPS and second_kill <= resumed[1] < CLUSTER_STEPS, resumed
    assert_same_weights(run_dir, reference)


def _netns_permitted() -> str | None:
    """None when network namespaces can be made here, else the reason they cannot."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    name = f"mf-probe-{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns add` is not permitted here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


class TwoNamespaces:
    """Two network namespaces joined by a veth pair: node A at 10.231.7.1, node B at 10.231.7.2."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.names = (f"mf-a-{tag}", f"mf-b-{tag}")
        self.links = (f"mfa{tag}", f"mfb{tag}")
        self.addrs = ("10.231.7.1", "10.231.7.2")

    def __enter__(self) -> TwoNamespaces:
        (a, b), (la, lb) = self.names, self.links
        steps = [["netns", "add", a], ["netns", "add", b], ["link", "add", la, "type", "veth", "peer", "name", lb],
                 ["link", "set", la, "netns", a], ["link", "set", lb, "netns", b],
                 ["-n", a, "addr", "add", f"{self.addrs[0]}/24", "dev", la],
                 ["-n", b, "addr", "add", f"{self.addrs[1]}/24", "dev", lb],
                 ["-n", a, "link", "set", la, "up"], ["-n", b, "link", "set", lb, "up"],
                 ["-n", a, "link", "set", "lo", "up"], ["-n", b, "link", "set", "lo", "up"]]
        for step in steps:
            subprocess.run(["ip", *step], check=True, capture_output=True)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.names:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_two_agents_in_separate_network_namespaces(base, tmp_path):
    reason = _netns_permitted()
    if reason:
        pytest.skip(reason)
    reference = reference_run(base)
    run_dir, port = tmp_path / "run", free_port()
    with TwoNamespaces() as net:
        procs, paths = [], []
        for node, (ns, link, addr) in enumerate(zip(net.names, net.links, net.addrs)):
            # gloo picks its interface by name in each namespace; the host agent is told it hosts the store.
            extra = [f"--local-addr={addr}"] + (["--rdzv-conf=is_host=1"] if node == 0 else [])
            cmd = agent_command(overrides(base, run_dir), port, rdzv_id=f"ns{port}", extra=extra)
            cmd = [c.replace(f"127.0.0.1:{port}", f"{net.addrs[0]}:{port}") for c in cmd]
            env = {**worker_env(), "GLOO_SOCKET_IFNAME": link}
            paths.append(tmp_path / f"agent{node}.log")
            procs.append(start(cmd, env, paths[-1], prefix=["ip", "netns", "exec", ns]))
        codes = finish(procs, 150)
    text = logs(*paths)
    assert codes == [0, 0], f"agents exited with {codes}\n{text[-6000:]}"
    assert "(world 2)" in text
    assert_same_weights(run_dir, reference)
