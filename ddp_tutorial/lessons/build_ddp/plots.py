"""Figures of lesson 11: a step's timeline per rank, and the side-by-side comparison of the versions."""

from __future__ import annotations

from typing import Dict, Optional

import matplotlib.pyplot as plt

from ddp_tutorial.lessons.figure import finish_axes, new_axes


def plot_overlap_timeline(timelines: Dict[str, Dict[int, dict]], ax: Optional[plt.Axes] = None,
                          title: Optional[str] = None) -> plt.Axes:
    """One row per (version, rank) of ``timelines`` (version -> ``build_ddp.timeline``): backward,
    each gradient ready, each all-reduce from launch to completion, the wait after backward."""
    rows = [(version, rank, t) for version, ranks in timelines.items() for rank, t in sorted(ranks.items())]
    ax = new_axes(ax, figsize=(9, 0.45 * len(rows) + 1.2))
    labelled = set()

    def label(name):  # each name once in the legend
        return None if name in labelled or labelled.add(name) else name

    for y, (version, rank, t) in enumerate(rows):
        start, end = t["backward"]
        ax.broken_barh([(start, end - start)], (y - 0.4, 0.8), color="#bbbbbb",
                       label=label("backward (its layers wait like GPU kernels)"))
        ax.broken_barh([(end, t["synced"] - end)], (y - 0.4, 0.8), color="#f0a030",
                       label=label("after the last gradient, until synced (exposed)"))
        for a, b in t["all_reduces"]:
            ax.broken_barh([(a, max(b - a, 0.05))], (y - 0.25, 0.5), color="#dd4444", alpha=0.6,
                           label=label("all-reduce, launch to completion"))
        ax.plot(t["ready"], [y] * len(t["ready"]), "|", color="black", markersize=10, label=label("gradient ready"))
    ax.set_yticks(range(len(rows)), [f"{version}, rank {rank}" for version, rank, _ in rows], fontsize="small")
    ax.invert_yaxis()
    return finish_axes(ax, "ms since the step's forward started (each rank's own clock)", "version and rank",
                       title or "One training step: when gradients are ready and when they are all-reduced",
                       loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2)


def plot_side_by_side(summary: Dict[str, dict], ax: Optional[plt.Axes] = None,
                      title: Optional[str] = None) -> plt.Axes:
    """Per version of ``summary`` (``build_ddp.overlap_summary``): the median step, and the
    communication exposed after the last gradient. Time in flight during backward is not drawn: it
    counts queueing and waiting for the peer, no length of communication."""
    from ddp_tutorial.lessons.build_ddp import NAMES

    ax = new_axes(ax, figsize=(8, 3.4))
    names = list(summary)
    xs = range(len(names))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [summary[n]["step_ms"] for n in names], width, color="#4c72b0",
           label="step: forward to optimizer.step()")
    ax.bar([x + width / 2 for x in xs], [summary[n]["exposed_ms"] for n in names], width, color="#f0a030",
           label="exposed: waited for after the last gradient")
    ax.set_xticks(list(xs), [NAMES.get(n, n) for n in names])
    ax.set_ylim(0, 1.3 * max(summary[n]["step_ms"] for n in names))  # room for the legend above the bars
    return finish_axes(ax, None, "ms (median of steps 2-6, both ranks)",
                       title or "One training step, and the communication it waited for",
                       loc="upper center", ncol=2)
