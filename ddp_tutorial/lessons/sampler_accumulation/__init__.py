"""Notebooks 03 and 04 (DistributedSampler, no_sync accumulation): launch the lesson scripts and
turn each ``Run`` into the numbers a notebook prints and asserts. No torch is imported here."""

from __future__ import annotations

import json
import math
import statistics
from typing import Dict, List, Optional, Sequence

from ddp_tutorial import TRAIN_SCRIPT, config
from ddp_tutorial.launcher import launch
from ddp_tutorial.lessons import ORIGINAL_SCRIPT, mistake_diff, script_function  # noqa: F401
from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.lessons.worker_scripts import worker_script
from ddp_tutorial.runfolder import Run

SAMPLER_SCRIPT = worker_script(__file__, "sampler_demo.py")


# -- Lesson 03: DistributedSampler ----------------------------------------------
def run_sampler_demo(world_size: int = 4, dataset_size: int = 24, epochs: int = 3,
                     padding_size: int = 10, echo: str = "rank0", timeout: float = 60.0) -> Run:
    """Launch ``sampler_demo.py``: each rank's orders, padding and data fingerprints."""
    args = ["--dataset-size", dataset_size, "--epochs", epochs, "--padding-size", padding_size]
    return launch(SAMPLER_SCRIPT, world_size, args, echo=echo, timeout=timeout)


def sampler_orders(run: Run, set_epoch: bool = True) -> List[Dict[int, List[int]]]:
    """Per epoch, rank -> the sample indices its sampler yielded, in order."""
    key = "orders_set_epoch" if set_epoch else "orders_no_set_epoch"
    return [dict(zip(run.ranks, epoch)) for epoch in zip(*(run.result(r, key) for r in run.ranks))]


def orders_repeat(orders: Sequence[Dict[int, List[int]]]) -> bool:
    """True if every epoch hands every rank exactly the order of epoch 0."""
    return all(epoch == orders[0] for epoch in orders[1:])


def shards_partition(orders: Sequence[Dict[int, List[int]]], dataset_size: int) -> List[bool]:
    """Per epoch: are the ranks' index sets disjoint, and together the whole dataset?"""
    every = [[i for indices in epoch.values() for i in indices] for epoch in orders]
    return [sorted(indices) == list(range(dataset_size)) for indices in every]


def print_orders(orders: Sequence[Dict[int, List[int]]], title: str) -> None:
    """One line per (epoch, rank): the indices in the order the rank sees them."""
    print(title)
    for epoch, per_rank in enumerate(orders):
        for rank, indices in per_rank.items():
            print(f"  epoch {epoch} rank {rank}: {indices}")


