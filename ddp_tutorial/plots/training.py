"""Figures of a training run: the per-rank sync timeline and the loss curves."""

from __future__ import annotations

from typing import Optional

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ddp_tutorial.lessons.figure import PHASE_COLORS, finish_axes, new_axes


def plot_sync_timeline(run, first_step: int = 0, num_steps: int = 8, ax: Optional[plt.Axes] = None,
                       title: Optional[str] = None) -> plt.Axes:
    """Per rank, ``num_steps`` micro-steps from ``first_step`` on the shared wall clock: a rank
    that waits in a sync for a slower one shows a long red bar."""
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
            if s["optimizer_step"]:
                end = (s["t_start"] - t0 + s["step_s"]) * 1e3
                ax.plot([end, end], [row - 0.45, row + 0.45], color="black", lw=0.8)
    ax.set_yticks(range(len(run.ranks)), [f"rank {r}" for r in run.ranks])
    ax.invert_yaxis()
    title = title or (f"Per-rank timeline, micro-steps {first_step}-{first_step + num_steps - 1} "
                      "(black tick: optimizer step)")
    return finish_axes(ax, "wall time (ms)", "rank", title, frameon=False, ncol=4,
                       handles=[Patch(color=c, label=n) for n, c in PHASE_COLORS.items()],
                       loc="upper center", bbox_to_anchor=(0.5, -0.25))


def plot_loss_curves(run, ax: Optional[plt.Axes] = None, title: Optional[str] = None,
                     label: Optional[str] = None) -> plt.Axes:
    """Local loss per rank (thin) and their mean (thick) per micro-step; ``label`` prefixes the
    legend, to overlay runs on one ``ax``."""
    ax = new_axes(ax, figsize=(7, 3.5))
    prefix = f"{label}: " if label else ""
    for rank in run.ranks:
        ax.plot(run.column(rank, "step"), run.column(rank, "loss"), lw=0.8, alpha=0.5,
                label=f"{prefix}rank {rank}")
    mean = run.mean_loss_curve()
    ax.plot(range(len(mean)), mean, lw=2.2, color="black" if not label else None,
            label=f"{prefix}mean over ranks")
    ax.set_yscale("log")
    return finish_axes(ax, "micro-step", "local training loss (MSE)", title or "Loss curves",
                       ncol=2)

