"""`meshformer plan CONFIG --world N [--gpu h100-80gb] [--set ...] [--moe-imbalance 1.5] [--json]`: memory per rank,
fit, and the smallest layouts that fit, printed as tables (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import TYPE_CHECKING

from meshformer.errors import UsageError
from meshformer.launcher.torchrun import check_world_size
from meshformer.planner.assumptions import CUDA_CONTEXT, DEVICES, MOE_IMBALANCE, SAFETY_FRACTION, GiB
from meshformer.planner.goodput import RESTART_S

if TYPE_CHECKING:  # the planner imports torch: loaded when a plan runs, not for --help
    from meshformer.config import Config
    from meshformer.planner.search import LayoutMemory

MAX_PLAN_LAYERS = 1024


def _gib(value: float) -> str:
    return f"{value / GiB:.2f}"


def layout_name(layout: LayoutMemory) -> str:
    replicas = f"x{layout.dp_replicate}" if layout.dp_replicate > 1 else ""
    return (f"pp{layout.pp} tp{layout.tp} dp{layout.dp_shard}{replicas}" + (f" cp{layout.cp}" if layout.cp > 1 else "")
            + (f" ep{layout.ep}" if layout.ep > 1 else ""))


def assumptions(cfg: Config, layout: LayoutMemory) -> dict:
    """What the estimate of `cfg`'s own layout takes as given: the step's shape, the dtypes, recomputation."""
    p, data = cfg.parallel, cfg.data
    from meshformer.optim import get_optimizer_spec  # torch: only once a plan is made, not for --help
    from meshformer.parallel_dims import n_microbatches

    microbatches = n_microbatches(cfg) if layout.pp > 1 else 1
    fsdp = layout.dp_shard * layout.cp > 1
    return {
        "seq_len": data.seq_len,
        "micro_batch": max(1, data.batch_size // microbatches),  # sequences per micro-batch per data-parallel rank
        "pipeline_microbatches": microbatches,
        "grad_accum": cfg.train.grad_accum,
        # FSDP keeps fp32 master shards and gradient shards whatever its policy; the policy sets the gathered ones
        "param_dtype": "fp32" + (f" (gathered in {p.mixed_precision_param})" if fsdp else ""),
        "grad_dtype": "fp32" + (f" (reduced in {p.mixed_precision_reduce})" if fsdp else ""),
        "optimizer_state": get_optimizer_spec(cfg.optim.name).state_description,
        "compute_dtype": cfg.train.dtype,
        "recompute": layout.recompute,
    }


def _order_key(layout: LayoutMemory) -> tuple[int, int, int]:
    from meshformer.planner.search import RECOMPUTE_MODES

    return layout.tp * layout.pp * layout.cp, RECOMPUTE_MODES.index(layout.recompute), layout.ep


ORDER = ("least model and sequence parallelism (tp x pp x cp), then least recomputation, then fewest expert-parallel "
         "ranks, then lowest peak")


def ties(layouts: list[LayoutMemory]) -> list[str]:
    """One line per run of listed layouts whose estimated peaks agree to the printed 0.01 GiB: what they share
    and what ordered them (the planner estimates memory only, so equal memory is the whole tie)."""
    lines: list[str] = []
    group: list[LayoutMemory] = []
    for layout in [*layouts, None]:
        if layout is not None and group and round(layout.peak / GiB, 2) == round(group[0].peak / GiB, 2):
            group.append(layout)
            continue
        if len(group) > 1:
            keys = [_order_key(g) for g in group]
            shared = [f"tp x pp x cp = {keys[0][0]}" if len({k[0] for k in keys}) == 1 else "",
                      f"recompute={group[0].recompute}" if len({k[1] for k in keys}) == 1 else ""]
            differ = ("model parallelism" if len({k[0] for k in keys}) > 1 else
                      "recomputation" if len({k[1] for k in keys}) > 1 else
                      "fewer expert-parallel ranks (fewer all-to-all peers)" if len({k[2] for k in keys}) > 1 else
                      "smaller tp first (the search's order)")
            names = ", ".join(layout_name(g) + f" {g.recompute}" for g in group)
            lines.append(f"{names} tie on estimated peak memory ({group[0].peak / GiB:.2f} GiB)"
                         + (f" with {' and '.join(s for s in shared if s)}" if any(shared) else "")
                         + f"; ordered by {differ}")
        group = [layout] if layout is not None else []
    return lines


def _same_layout(layout: LayoutMemory, configured: LayoutMemory) -> bool:
    """A listed layout is the config's own: the same ranks in every dimension and the same recomputation."""
    return layout_name(layout) == layout_name(configured) and layout.recompute == configured.recompute


