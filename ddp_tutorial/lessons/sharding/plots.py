"""Figures of notebook 10: bytes held per rank, bytes sent per step, loss with compressed gradients.
Each takes ``ax`` (a new figure if None) and ``title``."""

from __future__ import annotations

from typing import Optional

import matplotlib.pyplot as plt

from ddp_tutorial.lessons.figure import finish_axes, new_axes

_KIND_COLORS = {"param_bytes": "#4c72b0", "grad_bytes": "#dd8452", "state_bytes": "#55a868"}
_KIND_NAMES = {"param_bytes": "parameters", "grad_bytes": "gradients", "state_bytes": "Adam state"}
_OP_COLORS = {"all_reduce": "#dd4444", "broadcast": "#8172b3", "all_gather_single": "#4c72b0",
              "reduce_scatter_single": "#55a868"}


def _stacked_bar(ax: plt.Axes, x: float, parts: dict, labelled: set) -> None:
    """One bar at ``x`` of ``parts`` (label -> (height, colour)), each label in the legend once."""
    bottom = 0
    for label, (height, color) in parts.items():
        ax.bar(x, height, bottom=bottom, color=color, label=None if label in labelled else label)
        labelled.add(label)
        bottom += height


def plot_memory_per_rank(table: dict, model: str = "wide", ax: Optional[plt.Axes] = None,
                         title: Optional[str] = None) -> plt.Axes:
    """Stacked bars: parameters, gradients and Adam state each rank holds, per strategy
    (``memory_table``'s ``model`` rows, "kit" or "wide")."""
    ax = new_axes(ax, figsize=(8, 3.5))
    labels, x, labelled = [], 0, set()
    for strategy, ranks in table[model].items():
        for rank, rec in sorted(ranks.items()):
            parts = {_KIND_NAMES[k]: (rec[k] / 1024, c) for k, c in _KIND_COLORS.items()}
            _stacked_bar(ax, x, parts, labelled)
            labels.append(f"{strategy}\nrank {rank}")
            x += 1
        x += 0.5  # a gap between strategies
    ticks = [i + 0.5 * (i // len(next(iter(table[model].values())))) for i in range(len(labels))]
    ax.set_xticks(ticks, labels, fontsize="small")
    return finish_axes(ax, "strategy and rank", "KiB held by the rank",
                       title or f"What each rank holds after one step ({model} model, Adam)")


def plot_comm_per_step(comm: dict, ax: Optional[plt.Axes] = None,
                       title: Optional[str] = None) -> plt.Axes:
    """Stacked bars: per strategy, the bus bytes of one step by collective (``comm_per_step``);
    the legend right of the axes, where it covers no bar."""
    ax = new_axes(ax, figsize=(8.5, 3.2))
    labelled = set()
    for i, ops in enumerate(comm.values()):
        _stacked_bar(ax, i, {op: (row["bus_bytes"] / 1024, _OP_COLORS.get(op, "grey"))
                             for op, row in ops.items()}, labelled)
    ax.set_xticks(range(len(comm)), list(comm), fontsize="small")
    return finish_axes(ax, "strategy", "bus KiB per step",
                       title or "Bus bytes per training step (nccl-tests' rule)", loc="upper left",
                       bbox_to_anchor=(1.01, 1.0))


def plot_compressed_loss(summary: dict, ax: Optional[plt.Axes] = None,
                         title: Optional[str] = None) -> plt.Axes:
    """The loss on the whole dataset after each step, a line per comm hook."""
    ax = new_axes(ax, figsize=(8, 3.2))
    for style, (name, hook) in zip(["-", "--", ":", "-."] * 2, summary["hooks"].items()):
        ax.plot(range(1, len(hook["losses"]) + 1), hook["losses"], ls=style, lw=1.6, label=name)
    return finish_axes(ax, "optimizer step", "loss on the whole dataset (MSE)",
                       title or "Compressed gradients: the loss curves lie on top of each other")