def padding_report(run: Run) -> Dict[str, object]:
    """A dataset the world size does not divide: per rank, its indices with ``drop_last`` False
    (``kept``) and True; samples ``duplicated`` and ``dropped``, measured and predicted."""
    pads = {rank: run.result(rank, "padding") for rank in run.ranks}
    size, world_size = pads[run.ranks[0]]["dataset_size"], len(run.ranks)
    kept = {rank: p["drop_last_false"] for rank, p in pads.items()}
    trimmed = {rank: p["drop_last_true"] for rank, p in pads.items()}
    kept_all = [i for indices in kept.values() for i in indices]
    trimmed_all = [i for indices in trimmed.values() for i in indices]
    return {
        "dataset_size": size, "world_size": world_size,
        "kept": kept, "drop_last": trimmed,
        "duplicated": len(kept_all) - len(set(kept_all)),
        "missing_with_padding": size - len(set(kept_all)),
        "dropped": size - len(set(trimmed_all)),
        "duplicated_in_drop_last": len(trimmed_all) - len(set(trimmed_all)),
        # DistributedSampler: ceil(N / W) per rank, padded with repeats; floor(N / W) with drop_last
        "expected_duplicated": math.ceil(size / world_size) * world_size - size,
        "expected_dropped": size - (size // world_size) * world_size,
    }


def print_padding(report: Dict[str, object]) -> None:
    """The padding example as a small table, one row per rank."""
    size, world_size = report["dataset_size"], report["world_size"]
    print(text_table(["rank", "drop_last=False", "drop_last=True"],
                     [(rank, kept, report["drop_last"][rank])
                      for rank, kept in report["kept"].items()],
                     f"{size} samples over {world_size} ranks"))
    print(f"drop_last=False: every rank gets ceil({size}/{world_size}) = "
          f"{math.ceil(size / world_size)}; {report['duplicated']} sample(s) appear twice "
          "this epoch")
    print(f"drop_last=True:  every rank gets floor({size}/{world_size}) = {size // world_size}; "
          f"{report['dropped']} sample(s) are never seen this epoch")


def dataset_fingerprints(run: Run, per_rank_bug: bool) -> Dict[int, Dict[str, object]]:
    """rank -> digest, first input row and input sum of the dataset that rank built."""
    key = "data_per_rank" if per_rank_bug else "data_shared"
    return {rank: run.result(rank, key) for rank in run.ranks}


def print_fingerprints(run: Run) -> None:
    """Side by side: the dataset each rank builds with one shared seed, and with per-rank data."""
    for per_rank_bug, label in ((False, "shared seed (train.make_dataset)"),
                                (True, "per-rank random data (the original demo)")):
        print(text_table(["rank", "digest", "sum of inputs", "sample 0 starts"],
                         [(rank, fp["digest"], f"{fp['input_sum']:.4f}", fp["first_row"])
                          for rank, fp in dataset_fingerprints(run, per_rank_bug).items()], label))


def distinct_datasets(run: Run, per_rank_bug: bool) -> int:
    """How many different datasets the ranks built (1 means they share one)."""
    return len({fp["digest"] for fp in dataset_fingerprints(run, per_rank_bug).values()})


# -- Lesson 04: no_sync and gradient accumulation -------------------------------
def train_args(accum_steps: int, *extra, batch_size: int = 4, dataset_size: int = 256,
               straggler_ms: float = 0.0, epochs: int = 1) -> List[str]:
    """Flags for ``train.py``: a tiny run of ``epochs`` over ``dataset_size`` samples."""
    args = ["--epochs", epochs, "--dataset-size", dataset_size, "--batch-size", batch_size,
            "--accum-steps", accum_steps, "--straggler-ms", straggler_ms, *extra]
    return [str(a) for a in args]


TRAIN_RUNS_SCRIPT = worker_script(__file__, "train_runs.py")


def train_runs(world_size: int, runs: Dict[str, Sequence[str]], one_process: Sequence[str] = (),
               schedule_demo: bool = False, echo: str = "rank0",
               timeout: float = 300.0) -> Dict[str, Run]:
    """Several runs of ``train.py`` (name -> flags) in one launch of ``train_runs.py``, each on
    ``world_size`` ranks or, in ``one_process``, one: name -> its ``Run``. Starting ranks costs
    more than these tiny runs. ``schedule_demo``: run it too, for ``schedules``."""
    spec = {name: [1 if name in one_process else world_size, [str(a) for a in flags]]
            for name, flags in runs.items()}
    args = [json.dumps(spec), *["--schedule-demo"] * schedule_demo]
    launched = launch(TRAIN_RUNS_SCRIPT, world_size, args, echo=echo, timeout=timeout)
    return {rec["run"]: Run(launched.run_dir / rec["folder"])
            for rec in launched.results(0) if "run" in rec}


def num_buckets(run: Run, rank: int = 0) -> int:
    """Gradient buckets DDP all-reduces per sync, after it rebuilt them in the first backward."""
    logging = run.summaries[rank]["ddp_logging"]
    sizes = logging.get("rebuilt_bucket_sizes") or logging.get("bucket_sizes")
    return len([s for s in str(sizes).split(",") if s.strip()])


def allreduce_table(runs: Dict[str, Run], rank: int = 0) -> List[Dict[str, object]]:
    """Per run: micro-steps, optimizer steps, all-reduces, buckets, all-reduces per step."""
    rows = []
    for label, run in runs.items():
        calls, opt_steps = run.allreduce_calls(rank), run.optimizer_steps(rank)
        rows.append({"run": label, "micro_steps": len(run.steps[rank]),
                     "optimizer_steps": opt_steps, "allreduces": calls,
                     "buckets": num_buckets(run, rank),
                     "allreduces_per_optimizer_step": calls / opt_steps})
    return rows


def print_table(rows: List[Dict[str, object]]) -> None:
    """Rows of dicts as aligned columns."""
    print(text_table(list(rows[0]), [[f"{v:.3g}" if isinstance(v, float) else v for v in r.values()]
                                     for r in rows]))


def optimizer_step_micros(run: Run, rank: int = 0) -> List[int]:
    """Micro-batch indices (within the epoch) after which ``rank`` stepped the optimizer."""
    return [rec["micro"] for rec in run.steps[rank] if rec["optimizer_step"]]


def planned_step_micros(num_batches: int, accum_steps: int, bug: bool = False) -> List[int]:
    """Micro-batches after which ``train.sync_schedule`` (the original's, with ``bug``) plans an
    optimizer step: the scripts' own code, compiled from their files."""
    schedule = script_function(ORIGINAL_SCRIPT if bug else TRAIN_SCRIPT, "sync_schedule")
    return [i for i, sync in enumerate(schedule(num_batches, accum_steps)) if sync]


def show_sync_schedule(num_batches: int, accum_steps: int) -> None:
    """The plan of ``train.sync_schedule`` beside the original's off-by-one."""
    for bug in (True, False):
        steps = planned_step_micros(num_batches, accum_steps, bug)
        marks = "".join("S" if i in steps else "." for i in range(num_batches))
        print(f"{'original (i % K == 0)' if bug else 'fixed (last of each K)':<24} {marks}   "
              f"steps after micro-batches {steps}")
    print("S = sync and optimizer step, . = accumulate under no_sync")


def params_match(state_a, state_b, atol: float = 1e-5) -> bool:
    """Do two state_dicts hold the same tensors, up to ``atol``?"""
    import torch

    return state_a.keys() == state_b.keys() and all(
        torch.allclose(state_a[k], state_b[k], atol=atol) for k in state_a)


def max_param_difference(state_a, state_b) -> float:
    """Largest absolute difference between matching tensors of two state_dicts."""
    return max(float((state_a[k] - state_b[k]).abs().max()) for k in state_a)


def default_lr() -> float:
    """train.py's learning rate when ``--lr`` is not given."""
    return config.build_parser().get_default("lr")


def window_means(curve: Sequence[float], window: int = 16) -> List[float]:
    """Means of the curve over consecutive ``window`` micro-steps (the last may be shorter)."""
    return [statistics.mean(curve[i:i + window]) for i in range(0, len(curve), window)]


def loss_scaling_runs(lr: float = 0.4, accum_steps: int = 4,
                      epochs: int = 4) -> Dict[str, List[str]]:
    """For ``train_runs``: the runs of ``loss_scaling_stability``, the loss divided by K or not."""
    args = train_args(accum_steps, "--lr", lr, epochs=epochs)
    return {f"lr {lr:g}, divided by K": args,
            f"lr {lr:g}, not divided": args + ["--bug", "loss-not-scaled"]}


def loss_scaling_stability(runs: Dict[str, Run], lr: float = 0.4) -> Dict[str, Dict[str, object]]:
    """Per run of ``loss_scaling_runs(lr)``: mean loss ``curve``, ``start`` and ``end`` (means of
    the first and last 8 micro-steps), ``finite`` throughout, ``peak`` (largest finite loss)."""
    summary = {}
    for label in ("divided by K", "not divided"):
        curve = runs[f"lr {lr:g}, {label}"].mean_loss_curve()
        finite = [x for x in curve if math.isfinite(x)]
        summary[label] = {"curve": curve, "start": sum(curve[:8]) / 8, "end": sum(curve[-8:]) / 8,
                          "finite": len(finite) == len(curve), "peak": max(finite)}
    return summary


def print_loss_scaling_stability(summary: Dict[str, Dict[str, object]], lr: float,
                                 window: int = 16) -> None:
    """Each run's loss, averaged over ``window`` micro-steps, then whether it stayed finite."""
    for label, s in summary.items():
        means = ", ".join(f"{x:.3g}" for x in window_means(s["curve"], window))
        print(f"lr {lr:g}, loss {label:<13}: mean loss per {window} micro-steps: {means}")
        print(f"{'':>32}start {s['start']:.3g}, end {s['end']:.3g}, largest {s['peak']:.3g}, "
              f"{'finite throughout' if s['finite'] else 'became inf or nan: diverged'}")


def sync_seconds_per_micro_step(run: Run, rank: Optional[int] = None) -> float:
    """Total sync time over all micro-steps (of ``rank``, or of every rank), per micro-step."""
    ranks = run.ranks if rank is None else [rank]
    total = sum(s["sync_s"] for r in ranks for s in run.steps[r])
    return total / sum(len(run.steps[r]) for r in ranks)


def straggler_wait_seconds(run: Run) -> float:
    """The wait the straggler delays alone force, summed over syncs: at each, every rank waits
    for the largest delay built up since the last; inside a window of K, delays cancel."""
    total, since_sync = 0.0, {r: 0.0 for r in run.ranks}
    for records in zip(*(run.steps[r] for r in run.ranks)):
        for rec in records:
            since_sync[rec["rank"]] += rec["straggler_s"]
        if records[0]["allreduce_calls"]:  # the ranks met in an all-reduce here
            slowest = max(since_sync.values())
            total += sum(slowest - d for d in since_sync.values())
            since_sync = {r: 0.0 for r in run.ranks}
    return total


def sync_alignment(run: Run) -> Dict[str, float]:
    """Over the steps that all-reduced, the median spread between ranks of the sync's start
    (arrival) and end (departure), in ms: the all-reduce ends when the slowest rank joins."""
    arrival, departure = [], []
    for records in zip(*(run.steps[r] for r in run.ranks)):
        if any(rec["sync_offset_s"] is None for rec in records):  # no all-reduce in this step
            continue
        starts = [rec["t_start"] + rec["sync_offset_s"] for rec in records]
        ends = [start + rec["sync_s"] for start, rec in zip(starts, records)]
        arrival.append(max(starts) - min(starts))
        departure.append(max(ends) - min(ends))
    return {"median_arrival_spread_ms": 1e3 * statistics.median(arrival),
            "median_departure_spread_ms": 1e3 * statistics.median(departure),
            "sync_steps": len(arrival)}


# -- Lesson 04: which micro-batches a step schedule applies -----------------------
def schedules(runs: Dict[str, Run]) -> Dict[str, Dict[str, object]]:
    """From ``train_runs(..., schedule_demo=True)``, per schedule ("original", "fixed") rank 0's
    report: ``steps`` (each with the ``[rank, epoch, micro]`` it applied); per rank, ``lost``."""
    launched = Run(next(iter(runs.values())).run_dir.parent)
    return {rec["schedule"]: rec for rec in launched.results(0) if "schedule" in rec}


def applied_micro_batches(report: Dict[str, object], rank: int = 0) -> List[List[tuple]]:
    """Per optimizer step, the ``(epoch, micro)`` of ``rank`` it applied."""
    return [sorted((e, m) for r, e, m in step["applied"] if r == rank) for step in report["steps"]]


def print_schedule_demo(report: Dict[str, object], title: str) -> None:
    """One line per optimizer step: after which micro-batch, and the micro-batches in it."""
    print(title)
    for step, applied in zip(report["steps"], applied_micro_batches(report)):
        names = ", ".join(f"e{e}:{m}" for e, m in applied)
        print(f"  step after epoch {step['epoch']} micro {step['micro']}: applies {names}")
    lost = sorted((e, m) for r, e, m in report["lost"][0])
    print(f"  never applied: {', '.join(f'e{e}:{m}' for e, m in lost) or 'nothing'}")
