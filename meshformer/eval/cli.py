"""`meshformer eval RUN_OR_FOLDER --tasks T1,T2`: lm-eval's tasks scored by meshformer's model, offline; writes
lm-eval's results JSON. RUN_OR_FOLDER: a run folder, a weights folder, a sharded checkpoint or a Hugging Face folder
(eval/model_folder.py). With --nproc-per-node N the data-parallel ranks (torchrun, gloo) share the requests, each
with a whole model; with --set parallel.KEY=VALUE the ranks hold the model as that layout does (tensor, pipeline,
context, expert parallel, FSDP) and run its evaluation forward (eval/layout_forward.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from meshformer.errors import ConfigError, UsageError

LAYOUT_KEYS = ("parallel.", "train.device=")  # what --set may change: how the model is laid out, not what it computes

DESCRIPTION = """\
Score lm-eval tasks with a run's final weights (or its newest checkpoint), a weights folder, a sharded checkpoint or
a Hugging Face folder, with no export step, through lm-eval's own evaluator (its prompts, few-shot sampling, filters
and metrics). Tasks: names from lm-eval's registry (hellaswag, arc_easy, mmlu, ...) whose datasets are in the local
`datasets` cache, task folders given by --include-path, task YAML paths, and the bundled tasks (bundled:kjv_cloze,
bundled:kjv_next, bundled:kjv_lastword, bundled:kjv_perplexity, bundled:kjv_complete). Nothing is downloaded.

Layouts: --nproc-per-node N alone gives N data-parallel processes, each with the whole model; add
--set parallel.KEY=VALUE (tp, pp, cp, ep, dp_shard, ...) to hold the model as a training run of that layout does.
Scores and generations equal one process's."""

DEFAULT_SEED = 1234  # lm-eval's default seed (meshformer/eval/lm.py DEFAULT_SEED: this module loads without torch)
FETCH_FIX = ("on a machine with internet run: python -c \"from lm_eval.tasks import get_task_dict; "
             "get_task_dict(['{task}'])\" and copy its ~/.cache/huggingface/datasets here (or set HF_DATASETS_CACHE)")


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="score lm-eval tasks (offline) with a run's weights or a folder",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a run folder (its final/), a weights folder or a Hugging Face folder")
    parser.add_argument("--tasks", required=True, help="comma-separated task or group names, YAML paths, bundled:NAME")
    parser.add_argument("--include-path", action="append", default=[], metavar="DIR",
                        help="a folder of lm-eval task YAMLs (repeatable)")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples per request (default: each task's own)")
    parser.add_argument("--limit", type=float, help="documents per task (a fraction below 1)")
    parser.add_argument("--batch-size", type=int, default=16, help="requests per forward pass (default: 16)")
    parser.add_argument("--output-path", help="write lm-eval's results JSON here")
    parser.add_argument("--log-samples", action="store_true", help="keep every request and response in the JSON")
    parser.add_argument("--bootstrap-iters", type=int, default=1000,
                        help="resamples for standard errors without a closed form (perplexities); 0: none "
                        "(default: 1000)")
    parser.add_argument("--trust-task-code", action="store_true",
                        help="run task code as lm-eval would: unsandboxed templates, !function (downstream."
                        "trust_task_code)")
    parser.add_argument("--follow-links", action="store_true", help="read data_files that links take elsewhere")
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="processes (torchrun): data-parallel ones sharing the requests with a whole model "
                        "each, or the ranks of the --set layout (default: 1)")
    parser.add_argument("--set", action="append", default=[], metavar="parallel.KEY=VALUE", dest="overrides",
                        help="the layout the ranks hold the model in, as a run's config sets it (repeatable), e.g. "
                        "--set parallel.tp=2; also train.device")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help="seed of sampled generation (do_sample tasks): each request draws from its own "
                        f"generator seeded from it and the request, so any layout samples the same tokens "
                        f"(default: {DEFAULT_SEED}, lm-eval's)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UsageError("meshformer eval runs lm-evaluation-harness, which is not installed",
                         'pip install "meshformer[eval]"') from None
    specs = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not specs:
        raise UsageError("--tasks names no task", "e.g. --tasks bundled:kjv_cloze,hellaswag")
    if args.nproc_per_node < 1 or args.batch_size < 1:
        raise UsageError(f"--nproc-per-node={args.nproc_per_node}, --batch-size={args.batch_size}",
                         "give positive numbers")
    for folder in args.include_path:
        if not Path(folder).is_dir():
            raise UsageError(f"--include-path {folder} is not a folder", "give a folder of lm-eval task YAMLs")
    for item in args.overrides:
        if not item.startswith(LAYOUT_KEYS) or "=" not in item:
            raise UsageError(f"--set {item}: meshformer eval takes the layout's keys only",
                             "give parallel.KEY=VALUE (tp, pp, cp, ep, dp_shard, ...) or train.device=DEVICE")
    if args.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        sys.exit(_launch(args.nproc_per_node))
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing downloads: a missing dataset is named instead
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from meshformer.config.sections import DownstreamConfig  # torch: only once the command runs

    options = DownstreamConfig(trust_task_code=args.trust_task_code, follow_links=args.follow_links)
    from meshformer.eval.lm import MeshformerLM
    from meshformer.eval.run import evaluate, is_task_file

    check_datasets([s for s in specs if not is_task_file(s)], args.include_path)
    if args.overrides:
        lm = _layout_lm(args)
    else:
        _init_data_parallel()
        lm = MeshformerLM(path=args.folder, batch_size=args.batch_size, seed=args.seed)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    try:
        results = evaluate(lm, specs, include_path=args.include_path, num_fewshot=args.num_fewshot, limit=limit,
                           options=options, log_samples=args.log_samples, bootstrap_iters=args.bootstrap_iters)
    finally:
        if args.overrides:
            from meshformer.runtime.distributed import shutdown_distributed

            shutdown_distributed()
    if results is None or int(os.environ.get("RANK", "0")) != 0:  # rank 0 reports
        return
    from lm_eval.utils import make_table

    print(make_table(results))
    if args.output_path:
        out = Path(args.output_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2, default=_jsonable, ensure_ascii=False) + "\n")
        print(f"wrote {out}")