def report(cfg: Config, world: int, device: str, *, search: bool = True, top: int = 5,
           moe_imbalance: float = MOE_IMBALANCE) -> dict:
    start = time.perf_counter()
    from meshformer.planner.context_parallel_bytes import context_parallel_report
    from meshformer.planner.memory import as_dict, usable_bytes
    from meshformer.planner.search import plan_layout, search_layouts

    chosen = plan_layout(cfg, world, moe_imbalance)
    layouts = search_layouts(cfg, world, device, moe_imbalance) if search else []
    budget = usable_bytes(device)
    listed = [lay for lay in layouts if lay.peak <= budget][:top]
    micro_batch = assumptions(cfg, chosen)["micro_batch"]
    return {
        "assumptions": assumptions(cfg, chosen),
        "world_size": world,
        "device": device,
        "capacity_gib": DEVICES[device] / GiB,
        "usable_gib": budget / GiB,
        "margin": f"{SAFETY_FRACTION:.0%} of capacity" + (f" + {CUDA_CONTEXT / GiB:.0f} GiB CUDA context"
                                                           if device != "cpu" else ""),
        "layout": {"name": layout_name(chosen), "recompute": chosen.recompute, "peak_gib": chosen.peak / GiB,
                   "fits": chosen.peak <= budget, "ranks": [as_dict(rank) for rank in chosen.ranks]},
        "searched": search,
        "fitting_layouts": [{"name": layout_name(lay), "recompute": lay.recompute, "peak_gib": lay.peak / GiB,
                             "configured": _same_layout(lay, chosen)} for lay in listed],
        "order": ORDER,
        "ties": ties(listed),
        "moe_imbalance": moe_imbalance if cfg.model.moe.n_experts else None,
        "context_parallel": context_parallel_report(cfg, [(lay.cp, lay.tp) for lay in [chosen, *listed]],
                                                    micro_batch),
        "seconds": time.perf_counter() - start,
    }


def print_report(result: dict, title: str) -> None:
    from meshformer.planner.context_parallel_bytes import RULE as CP_RULE

    lay = result["layout"]
    print(f"{title}: {lay['name']} ({result['world_size']} ranks), recompute={lay['recompute']}; "
          f"{result['device']}: {result['capacity_gib']:.1f} GiB, usable {result['usable_gib']:.1f} GiB "
          f"(margin {result['margin']})")
    a = result["assumptions"]
    sequences = f"{a['micro_batch']} sequence" + ("s" if a["micro_batch"] != 1 else "")
    print(f"assumes: seq_len {a['seq_len']}, micro-batch {sequences} per data-parallel rank"
          + (f" x {a['pipeline_microbatches']} pipeline micro-batches" if a["pipeline_microbatches"] > 1 else "")
          + f", grad_accum {a['grad_accum']}; params {a['param_dtype']}, grads {a['grad_dtype']}, "
          f"{a['optimizer_state']}, compute {a['compute_dtype']}; recompute={a['recompute']}")
    columns = ["pp rank", "layers", "params", "grads", "optim", "fsdp bufs", "act/mb", "in flight", "act",
               "logits", "peak GiB", "peak at"]
    rows = [[str(r["pp_rank"]), str(r["layers"]), _gib(r["params"]), _gib(r["grads"]), _gib(r["optimizer"]),
             _gib(r["fsdp_buffers"]), _gib(r["activations_per_microbatch"]), f"{r['in_flight']:.1f}",
             _gib(r["activations"]), _gib(r["logits"]), _gib(r["peak"]), r["peak_at"]] for r in lay["ranks"]]
    _table(columns, rows)
    verdict = "fits" if lay["fits"] else "does NOT fit"
    print(f"peak {lay['peak_gib']:.2f} GiB per rank: {verdict} in {result['usable_gib']:.1f} GiB")
    if result["moe_imbalance"] is not None:
        print(f"experts planned at {result['moe_imbalance']:g}x the balanced tokens per expert-parallel rank "
              "(--moe-imbalance; dropless worst case: ep x)")
    if result["fitting_layouts"]:
        print("smallest layouts that fit (FSDP over the remaining ranks, the same micro-batch):")
        _table(["layout", "recompute", "peak GiB", ""],
               [[f["name"], f["recompute"], f"{f['peak_gib']:.2f}", "configured" if f["configured"] else ""]
                for f in result["fitting_layouts"]])
        print(f"order: {result['order']}")
        for line in result["ties"]:
            print(f"tie: {line}")
    elif result["searched"]:  # --no-search: the configured layout's verdict above is the answer
        print("no layout with tp <= 8 and cp <= 16 fits; add ranks, shorten data.seq_len or lower data.batch_size")
    for row in result.get("context_parallel", []):
        methods = row["methods"]
        parts = [f"{name} sends {m['sent_gib']:.3g} GiB, keeps {m['kept_gib']:.3g} GiB"
                 + (" (cannot run: " + m["refusal"].split(";")[0] + ")" if m["refusal"] else "")
                 for name, m in methods.items()]
        change = (f"; set parallel.cp_method='{row['recommended']}'" if row["recommended"] != row["configured"]
                  else "")
        print(f"context parallel cp={row['cp']} tp={row['tp']}, per rank and micro-batch: {'; '.join(parts)}; "
              f"recommended: {row['recommended']}{change} ({CP_RULE})")
    print(f"({result['seconds']:.1f} s)")


