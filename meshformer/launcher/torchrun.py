"""`meshformer train CONFIG --nproc-per-node N [--nnodes M --rdzv-endpoint HOST:PORT]` starts torchrun for the user.

Single node: `torchrun --standalone` (a free local port, no endpoint to pick). Several nodes: the c10d
rendezvous, run the same command on every node with the first node's address as the endpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from meshformer.errors import UsageError


def check_launch_options(nproc_per_node: int, nnodes: int, max_restarts: int) -> None:
    if nproc_per_node < 1 or nnodes < 1 or max_restarts < 0:
        raise UsageError(f"--nproc-per-node={nproc_per_node}, --nnodes={nnodes}, --max-restarts={max_restarts}: "
                         "out of range", "use --nproc-per-node >= 1, --nnodes >= 1 and --max-restarts >= 0")


def torchrun_command(
    config: str,
    overrides: list[str] | None = None,
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    rdzv_endpoint: str = "127.0.0.1:29500",
    rdzv_id: str = "meshformer",
    max_restarts: int = 0,
) -> list[str]:
    """The torchrun command line (`python -m torch.distributed.run ... -m meshformer.train CONFIG`)."""
    check_launch_options(nproc_per_node, nnodes, max_restarts)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    cmd += ["-m", "meshformer.train", config]
    if overrides:
        cmd += ["--set", *overrides]
    return cmd


def torchrun_env(nproc_per_node: int) -> dict[str, str]:
    env = dict(os.environ)
    # torchrun would set 1 thread per process with a warning; share this node's cores instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    # Elastic restarts in torch 2.13 fail (gloo connectFullMesh refused or a hang) without it (pytorch#135712).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def launch_torchrun(config: str, overrides: list[str] | None = None, *, nproc_per_node: int, **options: Any) -> int:
    """Run torchrun in the foreground (`options` as for `torchrun_command`); returns its exit status."""
    cmd = torchrun_command(config, overrides, nproc_per_node=nproc_per_node, **options)
    print("launching: " + " ".join(cmd), file=sys.stderr, flush=True)
    try:
        return subprocess.call(cmd, env=torchrun_env(nproc_per_node))
    except KeyboardInterrupt:
        return 130
