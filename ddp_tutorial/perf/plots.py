"""Figures of the performance lab: all-reduce sweep, bucket sweep, overlap, accumulation, scaling projection.

Each takes the dicts ``ddp_tutorial.bench`` returns.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import matplotlib.pyplot as plt

from ddp_tutorial.perf import costmodel as perf
from ddp_tutorial.plots.training import new_axes


def plot_allreduce_sweep(sweep: Dict, ax: Optional[plt.Axes] = None) -> plt.Axes:
    """Bus bandwidth against all-reduce size (log-log): measured points, the fitted ring model, memcpy.

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
    """Backward time and all-reduce calls per step against ``bucket_cap_mb``.

    Args:
        rows: ``bench.ddp_lab(...)["buckets"]``.
        ax: axes to draw on (new figure if None).
    """
    ax = new_axes(ax, figsize=(7, 3.5))
    caps = [r["bucket_cap_mb"] for r in rows]
    ax.plot(caps, [r["backward_s"] * 1e3 for r in rows], "o-", color="#dd4444", label="backward time")
    ax.set_xscale("log")
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("backward (ms)")
    calls = ax.twinx()
    calls.plot(caps, [r["allreduce_calls_per_step"] for r in rows], "s--", color="#4c72b0",
               label="all-reduce calls / step")
    calls.set_ylabel("all-reduce calls per step")
    handles = ax.get_legend_handles_labels()[0] + calls.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8)
    ax.set_title("bigger buckets: fewer all-reduces, less latency paid")
    return ax


def plot_overlap(result: Dict, ax: Optional[plt.Axes] = None) -> plt.Axes:
    """Iteration time of DDP, a per-gradient all-reduce after backward, and one flat all-reduce.

    Args:
        result: ``bench.ddp_lab(...)["overlap"]``.
        ax: axes to draw on (new figure if None).
    """
    ax = new_axes(ax, figsize=(6, 3))
    names = ["DDP (buckets, overlapped)", "all-reduce each gradient\nafter backward",
             "one flat all-reduce\nafter backward"]
    values = [result[k] * 1e3 for k in ("ddp_step_s", "per_gradient_step_s", "flat_step_s")]
    bars = ax.barh(names, values, color=["#4c72b0", "#dd4444", "#55a868"], label="iteration time")
    ax.bar_label(bars, fmt="%.2f ms", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("iteration time (ms, median)")
    ax.set_title(f"DDP's logger: {result['avg_backward_compute_comm_overlap_time_s'] * 1e3:.2f} ms of comm "
                 f"overlapped with backward")
    ax.legend(fontsize=8, loc="lower right")
    return ax


def plot_accumulation(rows: Sequence[Dict], ax: Optional[plt.Axes] = None) -> plt.Axes:
    """All-reduce transfer time per sample relative to K=1, against K, with the ideal 1/K.

    Args:
        rows: ``bench.accumulation_ratios(...)``.
        ax: axes to draw on (new figure if None).
    """
    ax = new_axes(ax, figsize=(6, 3.5))
    for straggler_ms in sorted({r["straggler_ms"] for r in rows}):
        sel = sorted((r for r in rows if r["straggler_ms"] == straggler_ms), key=lambda r: r["accum_steps"])
        ax.plot([r["accum_steps"] for r in sel], [r["comm_per_sample_vs_k1"] for r in sel], "o-",
                label=f"measured, straggler up to {straggler_ms:g} ms")
    ks = sorted({r["accum_steps"] for r in rows})
    ax.plot(ks, [1 / k for k in ks], "k--", label="ideal 1/K")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("K (accumulation steps per optimizer step)")
    ax.set_ylabel("transfer time per sample / K=1")
    ax.set_title("no_sync: one all-reduce per K micro-batches")
    ax.legend(fontsize=8)
    return ax


def plot_scaling_projection(projection: Dict, alpha: str = "fitted", bucket_mb: float = 25.0,
                            accum_steps: int = 1, ax: Optional[plt.Axes] = None) -> plt.Axes:
    """Projected scaling efficiency against workers, per job and link bandwidth; assumptions below.

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
    ax.set_title(f"projection: alpha = {projection['alphas'][alpha] * 1e6:.0f} us ({alpha}), bucket {bucket_mb:g} MB, "
                 f"K = {accum_steps}")
    ax.legend(fontsize=7, loc="lower left")
    notes = "Assumptions:\n" + "\n".join(f"- {a}" for a in projection["assumptions"])
    ax.figure.text(0.01, -0.02, notes, fontsize=7, va="top", wrap=True)
    return ax
