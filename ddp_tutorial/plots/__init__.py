"""One plot helper per figure. Each takes results and an optional ``ax``, and returns the ``Axes``.

    ax = plots.plot_sync_timeline(run)      # where each rank's time goes, step by step
    ax = plots.plot_loss_curves(run)        # loss per rank, and their mean
"""

from ddp_tutorial.plots.training import (  # noqa: F401
    PHASE_COLORS,
    plot_loss_curves,
    plot_sync_per_rank,
    plot_sync_timeline,
)
