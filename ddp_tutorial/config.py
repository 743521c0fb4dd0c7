"""Command-line flags of the training script, and their checks.

This module imports no torch, so the launcher can check a run's flags in the
notebook kernel (cheaply) before it starts any worker process.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from ddp_tutorial.backend import BACKENDS


@dataclass(frozen=True)
class Mistake:
    """One mistake of the original demo: what goes wrong, the fix, and where it is measured.

    Attributes:
        name: the ``--bug NAME`` that reproduces it (or, for a mistake in how the
            original launches, a name for the table).
        what: what goes wrong.
        fix: what the kit does instead.
        notebooks: the notebooks that measure it, e.g. "04" or "01, 05".
        function: the train.py function whose original version (``ddp_tutorial.original``)
            ``--bug NAME`` runs; None for a mistake the launcher fixes, not train.py.
    """

    name: str
    what: str
    fix: str
    notebooks: str
    function: Optional[str] = None


#: Every mistake of the original demo, in the order its code makes them. The
#: ``--bug`` choices, notebook 00's table and the README's table come from this list.
MISTAKES = (
    Mistake("hard-coded-port", "MASTER_PORT=12345 for every run, so two jobs at once collide",
            "a free port per launch", "01, 05"),
    Mistake("default-threads", "8 processes with torch's default thread count each, on a small machine",
            "one torch thread per rank", "01"),
    Mistake("per-rank-data", "every rank draws its own random data",
            "one dataset from a seed all ranks share; the sampler splits it", "03", "make_inputs"),
    Mistake("no-set-epoch", "sampler.set_epoch(epoch) is never called, so every epoch repeats one order",
            "start_epoch calls it at the start of every epoch", "03", "start_epoch"),
    Mistake("random-labels", "fresh random labels every step, so there is nothing to learn",
            "targets from a fixed, seeded teacher network", "00, 04", "loss_fn"),
    Mistake("sync-schedule", "sync and step on step % K == 0, so the first update follows one micro-batch",
            "sync on the last micro-batch of each window of K; a shorter last window still steps",
            "04", "sync_schedule"),
    Mistake("forward-outside-no-sync", "forward() runs outside no_sync(), so no_sync() skips nothing",
            "forward and backward both inside no_sync()", "04", "micro_step"),
    Mistake("loss-not-scaled", "the loss is not divided by K, so the accumulated gradient is K times "
            "too large", "each loss divided by its window's size: one K times larger batch, exactly",
            "04", "loss_divisors"),
)

#: ``--bug NAME`` -> what goes wrong: the mistakes train.py can reproduce.
BUGS = {m.name: m.what for m in MISTAKES if m.function}


class ConfigError(ValueError):
    """A flag value that cannot work, found before any process starts."""


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m ddp_tutorial.train`` (shared by the CLI)."""
    p = argparse.ArgumentParser(
        prog="python -m ddp_tutorial.train",
        description="Train a small MLP on a seeded teacher task with DistributedDataParallel.",
    )
    add_training_flags(p)
    return p


