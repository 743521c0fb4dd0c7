"""Figures of the performance lab: all-reduce sweep, bucket sweep, overlap, accumulation, scaling projection.

Each takes the dicts ``ddp_tutorial.bench`` returns.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import matplotlib.pyplot as plt

from ddp_tutorial.perf import costmodel as perf
from ddp_tutorial.plots.training import new_axes


def plot_allreduce_sweep(sweep: Dict, ax: Optional[plt.Axes] = None) -> plt.Axes:
    """Bus bandwidth against all-reduce size (log-log): measured points, the fitted ring model, a plain copy.

    Args:
        sweep: the result of ``bench.allreduce_sweep``.
        ax: axes to draw on (new figure if None).
    """
    ax = new_axes(ax, figsize=(7, 4))
    fit = sweep["fit"]
    for world_size in sweep["world_sizes"]:
        rows = [r for r in sweep["table"] if r["world_size"] == world_size]
        sizes = [r["bytes"] for r in rows]
        line, = ax.plot(sizes, [r["busbw_GBps"] for r in rows], "o", label=f"measured, {world_size} ranks")
        model = [perf.busbw(n, perf.ring_time(n, world_size, fit["alpha_s"], fit["bandwidth"]), world_size)
                 / perf.GB for n in sizes]
        ax.plot(sizes, model, "-", color=line.get_color(), alpha=0.7, label=f"ring model, {world_size} ranks")
    copies = sweep.get("memcpy_by_size")
    if copies:
        ax.plot([m["bytes"] for m in copies], [m["Bps"] / perf.GB for m in copies], "k--",
                label="a plain copy of the same size")
    else:
        ax.axhline(sweep["memcpy_Bps"] / perf.GB, color="black", ls="--", label="memcpy (ceiling)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("all-reduce size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"{sweep['backend']} all-reduce: alpha = {fit['alpha_s'] * 1e6:.0f} us, "
                 f"B = {fit['bandwidth'] / perf.GB:.2f} GB/s, R² = {fit['r2']:.3f}")
    ax.legend(fontsize=8)
    return ax


def plot_bucket_sweep(rows: Sequence[Dict], ax: Optional[plt.Axes] = None) -> plt.Axes:
    """Backward's wall time, CPU time per step and all-reduce calls per step against ``bucket_cap_mb``.

    Both axes start at 0, so the heights compare as magnitudes.

    Args:
        rows: ``bench.ddp_lab(...)["buckets"]``.
        ax: axes to draw on (new figure if None).
    """
    ax = new_axes(ax, figsize=(7, 3.5))
    rows = sorted(rows, key=lambda r: r["bucket_cap_mb"])
    caps = [r["bucket_cap_mb"] for r in rows]
    ax.plot(caps, [r["backward_s"] * 1e3 for r in rows], "o-", color="#dd4444", label="backward, wall time")
    ax.plot(caps, [r["cpu_s"] * 1e3 for r in rows], "^-", color="#8c564b", label="CPU time per step (all threads)")
    ax.set_xscale("log")
    ax.set_ylim(0, None)
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("ms per step (median)")
    calls = ax.twinx()
    calls.plot(caps, [r["allreduce_calls_per_step"] for r in rows], "s--", color="#4c72b0",
               label="all-reduce calls / step")
    calls.set_ylim(0, None)
    calls.set_ylabel("all-reduce calls per step")
    handles = ax.get_legend_handles_labels()[0] + calls.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8)
    ax.set_title(f"bucket_cap_mb against time and all-reduces ({rows[0].get('steps', '?')} steps per cap)")
    return ax


def plot_overlap(result: Dict, ax: Optional[Sequence[plt.Axes]] = None) -> plt.Axes:
    """Wall time and CPU time per step for DDP, two ways to sync after backward, and no sync at all.

    Args:
        result: ``bench.ddp_lab(...)["overlap"]``.
        ax: two axes to draw on, wall then CPU (a new figure if None).

    Returns:
        The wall-time axes (its figure holds both).
    """
    from ddp_tutorial.perf.measure import OVERLAP_WAYS

    if ax is None:
        _, ax = plt.subplots(1, 2, figsize=(11, 3.2), sharey=True)
    wall_ax, cpu_ax = ax
    ways = list(OVERLAP_WAYS)
    names = [OVERLAP_WAYS[w].replace(" after", "\nafter") for w in ways]
    colors = ["#4c72b0", "#55a868", "#dd4444", "#999999"]
    wall = wall_ax.barh(names, [result[f"{w}_step_s"] * 1e3 for w in ways], color=colors)
    wall_ax.bar_label(wall, fmt="%.2f ms", fontsize=8)
    wall_ax.invert_yaxis()
    wall_ax.set_xlabel("wall time per step (ms, median)")
    wall_ax.set_title("wall time")
    compute = result["none_cpu_s"] * 1e3
    cpu_ax.barh(names, [compute] * len(ways), color="#bbbbbb", label="no communication's CPU time")
    extra = cpu_ax.barh(names, [result[f"{w}_cpu_s"] * 1e3 - compute for w in ways], left=[compute] * len(ways),
                        color=colors, label="more CPU time than that")
    cpu_ax.bar_label(extra, labels=[f"{result[f'{w}_cpu_s'] * 1e3:.2f} ms" for w in ways], fontsize=8)
    cpu_ax.set_xlabel("CPU time per step, every thread of the rank (ms, median)")
    cpu_ax.set_title("CPU time")
    cpu_ax.legend(fontsize=8, loc="lower right")
    for a in ax:
        a.set_xlim(0, a.get_xlim()[1] * 1.25)  # room for the labels
    return wall_ax


def plot_accumulation(rows: Sequence[Dict], ax: Optional[plt.Axes] = None) -> plt.Axes:
    """Bytes and transfer time per sample relative to K=1, against K, with 1/K.

    Args:
        rows: ``bench.accumulation_ratios(...)``.
        ax: axes to draw on (new figure if None).
    """
    ax = new_axes(ax, figsize=(6, 3.5))
    ks = sorted({r["accum_steps"] for r in rows})
    ax.plot(ks, [1 / k for k in ks], "k--", label="1/K")
    first = [r for r in rows if r["straggler_ms"] == min(x["straggler_ms"] for x in rows)]
    first.sort(key=lambda r: r["accum_steps"])
    ax.plot([r["accum_steps"] for r in first], [r["bytes_per_sample_vs_k1"] for r in first], "s", ms=9,
            mfc="none", color="black", label="bytes all-reduced per sample (counted)")
    for straggler_ms in sorted({r["straggler_ms"] for r in rows}):
        sel = sorted((r for r in rows if r["straggler_ms"] == straggler_ms), key=lambda r: r["accum_steps"])
        setting = "no straggler" if not straggler_ms else f"random 0-{straggler_ms:g} ms straggler sleeps"
        ax.plot([r["accum_steps"] for r in sel], [r["comm_per_sample_vs_k1"] for r in sel], "o-",
                label=f"transfer time per sample (measured), {setting}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("K (accumulation steps per optimizer step)")
    ax.set_ylabel("per sample / K=1")
    ax.set_title("no_sync: one all-reduce per K micro-batches")
    ax.legend(fontsize=8)
    return ax


def plot_scaling_projection(projection: Dict, alpha: str = "fitted", bucket_mb: float = 25.0,
                            accum_steps: int = 1, ax: Optional[plt.Axes] = None) -> plt.Axes:
    """Projected scaling efficiency against workers, per job and link bandwidth (assumptions: ``projection``).

    Args:
        projection: ``bench.projection(...)``.
        alpha: which α to draw: ``"fitted"`` (measured here) or ``"NCCL-class"`` (assumed).
        bucket_mb: which bucket size to draw.
        accum_steps: which K to draw.
        ax: axes to draw on (new figure if None).
    """
    ax = new_axes(ax, figsize=(8, 4.5))
    styles = ["-", "--"]
    for job, style in zip(projection["jobs"], styles):
        for gbps in sorted({r["bandwidth_GBps"] for r in projection["rows"]}):
            sel = [r for r in projection["rows"] if r["label"] == job["label"] and r["bandwidth_GBps"] == gbps
                   and r["alpha_label"] == alpha
                   and r["bucket_mb"] == bucket_mb and r["accum_steps"] == accum_steps]
            ax.plot([r["workers"] for r in sel], [r["efficiency"] for r in sel], style, marker=".",
                    label=f"{job['label']}, {gbps:g} GB/s")
    ax.axvline(256, color="gray", lw=0.8)
    ax.text(256, 1.02, "paper: near-linear to 256 GPUs", fontsize=8, ha="center")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.08)
    ax.set_xlabel("workers")
    ax.set_ylabel("scaling efficiency (1 = linear)")
    ax.set_title(f"alpha = {projection['alphas'][alpha] * 1e6:.0f} us ({alpha}), bucket {bucket_mb:g} MB, "
                 f"K = {accum_steps}", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    return ax


def plot_scaling_grid(projection: Dict, bucket_mb: float = 25.0) -> plt.Figure:
    """``plot_scaling_projection`` for both α (rows) and K = 1 and 8 (columns): every curve the table lists."""
    fig, axes = plt.subplots(2, 2, figsize=(14, 8), sharex=True, sharey=True)
    for row, alpha in zip(axes, ("fitted", "NCCL-class")):
        for ax, k in zip(row, (1, 8)):
            plot_scaling_projection(projection, alpha=alpha, bucket_mb=bucket_mb, accum_steps=k, ax=ax)
    for ax in axes.flat[1:]:
        ax.get_legend().remove()  # one legend: every panel draws the same jobs and bandwidths
    for ax in axes[0]:
        ax.set_xlabel("")
    fig.tight_layout()
    return fig
