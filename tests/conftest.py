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
