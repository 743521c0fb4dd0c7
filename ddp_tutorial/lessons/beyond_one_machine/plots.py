"""Figures of runs beyond one plain launch: the loss across a restart."""

from __future__ import annotations

from typing import Optional

import matplotlib.pyplot as plt

from ddp_tutorial.lessons.figure import finish_axes, new_axes
from ddp_tutorial.runfolder import attempt_of

AT_TOP = ("data", "axes fraction")  # x in data, y as a fraction of the axes' height


def plot_restart_loss(run, reference=None, rank: int = 0, ax: Optional[plt.Axes] = None,
                      title: Optional[str] = None, failed_at: Optional[int] = None) -> plt.Axes:
    """Loss per micro-step of each attempt of a restarted ``run`` and where it resumed, over an
    uninterrupted ``reference`` (grey); ``failed_at``: the step ``rank`` failed at (a red line)."""
    ax = new_axes(ax, figsize=(9.5, 3.5))
    if reference is not None:
        ax.plot(reference.column(rank, "step"), reference.column(rank, "loss"), color="grey",
                lw=3, alpha=0.4, label="uninterrupted run")
    # Every attempt's own records: ``run.steps`` keeps a repeated step once, from the later
    # attempt, dropping the steps the first attempt finished after its last checkpoint.
    steps = [r for r in run.records.get(rank, []) if r.get("kind") == "step"]
    attempts = sorted({attempt_of(s) for s in steps})
    if not attempts:
        raise ValueError(f"rank {rank} has no micro-steps in {run}")
    for attempt in attempts:
        mine = [s for s in steps if attempt_of(s) == attempt]
        name = "first attempt" if attempt == 0 else f"attempt {attempt} (after restart {attempt})"
        line, = ax.plot([s["step"] for s in mine], [s["loss"] for s in mine], marker=".", lw=1.2,
                        label=name)
        if attempt < attempts[-1]:  # this attempt died after its last recorded step
            ax.plot(mine[-1]["step"], mine[-1]["loss"], "x", ms=12, mew=2.5, color=line.get_color(),
                    label=f"last step the first attempt finished ({mine[-1]['step']})")
    if failed_at is not None:
        ax.axvline(failed_at, color="red", lw=1.5)
        ax.annotate(f"rank {rank} failed\nat step {failed_at}", (failed_at, 0.55), xytext=(4, 0),
                    xycoords=AT_TOP, textcoords="offset points", color="red", fontsize="small")
    for event in run.events.get(rank, []):
        if event.get("kind") == "resume":
            ax.axvline(event["step"], color="black", ls=":", lw=1.2)
            ax.annotate(f"resumed from checkpoint\nat step {event['step']}", (event["step"], 1.0),
                        xycoords=AT_TOP, xytext=(-4, -4), textcoords="offset points", va="top",
                        ha="right", fontsize="small")
    ax.set_yscale("log")
    return finish_axes(ax, "micro-step", f"rank {rank} local loss (MSE)",
                       title or "Loss across a restart: where it failed, where it resumed",
                       loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: over no curve
