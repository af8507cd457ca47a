"""Two gloo processes (FSDP2): exact restart, resharding to other layouts, and a rank killed during a save.

Each launch starts this file as a script on every rank (see `_worker` at the bottom).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from helpers.checkpoints import (
    assert_bitwise,
    copy_steps,
    final_weights,
    launch,
    max_diff,
    run_trainer,
    tiny_config,
    tiny_shards,
)

from meshformer.checkpointing import CheckpointManager
from meshformer.checkpointing.directory import committed_steps, partial_dirs, step_dir_name

STEPS = 6
THIS = Path(__file__).resolve()
# Two optimizer steps of AdamW amplify fp32 reduction-order differences (~1e-7 in gradients) to ~1e-6 in weights.
LAYOUT_CHANGE_TOLERANCE = 1e-5

pytestmark = pytest.mark.slow


def _launch(run_dir: Path, shards: Path, *extra: str, kill_at_save: int = 0, timeout: float = 180.0, nproc: int = 2):
    return launch(THIS, nproc, [str(run_dir), str(shards), str(kill_at_save), *extra], timeout=timeout)


def _check(results) -> None:
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout[-3000:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Two ranks, FSDP2 over both, blocking saves every 2 steps."""
    root = tmp_path_factory.mktemp("dist")
    shards = tiny_shards(root)
    run_dir = root / "reference"
    _check(_launch(run_dir, shards))
    return {"shards": shards, "run_dir": run_dir, "weights": final_weights(run_dir)}


def test_two_process_restart_is_bitwise(reference, tmp_path):
    """Restart from step 2 (same layout, async saves): identical to the uninterrupted run."""
    run_dir = tmp_path / "restart"
    copy_steps(reference["run_dir"] / "checkpoints", run_dir / "checkpoints", 2)
    _check(_launch(run_dir, reference["shards"], "checkpoint.async_save=true"))
    assert_bitwise(final_weights(run_dir), reference["weights"])
    state = json.loads((run_dir / "checkpoints" / step_dir_name(STEPS) / "trainer_state.json").read_text())
    ref_state = json.loads((reference["run_dir"] / "checkpoints" / step_dir_name(STEPS) / "trainer_state.json")
                           .read_text())
    assert state["data"] == ref_state["data"] and state["tokens_seen"] == ref_state["tokens_seen"]


def test_fsdp_checkpoint_resumes_in_one_process(reference, tmp_path):
    """dp2 (FSDP) -> one process with the same global batch: same run within fp32 reduction-order noise."""
    run_dir = tmp_path / "single"
    copy_steps(reference["run_dir"] / "checkpoints", run_dir / "checkpoints", 4)
    trainer, result = run_trainer(tiny_config(reference["shards"], run_dir, STEPS, "data.batch_size=8"))
    assert result.steps == STEPS and trainer.train_data.dp_size == 1
    diff = max_diff(final_weights(run_dir), reference["weights"])
    assert diff < LAYOUT_CHANGE_TOLERANCE, diff
    ref_state = json.loads((reference["run_dir"] / "checkpoints" / step_dir_name(STEPS) / "trainer_state.json")
                           .read_text())
    assert trainer.train_data.state_dict()["consumed"] == ref_state["data"]["consumed"]


def test_fsdp_checkpoint_resumes_as_pipeline(reference, tmp_path):
    """dp2 (FSDP) -> pp2 (two pipeline stages, each holding part of the model and optimizer)."""
    run_dir = tmp_path / "pipeline"
    copy_steps(reference["run_dir"] / "checkpoints", run_dir / "checkpoints", 4)
    _check(_launch(run_dir, reference["shards"], "parallel.pp=2", "parallel.dp_shard=1", "data.batch_size=8"))
    diff = max_diff(final_weights(run_dir), reference["weights"])
    assert diff < LAYOUT_CHANGE_TOLERANCE, diff


def test_fsdp_checkpoint_resumes_as_context_parallel(reference, tmp_path):
    """dp2 (FSDP) -> cp2 (one data-parallel replica, each sequence split over two ranks): the same run, the
    trainer's whole step under context parallel (data, token counts, loss, FSDP over the cp ranks)."""
    run_dir = tmp_path / "context"
    copy_steps(reference["run_dir"] / "checkpoints", run_dir / "checkpoints", 4)
    _check(_launch(run_dir, reference["shards"], "parallel.cp=2", "parallel.dp_shard=1", "data.batch_size=8"))
    diff = max_diff(final_weights(run_dir), reference["weights"])
    assert diff < LAYOUT_CHANGE_TOLERANCE, diff


