import sys
from pathlib import Path

import pytest
import torch

# Tests import bench/'s measurement helpers (plan_validation, data_read_volume, parallel_common) by module name.
sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread avoids OpenMP spin contention on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
