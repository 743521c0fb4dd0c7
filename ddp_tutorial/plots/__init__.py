"""One plot helper per figure. Each takes results and an optional ``ax``, and returns the ``Axes``.

    ax = plots.plot_sync_timeline(run)      # where each rank's time goes, step by step
    ax = plots.plot_loss_curves(run)        # loss per rank, and their mean

train.py's figures are in ``plots/training.py``; each lesson's are in its folder,
``lessons/<lesson>/plots.py``, gathered here under one name for the notebooks.
"""

from ddp_tutorial.plots.training import (  # noqa: F401
    PHASE_COLORS, plot_loss_curves, plot_sync_per_rank, plot_sync_timeline)
from ddp_tutorial.lessons.sampler_accumulation.plots import (  # noqa: F401
    plot_sampler_orders, plot_sync_per_micro_step)
from ddp_tutorial.lessons.init_wrap.plots import (  # noqa: F401
    plot_allreduces_vs_bucket_cap, plot_init_times)
from ddp_tutorial.lessons.beyond_one_machine.plots import plot_restart_loss  # noqa: F401
from ddp_tutorial.lessons.pitfalls.plots import (  # noqa: F401
    plot_batchnorm_stats, plot_clipping_drift, plot_eval_error, plot_lr_curves, plot_unused_cost)
from ddp_tutorial.lessons.sharding.plots import (  # noqa: F401
    plot_comm_per_step, plot_compressed_loss, plot_memory_per_rank)
from ddp_tutorial.lessons.build_ddp.plots import plot_overlap_timeline, plot_side_by_side  # noqa: F401
from ddp_tutorial.lessons.performance.plots import (  # noqa: F401
    plot_accumulation, plot_allreduce_sweep, plot_bucket_sweep, plot_overlap, plot_scaling_grid)
