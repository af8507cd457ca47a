import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
# Test modules import shared code as `helpers.<name>`, and bench/'s measurement helpers (plan_validation,
# data_read_volume, parallel_common) by module name.
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
sys.path.append(str(TESTS.parent / "bench"))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread avoids OpenMP spin contention on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def restore_root_logging():
    """Commands run in-process (`main([...])`) configure the root logger with the stderr of that moment, which
    pytest closes after the test: a later test's log line would then print '--- Logging error ---'."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
