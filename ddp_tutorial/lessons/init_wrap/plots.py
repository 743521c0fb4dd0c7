"""Figures for steps 1 and 2: init time against world size, all-reduces against bucket size."""

from __future__ import annotations

from typing import Dict, List, Optional

import matplotlib.pyplot as plt

from ddp_tutorial.lessons.figure import finish_axes, new_axes


def plot_init_times(sweep: Dict[int, List[dict]], ax: Optional[plt.Axes] = None,
                    title: Optional[str] = None) -> plt.Axes:
    """Mean time in ``init_process_group`` per world size of ``init_sweep``: waiting, setup."""
    ax = new_axes(ax, figsize=(6, 3.2))
    sizes = sorted(sweep)
    wait = [1e3 * sum(r["wait_s"] for r in sweep[w]) / len(sweep[w]) for w in sizes]
    setup = [1e3 * sum(r["setup_s"] for r in sweep[w]) / len(sweep[w]) for w in sizes]
    x = range(len(sizes))
    ax.bar(x, wait, color="#bbbbbb", label="waiting for the last rank to arrive")
    ax.bar(x, setup, bottom=wait, color="#4c72b0",
           label="setup after all arrived (store, connections)")
    ax.set_xticks(list(x), [str(w) for w in sizes])
    return finish_axes(ax, "world size (ranks)", "mean time in init_process_group (ms)",
                       title or "How long init_process_group takes")


def plot_allreduces_vs_bucket_cap(rows: List[dict], ax: Optional[plt.Axes] = None,
                                  title: Optional[str] = None) -> plt.Axes:
    """All-reduces per backward against ``bucket_cap_mb`` (``bucket_rows``): first pass, later."""
    ax = new_axes(ax, figsize=(6, 3.2))
    rows = sorted(rows, key=lambda r: r["bucket_cap_mb"])
    caps = [r["bucket_cap_mb"] for r in rows]
    ax.plot(caps, [r["allreduces_per_step"] for r in rows], "o-", color="#dd4444",
            label="after the first pass (rebuilt buckets)")
    ax.plot(caps, [r["allreduces_first"] for r in rows], "s--", color="#888888",
            label="first pass (initial buckets)")
    model_mb = rows[0]["param_bytes"] / 2**20
    ax.axvline(model_mb, color="black", lw=0.8, ls=":", label=f"gradient size {model_mb:.1f} MiB")
    ax.set_xscale("log")
    return finish_axes(ax, "bucket_cap_mb", "all-reduces per backward",
                       title or "Smaller buckets, more all-reduces")