def test_rank_killed_during_save_leaves_previous_checkpoint(reference, tmp_path):
    run_dir = tmp_path / "killed"
    root = copy_steps(reference["run_dir"] / "checkpoints", run_dir / "checkpoints", 2)
    results = _launch(run_dir, reference["shards"], kill_at_save=4, timeout=90.0)
    assert results[1].returncode == -signal.SIGKILL, results[1].stdout[-2000:]
    assert committed_steps(root) == [2]
    assert [p.name for p in partial_dirs(root)] == [step_dir_name(4) + ".partial"]
    manager = CheckpointManager.from_config(tiny_config(reference["shards"], run_dir, STEPS), run_dir)
    assert manager.find_valid() == root / step_dir_name(2)
    manager.close()


@pytest.mark.slow
def test_pp2_dp2_tp2_to_dp4_to_one_process(reference, tmp_path):
    """The issue's chain: a 3-D layout's checkpoint continues as dp4, whose checkpoint continues in one process."""
    three_d = tmp_path / "pp2dp2tp2"
    _check(_launch(three_d, reference["shards"], "parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2",
                   "checkpoint.keep_last=3", nproc=8, timeout=600.0))
    dp4 = tmp_path / "dp4"
    copy_steps(three_d / "checkpoints", dp4 / "checkpoints", 2)
    _check(_launch(dp4, reference["shards"], "data.batch_size=2", "checkpoint.keep_last=3", nproc=4, timeout=600.0))
    single = tmp_path / "single"
    copy_steps(dp4 / "checkpoints", single / "checkpoints", 4)
    run_trainer(tiny_config(reference["shards"], single, STEPS, "data.batch_size=8"))
    for run in (dp4, single):
        diff = max_diff(final_weights(run), final_weights(three_d))
        assert diff < LAYOUT_CHANGE_TOLERANCE, (run.name, diff)


MOE = ("model.moe.n_experts=4", "model.moe.experts_per_token=2", "model.moe.d_ff=32", "model.moe.aux_loss=0.01",
       "model.moe.router_bias_update_rate=0.01")


@pytest.mark.slow
def test_moe_checkpoint_reshards_across_expert_parallel_degrees(reference, tmp_path):
    """Experts split 4 ways (one per rank) resume split 2 ways, then in one process: each expert, its AdamW state and
    the routers' trained selection bias arrive whole (the bias is part of the final weights)."""
    ep4 = tmp_path / "ep4"
    _check(_launch(ep4, reference["shards"], *MOE, "parallel.ep=4", "data.batch_size=2", nproc=4, timeout=600.0))
    ep2 = tmp_path / "ep2"
    copy_steps(ep4 / "checkpoints", ep2 / "checkpoints", 2)
    _check(_launch(ep2, reference["shards"], *MOE, "parallel.ep=2"))
    single = tmp_path / "single"
    copy_steps(ep2 / "checkpoints", single / "checkpoints", 4)
    run_trainer(tiny_config(reference["shards"], single, STEPS, *MOE, "data.batch_size=8"))
    weights = final_weights(ep4)
    bias = weights["decoder_layers.1.ffn.router.expert_bias"]
    assert bias.abs().max() > 0, "the bias balancing never moved the routers' bias"
    for run in (ep2, single):
        diff = max_diff(final_weights(run), weights)
        assert diff < LAYOUT_CHANGE_TOLERANCE, (run.name, diff)


def test_normuon_state_reshards_from_tensor_parallel_to_fsdp_and_one_process(reference, tmp_path):
    """optim.name="normuon", whose state is Muon's (momentum buffers, AdamW's moments for the rest) plus per-neuron
    second moments: saved as tensor-parallel shards, it resumes under FSDP, then in one process, each time
    continuing the run (the step gathers whole matrices in every layout). The second moments are whole on every rank
    that shares a matrix: tensor-parallel ranks save a replicated one from rank 0 alone, and a matrix's owner
    differs by layout (without the sum over the sharing ranks the FSDP run is 1.5e-3 off)."""
    muon = ('optim.name="normuon"', "optim.normuon.lr=0.01")
    tp = tmp_path / "tp"
    _check(_launch(tp, reference["shards"], *muon, "parallel.tp=2", "parallel.dp_shard=1", "data.batch_size=8"))
    fsdp = tmp_path / "fsdp"
    copy_steps(tp / "checkpoints", fsdp / "checkpoints", 2)
    _check(_launch(fsdp, reference["shards"], *muon))
    single = tmp_path / "single"
    copy_steps(fsdp / "checkpoints", single / "checkpoints", 4)
    run_trainer(tiny_config(reference["shards"], single, STEPS, *muon, "data.batch_size=8"))
    for run in (fsdp, single):
        diff = max_diff(final_weights(run), final_weights(tp))
        assert diff < LAYOUT_CHANGE_TOLERANCE, (run.name, diff)


