"""Figures of lessons 03-04: which samples each rank gets, and what syncing costs per micro-step."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import matplotlib.pyplot as plt
import numpy as np

from ddp_tutorial.lessons.sampler_accumulation import sync_seconds_per_micro_step
from ddp_tutorial.lessons.figure import PHASE_COLORS, finish_axes, new_axes


def plot_sampler_orders(orders: Sequence[Dict[int, List[int]]], dataset_size: int,
                        ax: Optional[plt.Axes] = None, title: Optional[str] = None) -> plt.Axes:
    """Heatmap of ``sampler_orders``: a row per (epoch, rank), a column per sample, coloured by
    position in the rank's order; identical blocks of rows mean every epoch repeats the order."""
    rows = [(epoch, rank, indices) for epoch, per_rank in enumerate(orders)
            for rank, indices in per_rank.items()]
    grid = np.full((len(rows), dataset_size), np.nan)
    for row, (_, _, indices) in enumerate(rows):
        for position, index in enumerate(indices):
            grid[row, index] = position
    ax = new_axes(ax, figsize=(8, 0.28 * len(rows) + 1.5))
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis",
                      interpolation="nearest")
    ranks_per_epoch = len(orders[0])
    for boundary in range(ranks_per_epoch, len(rows), ranks_per_epoch):
        ax.axhline(boundary - 0.5, color="black", lw=1.5)
    ax.set_yticks(range(len(rows)), [f"epoch {e}, rank {r}" for e, r, _ in rows])
    ax.set_xticks(range(dataset_size))
    ax.tick_params(axis="x", labelsize="x-small")
    ax.set(xlabel="sample index", ylabel="(epoch, rank)",
           title=title or "Samples per rank and epoch (colour: position in the rank's order)")
    ax.figure.colorbar(image, ax=ax, label="position in the rank's order")
    ax.figure.tight_layout()
    return ax


def plot_sync_per_micro_step(runs: Dict[str, object], ax: Optional[plt.Axes] = None,
                             title: Optional[str] = None) -> plt.Axes:
    """Per run (label -> ``Run``) and rank, sync time per micro-step: a fast rank waits in the
    all-reduce for the slow one, so its bar is the taller."""
    ax = new_axes(ax, figsize=(7, 3.2))
    labels = list(runs)
    ranks = sorted({r for run in runs.values() for r in run.ranks})
    width = 0.8 / (len(ranks) + 1)
    colors = plt.get_cmap("tab10")
    for k, rank in enumerate(ranks):
        values = [1e3 * sync_seconds_per_micro_step(runs[label], rank) for label in labels]
        ax.bar([i + (k - len(ranks) / 2) * width for i in range(len(labels))], values, width,
               color=colors(k), label=f"rank {rank}")
    means = [1e3 * sync_seconds_per_micro_step(runs[label]) for label in labels]
    ax.bar([i + (len(ranks) / 2) * width for i in range(len(labels))], means, width,
           color=PHASE_COLORS["sync (all-reduce)"], label="all ranks")
    ax.set_xticks(range(len(labels)), labels)
    return finish_axes(ax, None, "sync time per micro-step (ms)",
                       title or "Sync time per micro-step")
