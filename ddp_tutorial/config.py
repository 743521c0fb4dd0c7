"""train.py's flags and their checks, without torch: ``launch`` checks a run's flags in the kernel
before any process starts (``launch_settings``)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import List, Sequence

from ddp_tutorial import checkpoint, envvars, mistakes
from ddp_tutorial.backend import BACKENDS
from ddp_tutorial.runfolder import rank_run_dir

#: The training script, as a file path (``launch(TRAIN_SCRIPT, 4, [...])``) and as a module.
TRAIN_SCRIPT = str(Path(__file__).resolve().with_name("train.py"))
TRAIN_MODULE = "ddp_tutorial.train"


class ConfigError(ValueError):
    """A flag value that cannot work, found before any process starts."""


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m ddp_tutorial.train``."""
    p = argparse.ArgumentParser(prog="python -m ddp_tutorial.train", description="Train a small "
                                "MLP on a seeded teacher task with DistributedDataParallel.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_training_flags(p)
    return p


def add_training_flags(p: argparse.ArgumentParser) -> None:
    """Add the training flags to ``p`` (train.py's and ``python -m ddp_tutorial``'s)."""
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=2, help="passes over the dataset")
    g.add_argument("--batch-size", type=int, default=16, help="micro-batch size per rank")
    g.add_argument("--accum-steps", type=int, default=2,
                   help="micro-batches accumulated per optimizer step, K")
    g.add_argument("--dataset-size", type=int, default=2048, help="samples in the dataset")
    g.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    g.add_argument("--seed", type=int, default=0, help="seed shared by all ranks")
    g.add_argument("--straggler-ms", type=float, default=0.0,
                   help="each rank sleeps a random 0..N ms per micro-step; 0 turns it off")
    g.add_argument("--bucket-cap-mb", type=float, default=None, metavar="MIB",
                   help="DDP gradient bucket size in MiB; None: DDP's own 25, the first bucket "
                        "capped at 1 (an explicit 25 caps that one at 25 too)")
    g.add_argument("--backend", choices=BACKENDS, default=os.environ.get(envvars.BACKEND, "auto"),
                   help="process-group backend; auto: nccl when every rank on a node has a GPU of "
                        "its own, gloo otherwise (rank 0 prints which and why)")
    g.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank on CPU; 0 keeps torch's default (OMP_NUM_THREADS "
                        "if set, else one per core: N ranks x all cores oversubscribe)")
    g.add_argument("--pg-timeout", type=float, default=300.0,
                   help="seconds a collective may wait before the process group gives up")
    g.add_argument("--out", default=rank_run_dir("runs/train"),
                   help="folder for rank<R>.jsonl metrics and rank 0's model.pt")
    g.add_argument("--no-metrics", action="store_true",
                   help="skip the per-step timing hook and metric files (for overhead checks)")
    g.add_argument("--bug", action="append", default=[], choices=sorted(mistakes.BUGS) + ["all"],
                   help="reproduce a mistake of the original demo (repeatable, or 'all')")
    c = p.add_argument_group("checkpoint and resume")
    c.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="resume from PATH if it exists; save there (atomically, by rank 0) at "
                        "the end of each epoch and every --save-every optimizer steps")
    c.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="also save every N optimizer steps, i.e. at the end of an accumulation "
                        "window; 0 saves at epoch ends only")
    f = p.add_argument_group("fault injection")
    f.add_argument("--fail-at-step", type=int, default=None,
                   help="micro-step at which --fail-rank fails (None: never), on the group's "
                        "first attempt only, so a restart gets past it")
    f.add_argument("--fail-rank", type=int, default=0, help="rank that fails")
    f.add_argument("--fail-mode", choices=["raise", "exit", "hang"], default="raise",
                   help="raise an exception, exit(3), or sleep forever")


#: Each number flag's range: (low, high, low excluded); larger values only ever come from a typo.
RANGES = {"--epochs": (1, math.inf, False), "--batch-size": (1, math.inf, False),
          "--accum-steps": (1, math.inf, False), "--lr": (0, math.inf, True),
          "--momentum": (0, 0.999, False), "--seed": (0, 2 ** 32 - 1, False),
          "--straggler-ms": (0, 60_000, False), "--bucket-cap-mb": (0, math.inf, True),
          "--threads": (0, 1024, False), "--pg-timeout": (0, 7 * 24 * 3600, True),
          "--save-every": (0, math.inf, False), "--fail-at-step": (0, math.inf, False)}


