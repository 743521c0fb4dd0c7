"""Every figure under one name for the notebooks: train.py's (``plots/training.py``) and each
lesson's (``lessons/<lesson>/plots.py``). Each takes results and an optional ``ax``, returns Axes.
"""

from ddp_tutorial.plots.training import (  # noqa: F401
    PHASE_COLORS, plot_loss_curves, plot_sync_timeline)
from ddp_tutorial.lessons.sampler_accumulation.plots import (  # noqa: F401
    plot_sampler_orders, plot_sync_per_micro_step)
from ddp_tutorial.lessons.init_wrap.plots import (  # noqa: F401
    plot_allreduces_vs_bucket_cap, plot_init_times)
from ddp_tutorial.lessons.beyond_one_machine.plots import plot_restart_loss  # noqa: F401
from ddp_tutorial.lessons.pitfalls.plots import (  # noqa: F401
    plot_batchnorm_stats, plot_clipping_drift, plot_eval_error, plot_lr_curves, plot_unused_cost)
from ddp_tutorial.lessons.sharding.plots import (  # noqa: F401
    plot_comm_per_step, plot_compressed_loss, plot_memory_per_rank)
from ddp_tutorial.lessons.build_ddp.plots import (  # noqa: F401
    plot_overlap_timeline, plot_side_by_side)
from ddp_tutorial.lessons.performance.plots import (  # noqa: F401
    plot_accumulation, plot_allreduce_sweep, plot_bucket_sweep, plot_overlap, plot_scaling_grid)
