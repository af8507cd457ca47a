"""`eager_when_compiled`: torch.compiler.disable's behaviour, without importing dynamo when its module is imported."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from helpers.common import ROOT

from meshformer.loss.eager import eager_when_compiled


def test_a_wrapped_function_runs_eagerly_inside_compiled_code():
    seen: list[bool] = []

    @eager_when_compiled
    def host_loop(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return x * int(x.sum().item() > 0) + 1  # a host read: dynamo would break here if it traced it

    x = torch.randn(5)
    compiled = torch.compile(lambda t: host_loop(t.relu()) * 2, backend="eager")
    torch.testing.assert_close(compiled(x), (x.relu() * int(x.relu().sum().item() > 0) + 1) * 2)
    torch.testing.assert_close(compiled(x), (x.relu() * int(x.relu().sum().item() > 0) + 1) * 2)
    assert seen == [False, False]  # never traced: run by the graph break, each call
    assert host_loop.__name__ == "host_loop"


PROBE = """
import sys
import meshformer.train.__main__, meshformer.train.trainer, meshformer.train.replica_step
print("dynamo:", "torch._dynamo" in sys.modules)
"""


def test_the_training_entry_point_imports_no_dynamo():
    """A rank's start-up (a restarted replica group's way back into the quorum among them) skips dynamo's seconds
    of imports; a run that compiles loads it then."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert "dynamo: False" in out.stdout, out.stdout + out.stderr