def add_training_flags(p: argparse.ArgumentParser) -> None:
    """Add the training flags to ``p`` (used by train.py and by ``python -m ddp_tutorial``)."""
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=2, help="passes over the dataset (default: 2)")
    g.add_argument("--batch-size", type=int, default=16, help="micro-batch size per rank (default: 16)")
    g.add_argument("--accum-steps", type=int, default=2,
                   help="micro-batches accumulated per optimizer step, K (default: 2)")
    g.add_argument("--dataset-size", type=int, default=2048, help="samples in the dataset (default: 2048)")
    g.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: 0.05)")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    g.add_argument("--seed", type=int, default=0, help="seed shared by all ranks (default: 0)")
    g.add_argument("--straggler-ms", type=float, default=0.0,
                   help="each rank sleeps a random 0..N ms per micro-step; 0 turns it off (default: 0)")
    g.add_argument("--bucket-cap-mb", type=float, default=None, metavar="MIB",
                   help="DDP gradient bucket size in MiB (default: DDP's own, 25 MiB with the first "
                        "bucket capped at 1 MiB; an explicit 25 caps the first bucket at 25 MiB too)")
    g.add_argument("--backend", choices=BACKENDS, default=os.environ.get("DDP_TUTORIAL_BACKEND", "auto"),
                   help="process-group backend; auto: nccl when every rank on a node has a GPU of "
                        "its own, gloo otherwise (rank 0 prints which and why)")
    g.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank on CPU; 0 keeps torch's default (OMP_NUM_THREADS "
                        "if set, as launch and torchrun do, else one per core: N ranks x all "
                        "cores oversubscribe a small machine) (default: 1)")
    g.add_argument("--pg-timeout", type=float, default=300.0,
                   help="seconds a collective may wait before the process group gives up (default: 300)")
    g.add_argument("--out", default=os.environ.get("DDP_TUTORIAL_RUN_DIR", "runs/train"),
                   help="folder for rank<R>.jsonl metrics and rank 0's model.pt")
    g.add_argument("--no-metrics", action="store_true",
                   help="skip the per-step timing hook and metric files (for overhead checks)")
    g.add_argument("--bug", action="append", default=[], choices=sorted(BUGS) + ["all"],
                   help="reproduce a mistake of the original demo (repeatable; 'all' = every one)")
    c = p.add_argument_group("checkpoint and resume")
    c.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="resume from PATH if it exists; save there (atomically, by rank 0) at "
                        "the end of each epoch and every --save-every optimizer steps")
    c.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="also save every N optimizer steps, i.e. at the end of an accumulation "
                        "window; 0 saves at epoch ends only (default: 0)")
    f = p.add_argument_group("fault injection")
    f.add_argument("--fail-at-step", type=int, default=None,
                   help="micro-step at which --fail-rank fails, on the first attempt only "
                        "(TORCHELASTIC_RESTART_COUNT 0), so a restart can get past it (default: never)")
    f.add_argument("--fail-rank", type=int, default=0, help="rank that fails (default: 0)")
    f.add_argument("--fail-mode", choices=["raise", "exit", "hang"], default="raise",
                   help="raise an exception, exit(3), or sleep forever (default: raise)")


def validate(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Raise ConfigError for flag values that cannot give a sensible run.

    Args:
        args: parsed flags.
        world_size: number of ranks the run will have.
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be at least 1, got {world_size}")
    if args.epochs < 1:
        raise ConfigError(f"--epochs must be at least 1, got {args.epochs}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.accum_steps < 1:
        raise ConfigError(f"--accum-steps must be at least 1, got {args.accum_steps}")
    if args.dataset_size < world_size * args.batch_size:
        raise ConfigError(
            f"--dataset-size {args.dataset_size} is smaller than world_size x batch size "
            f"= {world_size} x {args.batch_size} = {world_size * args.batch_size}: "
            "some rank would get no full batch")
    if args.lr <= 0:
        raise ConfigError(f"--lr must be positive, got {args.lr}")
    if args.straggler_ms < 0:
        raise ConfigError(f"--straggler-ms must be 0 or more, got {args.straggler_ms}")
    if args.bucket_cap_mb is not None and args.bucket_cap_mb <= 0:  # None: DDP's own default
        raise ConfigError(f"--bucket-cap-mb must be positive, got {args.bucket_cap_mb}")
    if args.threads < 0:
        raise ConfigError(f"--threads must be 0 or more, got {args.threads}")
    if args.save_every < 0:
        raise ConfigError(f"--save-every must be 0 or more, got {args.save_every}")
    if args.save_every and not args.checkpoint:
        raise ConfigError("--save-every needs --checkpoint PATH: where should the checkpoint go?")
    if args.fail_at_step is not None and not 0 <= args.fail_rank < world_size:
        raise ConfigError(f"--fail-rank {args.fail_rank} is not a rank of a world of {world_size}")
    if "all" in args.bug:
        args.bug = sorted(BUGS)
    return args


def parse(argv: Sequence[str], world_size: int) -> argparse.Namespace:
    """Parse and validate training flags; raise ConfigError instead of exiting."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # argparse exits on unknown flags or bad types
        raise ConfigError(f"bad training flags {list(argv)!r} (see --help)") from exc
    return validate(args, world_size)
