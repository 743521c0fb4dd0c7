"""What every figure shares: the phases' colours, a new or given Axes, its labels. (Not in
``plots/``, which imports every lesson's ``plots.py``.)"""

from __future__ import annotations

from typing import Optional

import matplotlib.pyplot as plt

#: Colours of the phases of a micro-step, shared by every timing figure.
PHASE_COLORS = {"straggler delay": "#bbbbbb", "compute": "#4c72b0",
                "sync (all-reduce)": "#dd4444", "optimizer": "#55a868"}


def new_axes(ax: Optional[plt.Axes], figsize=(8, 3)) -> plt.Axes:
    """``ax``, or the Axes of a new figure of ``figsize``: every figure helper draws on either."""
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def finish_axes(ax: plt.Axes, xlabel: Optional[str], ylabel: str, title: str, **legend) -> plt.Axes:
    """Label ``ax`` (x only if ``xlabel``), add a legend (``legend``: its keywords), fit it."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(**{"fontsize": "small", **legend})
    ax.figure.tight_layout()
    return ax
