"""Cluster commands of `meshformer`: submit (SLURM), tensorboard, plot, diagnose (hangs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _submit(args: argparse.Namespace) -> None:
    from meshformer.launcher.slurm import SlurmJob, check_job, submit, warnings_for

    job = SlurmJob(args.config, args.set, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                   nproc_per_node=args.nproc_per_node, partition=args.partition, time=args.time,
                   account=args.account, qos=args.qos, cpus_per_task=args.cpus_per_task, mem=args.mem,
                   job_name=args.job_name, setup=args.setup, sbatch_args=args.sbatch_arg,
                   max_restarts=args.max_restarts, signal_before_s=args.signal_before,
                   replica_groups=args.replica_groups)
    check_job(job)  # a refusal comes before the warnings
    for warning in warnings_for(job):
        print(f"warning: {warning}", file=sys.stderr)
    script, job_id = submit(job, dry_run=args.dry_run)
    if args.dry_run:
        print(script, end="")
    else:
        print(job_id)


def _tensorboard(args: argparse.Namespace) -> None:
    from meshformer.launcher.tensorboard import serve

    serve(Path(args.run_dir), args.port)


def _plot(args: argparse.Namespace) -> None:
    from meshformer.launcher.plot import plot_run

    for path in plot_run(Path(args.run_dir), Path(args.out) if args.out else None):
        print(f"wrote {path}")


def _diagnose(args: argparse.Namespace) -> None:
    from meshformer.launcher.tensorboard import MonitorError, existing_run_dir
    from meshformer.launcher.torchrun import MAX_WORLD_SIZE, check_world_size
    from meshformer.runtime.watchdog import explain, read_reports

    if args.world_size is not None:
        check_world_size(args.world_size, "--world-size")
    folder = existing_run_dir(Path(args.run_dir)) / "diagnostics"  # a mistyped run folder is not "no hang"
    reports = read_reports(folder, strict=True)
    if not reports:
        raise MonitorError(f"no hang reports in {folder}: no rank stalled for more than half of parallel.timeout_s",
                           "nothing to diagnose (reports are removed when a rank makes progress again); check the "
                           "run folder if a job did hang")
    world = args.world_size or max(r["world_size"] for r in reports.values())
    if not 1 <= world <= MAX_WORLD_SIZE:  # explain() lists every rank without a report
        raise MonitorError(f"the hang reports in {folder} give world_size={world}", "pass the job's --world-size")
    print(explain(reports, world, folder))


def add_cli(sub: argparse._SubParsersAction) -> None:
    submit = sub.add_parser("submit", help="write an sbatch script (torchrun on every node, requeue on "
                            "preemption, auto-resume) and submit it to SLURM")
    submit.add_argument("config", help="bundled config name or TOML file")
    submit.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides for the job")
    submit.add_argument("--nodes", type=int, default=1, help="nodes to ask SLURM for")
    submit.add_argument("--gpus-per-node", type=int, default=0, help="0: a CPU job")
    submit.add_argument("--nproc-per-node", type=int, help="ranks per node (default: --gpus-per-node, or 1)")
    submit.add_argument("--partition", help="SLURM partition (default: the cluster's)")
    submit.add_argument("--time", help="time limit, e.g. 04:00:00")
    submit.add_argument("--account", help="SLURM account to charge")
    submit.add_argument("--qos", help="SLURM quality of service")
    submit.add_argument("--cpus-per-task", type=int, help="CPUs per node for its torchrun and ranks")
    submit.add_argument("--mem", help="memory per node, e.g. 200G")
    submit.add_argument("--job-name", help="default: the run folder's name")
    submit.add_argument("--setup", action="append", default=[], metavar="SHELL_LINE",
                        help="run before torchrun on each node, e.g. 'source venv/bin/activate' (repeatable)")
    submit.add_argument("--sbatch-arg", action="append", default=[], metavar="OPTION",
                        help="extra sbatch option, e.g. --sbatch-arg=--exclusive (repeatable)")
    submit.add_argument("--max-restarts", type=int, default=3,
                        help="torchrun restarts of failed workers (with --replica-groups: restarts of each group)")
    submit.add_argument("--signal-before", type=int, default=120, metavar="SECONDS",
                        help="checkpoint and requeue this long before the time limit")
    submit.add_argument("--replica-groups", type=int, default=0, metavar="N",
                        help="fault tolerance: N replica groups of --nodes/N nodes, a Lighthouse on the first node, "
                             "and a failed group restarted (up to --max-restarts times) while the others train on "
                             "(docs/fault-tolerance.md)")
    submit.add_argument("--dry-run", action="store_true", help="print the script; submit nothing")
    submit.set_defaults(func=_submit)

    board = sub.add_parser("tensorboard", help="serve a run's TensorBoard events on 127.0.0.1")
    board.add_argument("run_dir", help="a run folder (logging.run_dir)")
    board.add_argument("--port", type=int, default=6006, help="0: any free port")
    board.set_defaults(func=_tensorboard)

    plot = sub.add_parser("plot", help="loss and throughput curves of a run as PNG files")
    plot.add_argument("run_dir", help="a run folder (logging.run_dir)")
    plot.add_argument("--out", help="folder for the PNG files (default: RUN_DIR/plots)")
    plot.set_defaults(func=_plot)

    diagnose = sub.add_parser("diagnose", help="what each rank was doing in a hang, and the slowest rank")
    diagnose.add_argument("run_dir", help="a run folder (logging.run_dir)")
    diagnose.add_argument("--world-size", type=int, help="default: from the reports")
    diagnose.set_defaults(func=_diagnose)
