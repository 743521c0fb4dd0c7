"""One plot helper per figure. Each takes results and an optional ``ax``, and returns the ``Axes``.

    ax = plots.plot_sync_timeline(run)      # where each rank's time goes, step by step
    ax = plots.plot_loss_curves(run)        # loss per rank, and their mean

The performance lab's figures are in ``ddp_tutorial.lessons.performance.plots``.
"""

from ddp_tutorial.plots.training import (  # noqa: F401
    PHASE_COLORS,
    plot_loss_curves,
    plot_sync_per_rank,
    plot_sync_timeline,
)
from ddp_tutorial.plots.sampler_accumulation import plot_sampler_orders, plot_sync_per_micro_step  # noqa: F401
from ddp_tutorial.plots.init_wrap import plot_allreduces_vs_bucket_cap, plot_init_times  # noqa: F401
from ddp_tutorial.plots.beyond_one_machine import plot_restart_loss  # noqa: F401
from ddp_tutorial.plots.pitfalls import plot_batchnorm_stats, plot_clipping_drift, plot_eval_error, plot_lr_curves, plot_unused_cost  # noqa: F401,E501
from ddp_tutorial.plots.sharding import plot_comm_per_step, plot_compressed_loss, plot_memory_per_rank  # noqa: F401
from ddp_tutorial.plots.build_ddp import plot_overlap_timeline, plot_side_by_side  # noqa: F401