def check_datasets(names: list[str], include_path: list[str]) -> None:
    """Each registry task's documents are in the local datasets cache: else one line naming the first task that
    lacks them and how to fetch them, before any model is loaded."""
    if not names:
        return
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = TaskManager(include_path=include_path or None)
    for name in names:
        if not manager.match_tasks([name]):
            raise ConfigError(f"no lm-eval task or group named {name!r}",
                              "check the name (lm-eval --tasks list), or pass its folder with --include-path")
        try:
            get_task_dict([name], manager)
        except Exception as err:  # datasets' offline misses come as several exception types
            raise ConfigError(f"task {name}: its dataset is not in the local datasets cache "
                              f"({type(err).__name__})", FETCH_FIX.format(task=name)) from None


def _launch(nproc: int) -> int:
    """This command again under torchrun, one process per data-parallel rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "meshformer", *sys.argv[1:]]
    print("launching: " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd)


def _layout_lm(args: argparse.Namespace) -> Any:
    """MeshformerLM over the folder's model held as the --set layout holds it on this rank: its tensors read into
    this rank's shards, log-likelihoods and decoding steps through the layout's evaluation forward."""
    import dataclasses

    import torch

    from meshformer.checkpointing.weights import load_into
    from meshformer.config import load_config
    from meshformer.config.validate import validate
    from meshformer.eval.layout_forward import LayoutNextLogits, LayoutScorer
    from meshformer.eval.lm import MeshformerLM
    from meshformer.eval.model_folder import open_model_folder
    from meshformer.loss.token_loss import LossSpec
    from meshformer.model import Transformer
    from meshformer.parallel.parallelize import parallelize
    from meshformer.parallel_dims import validate_parallel
    from meshformer.runtime.distributed import env_rank, init_distributed, job_device

    opened = open_model_folder(args.folder)
    base = load_config(None, args.overrides)
    cfg = dataclasses.replace(base, model=opened.cfg,
                              data=dataclasses.replace(base.data, seq_len=opened.cfg.max_seq_len))
    validate(cfg)
    _, local_rank, world = env_rank()
    device = job_device(cfg, local_rank)
    # one process: the layout is checked here and no process group is needed
    dims = init_distributed(cfg) if world > 1 else validate_parallel(cfg, 1, device)
    with torch.device("meta"):  # each rank allocates its shards only; the folder's tensors replace the init
        model = Transformer(opened.cfg, init_seed=0)
    # the layout's objective is replaced while scoring (per-row losses, next-token logits); plain is its base
    parallel_model = parallelize(model, cfg, device, LossSpec("plain"), dims)
    load_into(parallel_model.model_parts, opened.tensors)
    pad_id = opened.tokenizer.pad_id
    return MeshformerLM(tokenizer=opened.tokenizer, batch_size=args.batch_size, max_length=cfg.data.seq_len,
                        scorer=LayoutScorer(parallel_model, cfg, args.batch_size, pad_id, lambda: None),
                        next_logits=LayoutNextLogits(parallel_model, cfg, args.batch_size, pad_id), seed=args.seed)


def _init_data_parallel() -> None:
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")


def _jsonable(value: Any) -> Any:
    return str(value)
