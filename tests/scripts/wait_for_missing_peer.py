"""Rank 1 waits in an all_reduce that rank 0 never calls; rank 0 stays in its own code.

When SIGTERM stops rank 0, it reports whether rank 1 had written its stack by then: the
launcher must ask every rank for its stack before it stops any. Rank 1 reports the moment it
is inside ``all_reduce`` (a test holds it there).
"""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from ddp_tutorial import envvars, runfolder, stacks
from ddp_tutorial.runfolder import report


def rank0_keeps_computing() -> None:
    while True:
        time.sleep(3600)  # the hang itself: only the launch deadline ends it


def report_whether_rank1_wrote_its_stack(signum, frame) -> None:
    peer = runfolder.stacks_file(os.environ[envvars.RUN_DIR], 0, 1)
    report({"phase": "stopped", "rank1_stack_written": stacks.wrote_script_stack(peer.read_text())})
    os._exit(128 + signum)


def report_once_inside_all_reduce(frame, event, arg) -> None:
    if event == "call" and frame.f_code.co_name == "all_reduce" and frame.f_code.co_filename.endswith(
            "distributed_c10d.py"):
        sys.setprofile(None)
        report({"phase": "inside all_reduce"})


# A long process-group timeout: only the launcher's deadline may end this run.
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
report({"phase": "joined", "pid": os.getpid()})
if dist.get_rank() == 0:
    signal.signal(signal.SIGTERM, report_whether_rank1_wrote_its_stack)
    rank0_keeps_computing()
sys.setprofile(report_once_inside_all_reduce)
dist.all_reduce(torch.ones(1))