MTP = ("model.position=rope", "model.layer_types=['mla']", "model.norm.kind=rmsnorm", "model.bias=false",
       "model.moe.n_experts=4", "model.moe.experts_per_token=2", "model.moe.d_ff=32", "model.moe.router_score=sigmoid",
       "model.mlp_types=['dense', 'moe']", "model.mtp.depth=1", "model.mtp.loss_weight=0.3",
       # MLA widths within the tiny d_model of 32
       "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=16")


def test_mtp_checkpoint_reshards_between_one_process_and_pipeline(tmp_path):
    """Multi-token prediction: one process's checkpoint resumes as pp2 (the modules and a copy of the embedding on the
    last stage), whose checkpoint resumes in one process: the same run, saved under the plain model's names."""
    shards = tiny_shards(tmp_path)
    single = tmp_path / "single"
    run_trainer(tiny_config(shards, single, STEPS, *MTP, "data.batch_size=8"))
    pipeline = tmp_path / "pipeline"
    copy_steps(single / "checkpoints", pipeline / "checkpoints", 2)
    _check(_launch(pipeline, shards, *MTP, "parallel.pp=2", "parallel.dp_shard=1", "data.batch_size=8"))
    back = tmp_path / "back"
    copy_steps(pipeline / "checkpoints", back / "checkpoints", 4)
    run_trainer(tiny_config(shards, back, STEPS, *MTP, "data.batch_size=8"))
    reference = final_weights(single)
    assert "mtp_layers.0.eh_proj.weight" in reference
    for run in (pipeline, back):
        diff = max_diff(final_weights(run), reference)  # the same names: the embedding copy is not saved apart
        assert diff < LAYOUT_CHANGE_TOLERANCE, (run.name, diff)


GATED_DELTA = ('model.layer_types=["linear_attention", "full_attention"]', "model.linear_attention.n_heads=4",
               "model.linear_attention.n_key_heads=2", "model.linear_attention.key_head_dim=8",
               "model.linear_attention.value_head_dim=8", "model.linear_attention.chunk_size=8")


@pytest.mark.parametrize("projections", ["grouped", "split"])
def test_gated_deltanet_reshards_from_tensor_parallel_to_one_process(reference, tmp_path, projections):
    """Gated DeltaNet blocks saved under tp=2 (heads split, the [q | k | v] convolution whole on each rank) resume in
    one process and continue as the tensor-parallel run does."""
    layout = (*GATED_DELTA, f'model.linear_attention.projections="{projections}"', "data.batch_size=8")
    tp = tmp_path / "tp"
    _check(_launch(tp, reference["shards"], *layout, "parallel.tp=2", "parallel.dp_shard=1"))
    single = tmp_path / "single"
    copy_steps(tp / "checkpoints", single / "checkpoints", 2)
    run_trainer(tiny_config(reference["shards"], single, STEPS, *layout))
    tp_weights = final_weights(tp)
    assert tp_weights["decoder_layers.0.attn.conv1d.weight"].shape == (2 * 2 * 8 + 4 * 8, 1, 4)  # the whole weight
    assert max_diff(final_weights(single), tp_weights) < LAYOUT_CHANGE_TOLERANCE


def test_kda_reshards_from_tensor_parallel_to_one_process(reference, tmp_path):
    """KDA blocks saved under tp=2 (heads split: q, k, v, their convolutions, A_log and dt_bias) resume in one
    process and continue as the tensor-parallel run does."""
    layout = ('model.layer_types=["kda", "full_attention"]', *GATED_DELTA[1:2], *GATED_DELTA[3:],
              "data.batch_size=8")
    tp = tmp_path / "tp"
    _check(_launch(tp, reference["shards"], *layout, "parallel.tp=2", "parallel.dp_shard=1"))
    single = tmp_path / "single"
    copy_steps(tp / "checkpoints", single / "checkpoints", 2)
    run_trainer(tiny_config(reference["shards"], single, STEPS, *layout))
    tp_weights = final_weights(tp)
    assert tp_weights["decoder_layers.0.attn.q_conv1d.weight"].shape == (4 * 8, 1, 4)  # whole: both ranks' heads
    assert tp_weights["decoder_layers.0.attn.dt_bias"].shape == (4 * 8,)
    assert max_diff(final_weights(single), tp_weights) < LAYOUT_CHANGE_TOLERANCE


# ----------------------------------------------------------------------------- one rank of a launch


def _worker(run_dir: str, shards: str, kill_at_save: str, *extra: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    if int(kill_at_save) and rank == 1:
        write_data = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            if step_dir_name(int(kill_at_save)) in str(self.path):
                os.kill(os.getpid(), signal.SIGKILL)  # mid-save: this rank's shard is never written
            return write_data(self, plan, planner)

        dcp.FileSystemWriter.write_data = write_then_die
    run_trainer(tiny_config(Path(shards), Path(run_dir), STEPS, *extra), rank=rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(*sys.argv[1:])
