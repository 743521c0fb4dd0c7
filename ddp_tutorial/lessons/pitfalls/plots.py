"""Figures of notebook 09: each takes its pitfall's summary (named in its docstring), an
optional ``ax`` (None: a new figure) and ``title``, and returns the ``Axes``."""

from __future__ import annotations

from typing import List, Optional

import matplotlib.pyplot as plt

from ddp_tutorial.lessons.figure import finish_axes, new_axes


def plot_batchnorm_stats(summary: dict, ax: Optional[plt.Axes] = None, title: str = "") -> plt.Axes:
    """Running mean per channel: one process, each rank alone, the fix (``batchnorm_summary``)."""
    ax = new_axes(ax, figsize=(7, 3.2))
    fix = "syncbn" if "errors" not in summary["syncbn"] else "allreduce"
    series = [("one process, global batch", summary["reference"]["running_mean"], "black")]
    series += [(f"rank {r}, own shard only", m, color) for (r, m), color in
               zip(sorted(summary["no_sync"]["running_mean"].items()), ["#4c72b0", "#dd8452", "#55a868", "#c44e52"])]
    series.append((f"rank 0, {'SyncBatchNorm' if fix == 'syncbn' else 'all-reduced statistics'}",
                   summary[fix]["running_mean"][0], "#8172b3"))
    width = 0.8 / len(series)
    for i, (label, values, color) in enumerate(series):
        ax.bar([c + (i - (len(series) - 1) / 2) * width for c in range(len(values))], values, width,
               label=label, color=color)
    ax.set_xticks(range(len(series[0][1])))
    ax.axhline(0, color="grey", lw=0.6)
    return finish_axes(ax, "BatchNorm channel", "running mean after training",
                       title or "BatchNorm running statistics: each rank alone vs the global batch")


def plot_unused_cost(summary: dict, ax: Optional[plt.Axes] = None, title: str = "") -> plt.Axes:
    """Median and quartiles of each DDP wrapping's step time, CPU and wall (``unused_summary``)."""
    ax = new_axes(ax, figsize=(7, 3.2))
    cost = summary["cost"]
    names = list(cost["cpu"])
    for offset, (clock, label, color) in zip((-0.2, 0.2), (("cpu", "CPU time of the training thread", "#4c72b0"),
                                                           ("wall", "wall clock", "#bbbbbb"))):
        stats = [cost[clock][n] for n in names]
        medians = [s["median_ms"] for s in stats]
        spread = [[m - s["q1_ms"] for m, s in zip(medians, stats)], [s["q3_ms"] - m for m, s in zip(medians, stats)]]
        ax.bar([i + offset for i in range(len(names))], medians, 0.4, yerr=spread, capsize=3, color=color,
               label=label)
    ax.set_xticks(range(len(names)), names)
    return finish_axes(ax, "DDP wrapping (same model, all parameters used)",
                       "time per step (ms), median and quartiles",
                       title or "What each DDP flag costs per step")


def plot_eval_error(rows: List[dict], ax: Optional[plt.Axes] = None, title: str = "") -> plt.Axes:
    """Each way of combining the ranks' accuracies against the true one (``evaluation_rows``)."""
    ax = new_axes(ax, figsize=(7, 3.2))
    sizes = [r["size"] for r in rows]
    # With equal shards, the mean of the ranks' accuracies is the all-slot ratio: one line for both.
    for key, label, style in (("padded", "every slot counted (= mean of the ranks' accuracies)", "o-"),
                              ("fixed", "real samples only (the fix)", "k.-")):
        ax.plot(sizes, [100 * (r[key] - r["true"]) for r in rows], style, label=label)
    for r in rows:
        if r["padding"] == 0:
            ax.axvline(r["size"], color="#dddddd", lw=3, zorder=0)
    ax.axhline(0, color="grey", lw=0.6)
    return finish_axes(ax, f"validation samples (grey: divisible by {rows[0]['world_size']} ranks, no padding)",
                       "error vs true accuracy\n(percentage points)",
                       title or "Validation accuracy skewed by the sampler's padding")


def plot_lr_curves(summary: dict, ax: Optional[plt.Axes] = None, title: str = "") -> plt.Axes:
    """Loss against samples seen: one process, W ranks with lr kept or scaled (``lr_summary``)."""
    ax = new_axes(ax, figsize=(7, 3.2))
    s, w = summary, summary["world_size"]
    for key, label, style in (("single", f"1 process, batch {s['batch_size']}, lr {s['lr']:g}", "k-"),
                              ("kept", f"{w} ranks, global batch {s['global_batch']}, lr {s['lr']:g}", "-"),
                              ("scaled", f"{w} ranks, global batch {s['global_batch']}, lr {s['scaled_lr']:g} "
                                         f"(warm-up {s['warmup_steps']} steps)", "--")):
        ax.plot(s["samples"], s["curves"][key], style, label=label)
    ax.set_yscale("log")
    return finish_axes(ax, "samples seen", "loss on the whole set (MSE)",
                       title or "Same data, larger global batch: the learning rate must follow")


def plot_clipping_drift(summary: dict, ax: Optional[plt.Axes] = None, title: str = "") -> plt.Axes:
    """Largest parameter difference from one process, per optimizer step (``clipping_summary``)."""
    ax = new_axes(ax, figsize=(7, 3.2))
    for key, label, style in (("right", "clip once, after the all-reduce", "o-"),
                              ("wrong", "clip every micro-step (inside no_sync)", "s--")):
        diffs = [max(d, 1e-9) for d in summary[key]["max_diff"]]  # a log axis cannot show 0
        ax.plot(range(1, len(diffs) + 1), diffs, style, label=label)
    ax.set_yscale("log")
    ax.set_xticks(range(1, len(summary["right"]["max_diff"]) + 1))
    return finish_axes(ax, "optimizer step", "max |parameter - one process| (0 as 1e-9)",
                       title or "Clipping with accumulation, against one process on the global batch")