def _table(columns: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    for row in (columns, *rows):  # a last column left empty leaves no trailing blanks
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def _plan(args: argparse.Namespace) -> None:
    from meshformer.config import load_config
    from meshformer.model.families import get_family_spec

    check_world_size(args.world, "--world")
    imbalance = args.moe_imbalance
    if not (math.isfinite(imbalance) and imbalance >= 1):
        raise UsageError(f"--moe-imbalance {imbalance} is {'below 1' if imbalance < 1 else 'not a finite number'} "
                         "(it is an expert's received tokens over the balanced load)",
                         "pass a factor >= 1, e.g. --moe-imbalance 1.5")
    if args.top < 1:
        raise UsageError(f"--top {args.top} lists no layout", "pass how many fitting layouts to list, e.g. --top 5")
    cfg = load_config(args.config, args.set)
    if args.failures:
        _failures(args, cfg)
        return
    # each multi-token prediction module holds a block of its own
    layers = get_family_spec(cfg.model.family).total_layers(cfg.model) + cfg.model.mtp.depth
    if layers > MAX_PLAN_LAYERS:  # every block is built on meta and sharded per layout: minutes per thousand
        raise UsageError(f"the model has {layers} layers, beyond what the planner builds (at most {MAX_PLAN_LAYERS}, "
                         "8x the deepest models trained)", "check model.n_layers and model.mtp.depth (and the "
                         "family's other stacks)")
    result = report(cfg, args.world, args.gpu, search=not args.no_search, top=args.top,
                    moe_imbalance=args.moe_imbalance)
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result, args.config)


def _failures(args: argparse.Namespace, cfg: Config) -> None:
    from meshformer.model.flops import count_params
    from meshformer.planner.goodput import SCALES, print_goodput

    if args.group_gpus < 1:
        raise UsageError(f"--group-gpus {args.group_gpus} makes no replica group", "pass GPUs per group, e.g. 8")
    if not (math.isfinite(args.restart_s) and args.restart_s >= 0):
        raise UsageError(f"--restart-s {args.restart_s} is not a duration", "pass seconds >= 0, e.g. --restart-s 600")
    worlds = sorted({*SCALES, args.world})
    print_goodput(args.config, count_params(cfg.model)["total"], worlds, group_gpus=args.group_gpus,
                  restart_s=args.restart_s)


def add_cli(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="memory per rank of a layout at any world size, and the layouts that fit")
    plan.add_argument("config", help="bundled config name or TOML file")
    plan.add_argument("--world", type=int, required=True, help="number of ranks (GPUs)")
    plan.add_argument("--gpu", choices=sorted(DEVICES), default="h100-80gb", help="device whose memory to fit")
    plan.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="e.g. parallel.tp=8")
    plan.add_argument("--top", type=int, default=5, help="how many fitting layouts to list")
    plan.add_argument("--moe-imbalance", type=float, default=MOE_IMBALANCE,
                      help="MoE: tokens an expert-parallel rank's experts receive, over the balanced load "
                           f"(default {MOE_IMBALANCE}; dropless worst case: ep)")
    plan.add_argument("--no-search", action="store_true", help="only the configured layout")
    plan.add_argument("--json", action="store_true", help="print the plans as JSON")
    plan.add_argument("--failures", action="store_true",
                      help="instead of memory: the share of wall time that trains under Llama 3's failure rate, "
                           "checkpoint-restart against replica healing, at 1,024 and 16,384 GPUs and --world "
                           "(docs/fault-tolerance.md)")
    plan.add_argument("--group-gpus", type=int, default=8, help="--failures: GPUs per replica group")
    plan.add_argument("--restart-s", type=float, default=RESTART_S,
                      help="--failures: seconds a checkpoint-restart takes besides the load (default: %(default)s, "
                           "measured: docs/benchmarks/fault-tolerance.md)")
    plan.set_defaults(func=_plan)
