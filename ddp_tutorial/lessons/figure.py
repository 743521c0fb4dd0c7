"""What every figure of the kit shares: the phases' colours, a new or given Axes, and its labels.
(Here, not in ``plots/``, so that a lesson's ``plots.py`` imports it without importing ``plots``,
which gathers every lesson's figures.)"""

from __future__ import annotations

from typing import Optional

import matplotlib.pyplot as plt

#: Colours of the phases of a micro-step, shared by every timing figure.
PHASE_COLORS = {"straggler delay": "#bbbbbb", "compute": "#4c72b0", "sync (all-reduce)": "#dd4444",
                "optimizer": "#55a868"}


def new_axes(ax: Optional[plt.Axes], figsize=(8, 3)) -> plt.Axes:
    """``ax``, or the Axes of a new figure of ``figsize``: every figure helper draws on either."""
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def finish_axes(ax: plt.Axes, xlabel: Optional[str], ylabel: str, title: str, **legend) -> plt.Axes:
    """Label ``ax`` (no x label when ``xlabel`` is None), add its legend, fit the figure; returns ``ax``.

    Args:
        legend: keyword arguments of ``ax.legend`` (default: a small font).
    """
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(**{"fontsize": "small", **legend})
    ax.figure.tight_layout()
    return ax
