"""The macOS stand-in's Python: what macOS lacks, taken away on Linux (``.ci/macos-standin``).

Loaded at every interpreter start through PYTHONPATH: real-time signals (Python defines
``signal.SIGRTMIN`` only where the C headers do), ``os.sched_getaffinity``, Linux's pidfds and
``os.waitid`` (Python offers neither on macOS). /proc is hidden by the script; psutil, which on a
Mac asks the kernel instead, reads a second procfs mounted where the kit does not look.
"""

import os
import signal

for name in ("SIGRTMIN", "SIGRTMAX"):
    if hasattr(signal, name):
        delattr(signal, name)
for name in ("sched_getaffinity", "sched_setaffinity", "pidfd_open", "waitid"):
    if hasattr(os, name):
        delattr(os, name)

_PROCFS = os.environ.get("DDP_TUTORIAL_STANDIN_PSUTIL_PROCFS")
if _PROCFS:
    import psutil

    psutil.PROCFS_PATH = _PROCFS
