"""The performance lab's figures (sweeps, overlap, accumulation, projection): each takes what
``measure`` returns, and ``ax``, the axes to draw on (a new figure if None)."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import matplotlib.pyplot as plt

from ddp_tutorial.lessons.performance.costmodel import GB, busbw, ring_time
from ddp_tutorial.lessons.performance.measure import OVERLAP_WAYS, by_straggler, straggler_setting
from ddp_tutorial.lessons.figure import finish_axes, new_axes


def plot_allreduce_sweep(sweep: Dict, ax: Optional[plt.Axes] = None) -> plt.Axes:
    """Bus bandwidth against size (log-log): measured, the fitted ring model, a plain copy."""
    ax, fit = new_axes(ax, figsize=(7, 4)), sweep["fit"]
    for world_size in sweep["world_sizes"]:
        rows = [r for r in sweep["table"] if r["world_size"] == world_size]
        sizes = [r["bytes"] for r in rows]
        line, = ax.plot(sizes, [r["busbw_GBps"] for r in rows], "o",
                        label=f"measured, {world_size} ranks")
        ax.plot(sizes, [busbw(n, ring_time(n, world_size, fit["alpha_s"], fit["bandwidth"]),
                              world_size) / GB for n in sizes],
                "-", color=line.get_color(), alpha=0.7, label=f"ring model, {world_size} ranks")
    copies = sweep["memcpy_by_size"]
    ax.plot([m["bytes"] for m in copies], [m["Bps"] / GB for m in copies], "k--",
            label="a plain copy of the same size")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    return finish_axes(ax, "all-reduce size (bytes)", "busbw (GB/s)",
                       f"{sweep['backend']} all-reduce: alpha = {fit['alpha_s'] * 1e6:.0f} us, "
                       f"B = {fit['bandwidth'] / GB:.2f} GB/s, R² = {fit['r2']:.3f}", fontsize=8)


def plot_bucket_sweep(rows: Sequence[Dict], ax: Optional[plt.Axes] = None) -> plt.Axes:
    """Backward's wall time, CPU time and all-reduce calls per step against ``bucket_cap_mb``;
    both axes start at 0, so the heights compare as magnitudes."""
    ax = new_axes(ax, figsize=(7, 3.5))
    rows = sorted(rows, key=lambda r: r["bucket_cap_mb"])
    caps = [r["bucket_cap_mb"] for r in rows]
    ax.plot(caps, [r["backward_s"] * 1e3 for r in rows], "o-", color="#dd4444",
            label="backward, wall time")
    ax.plot(caps, [r["cpu_s"] * 1e3 for r in rows], "^-", color="#8c564b",
            label="CPU time per step (all threads)")
    ax.set_xscale("log")
    calls = ax.twinx()
    calls.plot(caps, [r["allreduce_calls_per_step"] for r in rows], "s--", color="#4c72b0",
               label="all-reduce calls / step")
    calls.set_ylabel("all-reduce calls per step")
    for a in (ax, calls):
        a.set_ylim(0, None)
    handles = ax.get_legend_handles_labels()[0] + calls.get_legend_handles_labels()[0]
    return finish_axes(ax, "bucket_cap_mb", "ms per step (median)",
                       f"bucket_cap_mb against time and all-reduces ({rows[0]['steps']} steps per "
                       "cap)", handles=handles, fontsize=8)


def plot_overlap(result: Dict, ax: Optional[Sequence[plt.Axes]] = None) -> plt.Axes:
    """Wall and CPU time per step of each way to sync. ``ax``: two axes, wall then CPU."""
    wall_ax, cpu_ax = ax if ax is not None else plt.subplots(1, 2, figsize=(11, 3.2),
                                                             sharey=True)[1]
    names = [name.replace(" after", "\nafter") for name in OVERLAP_WAYS.values()]
    colors = ["#4c72b0", "#55a868", "#dd4444", "#999999"]
    wall_ax.bar_label(wall_ax.barh(names, [result[f"{w}_step_s"] * 1e3 for w in OVERLAP_WAYS],
                                   color=colors), fmt="%.2f ms", fontsize=8)
    wall_ax.invert_yaxis()
    wall_ax.set(xlabel="wall time per step (ms, median)", title="wall time")
    cpu = [result[f"{w}_cpu_s"] * 1e3 for w in OVERLAP_WAYS]
    compute = [result["none_cpu_s"] * 1e3] * len(cpu)
    cpu_ax.barh(names, compute, color="#bbbbbb", label="no communication's CPU time")
    extra = cpu_ax.barh(names, [c - base for c, base in zip(cpu, compute)], left=compute,
                        color=colors, label="more CPU time than that")
    cpu_ax.bar_label(extra, labels=[f"{c:.2f} ms" for c in cpu], fontsize=8)
    finish_axes(cpu_ax, "CPU time per step, every thread of the rank (ms, median)", "", "CPU time",
                fontsize=8, loc="lower right")
    for a in (wall_ax, cpu_ax):
        a.set_xlim(0, a.get_xlim()[1] * 1.25)  # room for the labels
    return wall_ax


def plot_accumulation(rows: Sequence[Dict], ax: Optional[plt.Axes] = None) -> plt.Axes:
    """Bytes and transfer time per sample against K=1 (``accumulation_ratios``), and 1/K, by K."""
    ax, settings = new_axes(ax, figsize=(6, 3.5)), by_straggler(rows)
    ks = [r["accum_steps"] for r in next(iter(settings.values()))]
    ax.plot(ks, [1 / k for k in ks], "k--", label="1/K")
    ax.plot(ks, [r["bytes_per_sample_vs_k1"] for r in next(iter(settings.values()))], "s", ms=9,
            mfc="none", color="black", label="bytes all-reduced per sample (counted)")
    for straggler_ms, sel in settings.items():
        ax.plot(ks, [r["comm_per_sample_vs_k1"] for r in sel], "o-",
                label=f"transfer time per sample (measured), {straggler_setting(straggler_ms)}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    return finish_axes(ax, "K (accumulation steps per optimizer step)", "per sample / K=1",
                       "no_sync: one all-reduce per K micro-batches", fontsize=8)


def plot_scaling_grid(projection: Dict) -> plt.Figure:
    """Projected efficiency against workers, per job and bandwidth: α by row, K by column."""
    fig, axes = plt.subplots(2, 2, figsize=(14, 8), sharex=True, sharey=True)
    rows = projection["rows"]
    for panels, alpha in zip(axes, ("fitted", "NCCL-class")):
        for ax, k in zip(panels, (1, 8)):
            for job, style in zip(projection["jobs"], ["-", "--"]):
                for gbps in sorted({r["bandwidth_GBps"] for r in rows}):
                    sel = [r for r in rows if (r["label"], r["bandwidth_GBps"], r["alpha_label"],
                                               r["accum_steps"]) == (job["label"], gbps, alpha, k)]
                    ax.plot([r["workers"] for r in sel], [r["efficiency"] for r in sel], style,
                            marker=".", label=f"{job['label']}, {gbps:g} GB/s")
            ax.axvline(256, color="gray", lw=0.8)
            ax.text(256, 1.02, "paper: near-linear to 256 GPUs", fontsize=8, ha="center")
            ax.set_xscale("log", base=2)
            ax.set(ylim=(0, 1.08), ylabel="scaling efficiency (1 = linear)",
                   xlabel="workers" if alpha == "NCCL-class" else "")
            ax.set_title(f"alpha = {projection['alphas'][alpha] * 1e6:.0f} us ({alpha}), bucket "
                         f"25 MB, K = {k}", fontsize=10)
    axes[0][0].legend(fontsize=8, loc="lower left")  # one legend: every panel draws the same curves
    fig.tight_layout()
    return fig
