"""Test-only faults for tests/end_to_end/test_cluster_*.py, injected into the real entry point (`-m meshformer.train`).

Python imports this file at start-up when its folder is on PYTHONPATH. It does nothing unless MF_TEST_* variables
are set, and then only patches meshformer.train.trainer when that module is first imported, so torchrun, srun and
SLURM launch the unmodified command line:
- MF_TEST_STEP_SLEEP_S=S: every rank sleeps S seconds per step (a run long enough to interrupt mid-way);
- MF_TEST_SLOW_RANK=R with MF_TEST_SLOW_DATA_S=S: rank R waits S seconds for every batch (a data straggler);
- MF_TEST_SLOW_RANK=R with MF_TEST_HANG_STEP=N, MF_TEST_HANG_S=S: rank R waits S seconds for the batch of step N;
- MF_TEST_SAVE_SLEEP_S=S: every checkpoint waits S seconds before it commits (a save long enough to signal into);
- MF_TEST_STOP_SAVE_SLEEP_S=S: the checkpoint of a stop (after a stop signal) waits S seconds before it commits;
- MF_TEST_FAIL_RANK=R with MF_TEST_FAIL_STEP=N: rank R fails with a user error (one line) before step N, alone;
- MF_TEST_KILL_RANK=R with MF_TEST_KILL_STEP=N: rank R dies of SIGKILL before step N (the out-of-memory killer);
  with MF_TEST_KILL_REPLICA=G only in replica group G, and with MF_TEST_KILL_MARK=PATH only once (PATH created;
  PATH-<group> in a replica group);
- MF_TEST_SLOW_PHASE=P with MF_TEST_SLOW_PHASE_S=S: each batch of phase P waits S seconds (a long phase to signal
  into): "eval" (held-out batches) or "downstream" (scoring batches); MF_TEST_PHASE_MARK=PATH is created as it
  starts.
- MF_TEST_COMMIT_FAIL_STEP=N: rank 0 alone fails to commit the checkpoint of step N (an I/O error on rename);
  with MF_TEST_SAVE_OUTCOME=PATH each rank appends the steps of the saves it counted as failed to PATH-rank<R>;
- MF_TEST_HEAL_SLEEP_S=S with MF_TEST_HEAL_MARK=PATH: a replica group's heal (fault tolerance) creates PATH, then
  waits S seconds before it loads the peer's state (a heal long enough to kill a group or signal into).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time

TARGET = "meshformer.train.trainer"


class SlowLoader:
    """Wraps the training loader: sleeps before handing out each batch."""

    def __init__(self, loader, trainer) -> None:
        self.loader, self.trainer = loader, trainer

    def __iter__(self):
        delay = float(os.environ.get("MF_TEST_SLOW_DATA_S", "0"))
        hang_step, hang_s = int(os.environ.get("MF_TEST_HANG_STEP", "0")), float(os.environ.get("MF_TEST_HANG_S", "0"))
        for batch in self.loader:
            time.sleep(hang_s if self.trainer.step + 1 == hang_step else delay)
            yield batch

    def __getattr__(self, name):  # state_dict / load_state_dict for checkpoints
        return getattr(self.loader, name)


slow_phase = os.environ.get("MF_TEST_SLOW_PHASE", "")


def phase_wait(phase: str) -> None:
    if phase != slow_phase:
        return
    mark = os.environ.get("MF_TEST_PHASE_MARK")
    if mark and not os.path.exists(mark):
        open(mark, "w").close()
    time.sleep(float(os.environ.get("MF_TEST_SLOW_PHASE_S", "0")))


def patch(module) -> None:
    trainer_cls = module.Trainer
    init, train_step = trainer_cls.__init__, trainer_cls.train_step
    step_sleep = float(os.environ.get("MF_TEST_STEP_SLEEP_S", "0"))
    slow_rank = int(os.environ.get("MF_TEST_SLOW_RANK", "-1"))

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.rank == slow_rank:
            self.train_data = SlowLoader(self.train_data, self)
        if slow_phase in ("eval", "downstream"):  # both run the model's evaluate, batch by batch
            evaluate = self.parallel_model.evaluate
            self.parallel_model.evaluate = lambda batch, *args, **kwargs: (  # args: downstream's row loss
                phase_wait("eval" if getattr(self, "test_in_eval", False) else "downstream"),
                evaluate(batch, *args, **kwargs))[1]

    fail_rank, fail_step = int(os.environ.get("MF_TEST_FAIL_RANK", "-1")), int(os.environ.get("MF_TEST_FAIL_STEP", "0"))
    kill_rank, kill_step = int(os.environ.get("MF_TEST_KILL_RANK", "-1")), int(os.environ.get("MF_TEST_KILL_STEP", "0"))
    kill_replica, kill_mark = os.environ.get("MF_TEST_KILL_REPLICA"), os.environ.get("MF_TEST_KILL_MARK")
    if kill_mark and "MESHFORMER_REPLICA_ID" in os.environ:
        kill_mark += "-" + os.environ["MESHFORMER_REPLICA_ID"]
    if kill_replica is not None and os.environ.get("MESHFORMER_REPLICA_ID") != kill_replica:
        kill_rank = -1

    def patched_step(self):
        time.sleep(step_sleep)
        if self.rank == fail_rank and self.step + 1 == fail_step:
            from meshformer.errors import ConfigError

            raise ConfigError(f"injected failure of rank {fail_rank} before step {fail_step}", "nothing to fix")
        if self.rank == kill_rank and self.step + 1 == kill_step and not (kill_mark and os.path.exists(kill_mark)):
            import signal

            if kill_mark:
                open(kill_mark, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return train_step(self)

    trainer_cls.__init__ = patched_init
    if slow_phase in ("eval", "downstream"):  # which of the two is running
        evaluate_held_out = trainer_cls.evaluate

        def flagged_evaluate(self):
            self.test_in_eval = True
            try:
                return evaluate_held_out(self)
            finally:
                self.test_in_eval = False

        trainer_cls.evaluate = flagged_evaluate
    if step_sleep or fail_rank >= 0 or kill_rank >= 0:
        trainer_cls.train_step = patched_step
    heal_sleep = float(os.environ.get("MF_TEST_HEAL_SLEEP_S", "0"))
    if heal_sleep:
        import meshformer.train.setup as setup  # a heal loads the peer's state through the set-up's restore step

        load_live_state = setup.load_live_state

        def slow_heal(*args, **kwargs):
            open(os.environ["MF_TEST_HEAL_MARK"], "a").close()
            time.sleep(heal_sleep)
            return load_live_state(*args, **kwargs)

        setup.load_live_state = slow_heal
    save_sleep = float(os.environ.get("MF_TEST_SAVE_SLEEP_S", "0"))
    stop_save_sleep = float(os.environ.get("MF_TEST_STOP_SAVE_SLEEP_S", "0"))
    if save_sleep or stop_save_sleep:
        manager_cls = module.CheckpointManager
        commit, finish = manager_cls._commit, manager_cls.finish

        def slow_finish(self, run, *, stopping=False, **kwargs):
            self.test_stopping = stopping
            return finish(self, run, stopping=stopping, **kwargs)

        def slow_commit(self, *args, **kwargs):
            time.sleep(stop_save_sleep if getattr(self, "test_stopping", False) else save_sleep)
            return commit(self, *args, **kwargs)

        manager_cls._commit, manager_cls.finish = slow_commit, slow_finish
    if os.environ.get("MF_TEST_COMMIT_FAIL_STEP"):
        fail_commit(module.CheckpointManager)


def fail_commit(manager_cls) -> None:
    fail_step = int(os.environ.get("MF_TEST_COMMIT_FAIL_STEP", "0"))
    commit = manager_cls._commit

    def failing_commit(self, partial, step):
        if step == fail_step:
            import errno

            raise OSError(errno.EIO, f"Input/output error (injected: rank 0 commits step {step})")
        return commit(self, partial, step)

    manager_cls._commit = failing_commit
    outcome = os.environ.get("MF_TEST_SAVE_OUTCOME")
    if outcome:
        report = manager_cls._report_failed_save

        def recorded_report(self, *, block):  # what each rank concluded about its asynchronous saves
            failed, step = self.failed_saves, self._pending_step
            report(self, block=block)
            if self.failed_saves > failed:
                with open(f"{outcome}-rank{self.rank}", "a") as file:
                    file.write(f"{step}\n")

        manager_cls._report_failed_save = recorded_report


class PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if any(key.startswith("MF_TEST_") for key in os.environ):
    sys.meta_path.insert(0, PatchOnImport())
