"""ddp-tutorial: learn DistributedDataParallel by running it and measuring each step::

    run = ddp_tutorial.launch(ddp_tutorial.TRAIN_SCRIPT, world_size=4, args=["--epochs", "2"])
    ddp_tutorial.plots.plot_loss_curves(run)    # importing the package imports no torch
"""

import sys

from ddp_tutorial import platforms, torch_version

# Native Windows, or a torch outside the tested range: one line here, not later inside a rank.
platforms.refuse_native_windows()
torch_version.check()

from ddp_tutorial import config, launcher  # noqa: E402
from ddp_tutorial.config import TRAIN_MODULE, TRAIN_SCRIPT
from ddp_tutorial.launcher import (
    LaunchConfigError,
    LaunchError,
    LaunchTimeout,
    WorkerError,
    free_port,
    launch,
)
from ddp_tutorial.lessons.worker_scripts import scripts_path
from ddp_tutorial.runfolder import Run
from ddp_tutorial.torch_version import print_versions

# train.py's flags are checked in the kernel before a launch starts anything.
launcher.check_args_with([[TRAIN_SCRIPT], ["-m", TRAIN_MODULE]], config.launch_settings)

# In a notebook, the forkserver imports torch while the learner reads the first cells, so the
# first launch is warm too (where launches are warm: launcher/warm.py).
if "ipykernel" in sys.modules:
    launcher.prestart_warm()

__all__ = ["launch", "Run", "TRAIN_SCRIPT", "LaunchError", "LaunchConfigError", "WorkerError",
           "LaunchTimeout", "free_port", "scripts_path", "plots", "print_versions"]


def __getattr__(name):
    if name != "plots":
        raise AttributeError(f"module 'ddp_tutorial' has no attribute {name!r}")
    import importlib  # plots on first use: it imports matplotlib, which workers never need

    return importlib.import_module("ddp_tutorial.plots")
