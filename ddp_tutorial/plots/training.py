"""Figures of a training run: the per-rank sync timeline, sync per rank, loss curves."""

from __future__ import annotations

from typing import Optional

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ddp_tutorial.lessons.figure import PHASE_COLORS, finish_axes, new_axes  # noqa: F401


def plot_sync_timeline(run, first_step: int = 0, num_steps: int = 8, ax: Optional[plt.Axes] = None,
                       title: Optional[str] = None) -> plt.Axes:
    """Per-rank timeline of micro-steps: straggler delay, compute, sync and optimizer.

    Each row is a rank; time runs left to right on the shared wall clock, so a
    rank that waits in a sync for a slower rank shows a long red bar.

    Args:
        run: a ``Run`` with per-step records.
        first_step: first micro-step to draw.
        num_steps: how many micro-steps to draw.
        ax: axes to draw on (new figure if None).
        title: the title (a default names the window).
    """
    ax = new_axes(ax, figsize=(9, 0.6 * len(run.ranks) + 1.4))
    window = {r: [s for s in run.steps[r] if first_step <= s["step"] < first_step + num_steps]
              for r in run.ranks}
    starts = [s["t_start"] for steps in window.values() for s in steps]
    if not starts:
        raise ValueError(f"no micro-steps {first_step}..{first_step + num_steps - 1} in {run}")
    t0 = min(starts)
    for row, rank in enumerate(run.ranks):
        for s in window[rank]:
            at = (s["t_start"] - t0) * 1e3
            phases = [("straggler delay", s["straggler_s"]),
                      ("compute", s["forward_s"] + s["backward_s"]),
                      ("optimizer", s["optimizer_s"])]
            for name, dur in phases:
                ax.broken_barh([(at, dur * 1e3)], (row - 0.35, 0.7), color=PHASE_COLORS[name])
                at += dur * 1e3
            if s["sync_s"] > 0:  # drawn over compute, where it really happened
                sync_at = (s["t_start"] - t0 + s["sync_offset_s"]) * 1e3
                ax.broken_barh([(sync_at, s["sync_s"] * 1e3)], (row - 0.35, 0.7),
                               color=PHASE_COLORS["sync (all-reduce)"])
        ends = [(s["t_start"] - t0 + s["step_s"]) * 1e3 for s in window[rank]]
        for s, end in zip(window[rank], ends):
            if s["optimizer_step"]:
                ax.plot([end, end], [row - 0.45, row + 0.45], color="black", lw=0.8)
    ax.set_yticks(range(len(run.ranks)), [f"rank {r}" for r in run.ranks])
    ax.invert_yaxis()
    ax.set_xlabel("wall time (ms)")
    ax.set_ylabel("rank")
    ax.set_title(title or f"Per-rank timeline, micro-steps {first_step}-{first_step + num_steps - 1} "
                          "(black tick: optimizer step)")
    ax.legend(handles=[Patch(color=c, label=n) for n, c in PHASE_COLORS.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, frameon=False)
    ax.figure.tight_layout()
    return ax


def plot_sync_per_rank(run, ax: Optional[plt.Axes] = None, title: Optional[str] = None) -> plt.Axes:
    """Per rank, mean seconds per sync step spent in the all-reduce, next to mean compute.

    Args:
        run: a ``Run``.
        ax: axes to draw on.
        title: the title.
    """
    ax = new_axes(ax, figsize=(6, 3))
    ranks = run.ranks
    sync = [1e3 * _mean([s["sync_s"] for s in run.sync_steps(r)]) for r in ranks]
    compute = [1e3 * _mean([s["forward_s"] + s["backward_s"] - s["sync_s"] for s in run.steps[r]])
               for r in ranks]
    straggle = [1e3 * _mean([s["straggler_s"] for s in run.steps[r]]) for r in ranks]
    x = range(len(ranks))
    w = 0.27
    ax.bar([i - w for i in x], straggle, w, color=PHASE_COLORS["straggler delay"], label="straggler delay / micro-step")
    ax.bar(list(x), compute, w, color=PHASE_COLORS["compute"], label="compute / micro-step")
    ax.bar([i + w for i in x], sync, w, color=PHASE_COLORS["sync (all-reduce)"], label="sync / sync step")
    ax.set_xticks(list(x), [f"rank {r}" for r in ranks])
    return finish_axes(ax, None, "mean time (ms)", title or "Where each rank's time goes")


def plot_loss_curves(run, ax: Optional[plt.Axes] = None, title: Optional[str] = None,
                     label: Optional[str] = None) -> plt.Axes:
    """Local training loss per rank (thin) and the mean over ranks (thick), per micro-step.

    Args:
        run: a ``Run``.
        ax: axes to draw on; pass the same ``ax`` to overlay runs.
        title: the title.
        label: prefix for the legend (to tell overlaid runs apart).
    """
    ax = new_axes(ax, figsize=(7, 3.5))
    prefix = f"{label}: " if label else ""
    for rank in run.ranks:
        ax.plot(run.column(rank, "step"), run.column(rank, "loss"), lw=0.8, alpha=0.5,
                label=f"{prefix}rank {rank}")
    mean = run.mean_loss_curve()
    ax.plot(range(len(mean)), mean, lw=2.2, color="black" if not label else None,
            label=f"{prefix}mean over ranks")
    ax.set_yscale("log")
    return finish_axes(ax, "micro-step", "local training loss (MSE)", title or "Loss curves", ncol=2)


def _mean(values):
    values = list(values)
    return sum(values) / len(values) if values else 0.0
