"""Figures of runs beyond one plain launch: the loss across a restart."""

from __future__ import annotations

from typing import Optional

import matplotlib.pyplot as plt

from ddp_tutorial.plots.training import finish_axes, new_axes


def plot_restart_loss(run, reference=None, rank: int = 0, ax: Optional[plt.Axes] = None,
                      title: Optional[str] = None) -> plt.Axes:
    """Loss per micro-step of each attempt of a restarted run, and where it resumed.

    A run that resumes from its checkpoint picks up the curve at the saved
    step; one that started over would begin again at step 0 with the initial loss.

    Args:
        run: a ``Run`` whose records carry ``attempt`` (e.g. ``launch(..., max_restarts=1)``).
        reference: an uninterrupted ``Run`` of the same settings, drawn dashed underneath.
        rank: whose local loss to draw.
        ax: axes to draw on (new figure if None).
        title: the title.
    """
    ax = new_axes(ax, figsize=(8, 3.5))
    if reference is not None:
        ax.plot(reference.column(rank, "step"), reference.column(rank, "loss"), color="grey",
                lw=3, alpha=0.4, label="uninterrupted run")
    steps = run.steps.get(rank, [])
    attempts = sorted({s["attempt"] for s in steps})
    if not attempts:
        raise ValueError(f"rank {rank} has no micro-steps in {run}")
    for attempt in attempts:
        mine = [s for s in steps if s["attempt"] == attempt]
        name = "first attempt" if attempt == 0 else f"attempt {attempt} (after restart {attempt})"
        line, = ax.plot([s["step"] for s in mine], [s["loss"] for s in mine], marker=".", lw=1.2,
                        label=name)
        if attempt < attempts[-1]:  # this attempt died after its last recorded step
            ax.plot(mine[-1]["step"], mine[-1]["loss"], "x", ms=12, mew=2.5, color=line.get_color())
    for event in run.events.get(rank, []):
        if event.get("kind") == "resume":
            ax.axvline(event["step"], color="black", ls=":", lw=1.2)
            ax.annotate(f"resumed from checkpoint\nat step {event['step']}", (event["step"], 1.0),
                        xycoords=("data", "axes fraction"), xytext=(4, -4), textcoords="offset points",
                        va="top", fontsize="small")
    ax.set_yscale("log")
    return finish_axes(ax, "micro-step", f"rank {rank} local loss (MSE)",
                       title or "Loss across a restart (x: last step before the failure)", loc="lower left")