def _check_range(flag: str, value, low, high, low_open: bool) -> None:
    """ConfigError for NaN, infinities and values outside ``low``..``high``."""
    if math.isfinite(value) and (value > low if low_open else value >= low) and value <= high:
        return
    bounds = f"> {low}" if low_open else (f">= {low}" if high < math.inf else f"at least {low}")
    if high < math.inf:
        bounds += f" and <= {high}"
    kind = "a finite number " if isinstance(value, float) else ""
    raise ConfigError(f"{flag} must be {kind}{bounds}, got {value}")


def _path(flag: str, path: str, folder: bool) -> Path:
    """Refuse an empty path, one of the wrong kind (file/folder), or one that cannot be made."""
    if not path.strip() or "\0" in path:
        raise ConfigError(f"{flag} must be a non-empty path, got {path!r}")
    p = Path(path)  # as train.py will use it (no ~ expansion)
    if folder and p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path!r} is a file: give a folder")
    if not folder and p.is_dir():
        raise ConfigError(f"{flag} {path!r} is a folder: give a file path")
    parent = next(a for a in p.absolute().parents if a.exists())
    if not p.exists() and not parent.is_dir():
        raise ConfigError(f"{flag} {path!r} cannot be made: {str(parent)!r} is a file")
    return p


def validate(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """ConfigError for flag values that cannot give a sensible run of ``world_size`` ranks: ranges
    (NaN and infinities included), paths, an existing ``--checkpoint`` of other settings."""
    for flag, (low, high, low_open) in RANGES.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:  # --bucket-cap-mb and --fail-at-step: None is their default
            _check_range(flag, value, low, high, low_open)
    if args.dataset_size < world_size * args.batch_size:
        raise ConfigError(
            f"--dataset-size {args.dataset_size} is smaller than world_size x batch size "
            f"= {world_size} x {args.batch_size} = {world_size * args.batch_size}: "
            "some rank would get no full batch")
    _path("--out", args.out, folder=True)
    if args.save_every and not args.checkpoint:
        raise ConfigError("--save-every needs --checkpoint PATH: where should the checkpoint go?")
    if args.checkpoint is not None and _path("--checkpoint", args.checkpoint, False).exists():
        try:
            checkpoint.check_settings(args.checkpoint, checkpoint.settings_of(args, world_size))
        except checkpoint.CheckpointError as exc:
            raise ConfigError(f"--checkpoint: {exc}") from None
    if not 0 <= args.fail_rank < world_size:
        raise ConfigError(f"--fail-rank {args.fail_rank} is not a rank of a world of {world_size}")
    args.bug = sorted(mistakes.BUGS) if "all" in args.bug else args.bug
    return args


def parse(argv: Sequence[str], world_size: int) -> argparse.Namespace:
    """Parsed and validated training flags; ConfigError instead of exiting."""
    parser = build_parser()

    def refuse(message: str):  # argparse's message names the flag: keep it
        raise ConfigError(f"bad training flags {list(argv)!r}: {message} (see --help)")

    parser.error = refuse
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # --help, --version: they exit too
        raise ConfigError(f"bad training flags {list(argv)!r} (see --help)") from exc
    return validate(args, world_size)


def launch_settings(args: List[str], world_size: int, backend: str, run_dir):
    """``launch``'s check of train.py's flags; returns (backend, run_dir, run_dir_name). A given
    ``--backend`` or ``--out`` is the launch's, and must agree with ``backend=`` or ``run_dir=``."""
    parsed = parse(args, world_size)
    without_defaults = build_parser()  # what args sets, read as train.py reads it (--ou=DIR too)
    for action in without_defaults._actions:
        action.default = argparse.SUPPRESS
    given = vars(without_defaults.parse_known_args(list(args))[0])
    if "backend" in given:
        if backend != "auto" and backend != parsed.backend:
            raise ConfigError(f"backend={backend!r} and --backend {parsed.backend} disagree: "
                              "give one")
        backend = parsed.backend
    if "out" not in given:
        return backend, run_dir, "run_dir"
    if run_dir is not None and Path(run_dir).resolve() != Path(parsed.out).resolve():
        raise ConfigError(f"run_dir={str(run_dir)!r} and --out {parsed.out!r} name different "
                          "folders: train.py writes to --out; give one")
    return backend, parsed.out, "run_dir" if run_dir is not None else "--out"
