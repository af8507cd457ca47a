"""The final weights save streams (#24): under FSDP no rank holds a whole tensor beyond its own shards, with the
default max_shard_size (5GB: one file for this model). Measured as each rank's peak RSS growth during the save
(bench/final_save_memory.py, which reports the FSDP-8 figure); before, rank 0 grew by the whole model (1.08x)."""

from __future__ import annotations

import pytest
from final_save_memory import measure
from parallel_common import spawn


@pytest.mark.slow
def test_final_save_holds_no_whole_tensor_beyond_own_shards(tmp_path):
    per_rank = spawn(2, measure, 256, 4, 4096, "5GB", str(tmp_path), threads=1)
    model, largest = per_rank[0]["model"], per_rank[0]["largest"]
    worst = max(rank["growth"] for rank in per_rank)
    assert largest < 0.25 * model  # so that holding the model, or a file's worth, would show
    assert worst < largest, (worst, largest, model)
