"""Run the whole demo: ``python -m ddp_tutorial`` trains with 4 CPU ranks and saves two figures.

    python -m ddp_tutorial --world-size 2 --accum-steps 4 --bug forward-outside-no-sync
    python -m ddp_tutorial --help               # every flag

The run folder holds ``rank<R>.jsonl``, ``model.pt``, ``sync_timeline.png`` and ``loss_curves.png``.
"""

from __future__ import annotations

import argparse
import sys

from ddp_tutorial import config
from ddp_tutorial.config import TRAIN_SCRIPT
from ddp_tutorial.launcher import LaunchError, launch


#: A few seconds of training, and a small delay so the sync timeline shows waiting.
DEMO_DEFAULTS = {"straggler_ms": 3.0, "epochs": 5, "dataset_size": 4096}


def add_launch_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("launch")
    g.add_argument("--world-size", type=int, default=4, help="number of ranks (processes)")
    g.add_argument("--timeout", type=float, default=120.0,
                   help="seconds before a run that has not finished counts as a hang")
    g.add_argument("--run-dir", default=None, help="results folder; None: a new one under ./runs")
    g.add_argument("--echo", choices=["all", "rank0", "none"], default="all",
                   help="which ranks' output to show live")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = add_launch_flags(argparse.ArgumentParser(
        prog="python -m ddp_tutorial",
        description="Train a small model with DDP on local worker processes, then plot per-rank "
                    "sync timing and loss curves.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    config.add_training_flags(p)
    # --out is the run folder here: --run-dir covers it (--out still works, as its alias).
    p.set_defaults(**DEMO_DEFAULTS)
    next(a for a in p._actions if a.dest == "out").help = argparse.SUPPRESS
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # every flag checked here, and --help
    # train.py gets the training flags as given, after the demo's defaults (launch checks a --out
    # there against --run-dir).
    launch_only = add_launch_flags(argparse.ArgumentParser(add_help=False))
    train_args = [f"--{k.replace('_', '-')}={v}" for k, v in DEMO_DEFAULTS.items()]
    train_args += launch_only.parse_known_args(argv)[1]
    try:
        run = launch(TRAIN_SCRIPT, args.world_size, train_args, timeout=args.timeout,
                     run_dir=args.run_dir, echo=args.echo)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.no_metrics:  # nothing was measured, so there is nothing to draw
        print(f"finished in {run.wall_seconds:.1f} s; --no-metrics: no metrics or figures, "
              f"the model is in {run.run_dir}")
        return 0

    import matplotlib

    matplotlib.use("Agg")  # files only: this may run without a display
    from ddp_tutorial import plots

    figures = {"sync_timeline.png": plots.plot_sync_timeline(run, first_step=args.accum_steps,
                                                            num_steps=3 * args.accum_steps),
               "loss_curves.png": plots.plot_loss_curves(run)}
    print(run.describe())
    for name, ax in figures.items():
        path = run.run_dir / name
        ax.figure.savefig(path, dpi=110)
        print(f"saved {path}")
    print(f"finished in {run.wall_seconds:.1f} s; results in {run.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
