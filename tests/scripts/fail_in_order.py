"""Two ranks fail in a fixed order, and the one that failed first exits last.

``--first R``: rank R raises at once, then (an atexit handler) keeps its process alive
until the other rank has failed and exited, as a slow traceback or interpreter exit would.
The other rank raises only once rank R's failure is on record, then exits at once.
No torch: the order is made by the run folder's failure notes alone.
"""

import atexit
import os
import sys
import time

from ddp_tutorial import runfolder
from ddp_tutorial.launcher import procinfo  # a process that exits while asked about reads as gone

rank = int(os.environ["RANK"])
first = int(sys.argv[sys.argv.index("--first") + 1])
run_dir = runfolder.rank_run_dir()


def wait_for_failure_of(other: int, limit_s: float = 60.0) -> dict:
    end = time.monotonic() + limit_s
    while other not in runfolder.failure_notes(run_dir, 0) and time.monotonic() < end:
        time.sleep(0.002)  # polls a file: no event says it appeared
    return runfolder.failure_notes(run_dir, 0).get(other, {})


def wait_until_exited(other: int, limit_s: float = 60.0) -> None:
    pid, end = wait_for_failure_of(other, limit_s).get("pid"), time.monotonic() + limit_s
    while pid and procinfo.alive(pid) and time.monotonic() < end:
        time.sleep(0.002)


if rank == first:
    atexit.register(wait_until_exited, 1 - first)
    raise RuntimeError(f"rank {rank} fails first")
wait_for_failure_of(first)
raise RuntimeError(f"rank {rank} fails second")
