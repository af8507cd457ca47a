"""Cross-group traffic of fault_tolerance.method "sync", "local_sgd" and "diloco" (docs/fault-tolerance.md).

    python bench/semi_sync.py [--groups 2] [--steps 24] [--sync-every 4 8]
                              [--table docs/benchmarks/data/fault-tolerance-02-semi-sync.json --machine "..."]

tiny-gpt replica groups of one rank each, as threads of this process around an in-process Lighthouse (torchft
Managers and gloo, as in a real run), trained with AdamW on random tokens. Every method goes through the code the
trainer uses (meshformer/runtime/fault_tolerance.py): sync averages the gradients at every step, local_sgd and
diloco synchronise the weights every H steps. The bytes each rank hands to torchft's all-reduce (Manager.allreduce)
are counted over the run and divided by its steps; the ratio is against sync in the same run. Prints one JSON line
per method.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tables import add_table_arguments, write_table

CONFIG = "tiny-gpt"
COLUMNS = ["method", "H (sync_every)", "all-reduces per step", "bytes per step per rank", "vs sync"]


def run_method(groups: int, steps: int, method: str, sync_every: int) -> dict[str, float]:
    """Train `steps` steps in `groups` threads; the all-reduce calls and bytes per step of group 0's rank."""
    from meshformer.config import load_config
    from meshformer.config.sections import FaultToleranceConfig
    from meshformer.model.transformer import Transformer
    from meshformer.runtime.fault_tolerance import ReplicaGroup, SemiSync, start_lighthouse

    cfg = load_config(CONFIG, []).model
    ft = FaultToleranceConfig(enabled=True, replica_groups=groups, min_replicas=groups, method=method,  # type: ignore[arg-type]
                              sync_every=sync_every, join_timeout_s=30)
    lighthouse = start_lighthouse(ft, bind="127.0.0.1:0")
    ft = replace(ft, lighthouse=lighthouse.address())
    build = threading.Lock()
    counted: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def group_main(replica: int) -> None:
        with build:  # the threads share torch's global RNG: every group starts from the same weights
            torch.manual_seed(0)
            model = Transformer(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        group = ReplicaGroup(ft, replica, torch.device("cpu"), state_dict=dict, load_state_dict=lambda state: None,
                             log=print)
        calls = counted.setdefault(replica, [0, 0])
        allreduce = group.manager.allreduce

        def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            calls[1] += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)

        group.manager.allreduce = counting  # type: ignore[method-assign]
        semi = SemiSync(ft, group, [model], optimizer) if method != "sync" else None
        gen = torch.Generator().manual_seed(replica)
        try:
            for step in range(steps):
                if semi is None:
                    group.start_step()
                elif step == 0 or semi.due(step):
                    group.start_step()
                    group.members()
                    assert semi.sync(), "a synchronisation failed"
                ids = torch.randint(0, cfg.vocab_size, (4, 65), generator=gen)
                F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
                if semi is None:
                    group.average_gradients(model.parameters(), torch.tensor(float(ids[:, 1:].numel())))
                    assert group.should_commit(), "a step failed"
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if semi is not None:  # the run's last synchronisation, at train.steps
                group.start_step()
                group.members()
                assert semi.sync()
        except BaseException as err:
            errors.append(err)
        finally:
            group.shutdown()

    threads = [threading.Thread(target=group_main, args=(r,)) for r in range(groups)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lighthouse.shutdown()
    if errors:
        raise errors[0]
    calls, size = counted[0]
    return {"allreduces_per_step": calls / steps, "bytes_per_step": size / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24, help="a multiple of every H")
    parser.add_argument("--sync-every", type=int, nargs="+", default=[4, 8], help="H of local_sgd and diloco")
    add_table_arguments(parser)
    args = parser.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")
    torch.set_num_threads(1)
    runs = [("sync", 1)] + [(m, h) for h in args.sync_every for m in ("local_sgd", "diloco")]
    results = []
    for method, h in runs:
        result = {"method": method, "sync_every": h, **run_method(args.groups, args.steps, method, h)}
        print(json.dumps(result))
        results.append(result)
    if args.table:
        base = results[0]["bytes_per_step"]
        rows = [[r["method"], r["sync_every"] if r["method"] != "sync" else "every step",
                 f"{r['allreduces_per_step']:.2f}", f"{r['bytes_per_step']:,.0f}", f"{r['bytes_per_step'] / base:.3f}x"]
                for r in results]
        write_table(args.table, machine=args.machine, page="fault-tolerance",
                    title="Cross-group traffic: sync, local_sgd and DiLoCo",
                    command=f"python bench/semi_sync.py --groups {args.groups} --steps {args.steps} --sync-every "
                            + " ".join(map(str, args.sync_every)),
                    setup=f"tiny-gpt, {args.groups} replica groups of 1 rank, {args.steps} steps with AdamW, gloo; the "
                          "bytes one rank hands to torchft's all-reduce, per step (each sync method's last "
                          "synchronisation at the end of the run included):",
                    notes="sync sends the fp32 gradients (and the groups' tokens) at every step; local_sgd and diloco "
                          "send the weights (local_sgd) or the pseudo-gradient (diloco), the same size, "
                          "one all-reduce per tensor, every H steps, plus one flag per group naming the "
                          "synchronisation's members. Their runs also synchronise once at the first step (where a "
                          "restarted group heals), which is why the ratio is above 1/H.",
                    align=["l", "r", "r", "r", "r"], columns=COLUMNS, rows=rows)


if __name__ == "__main__":
    main()
