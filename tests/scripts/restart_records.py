"""Attempt 0 writes steps 0..3, tears a record and fails; attempt 1 resumes at step 2 and writes 2..5.

No torch: a cheap stand-in for train.py resumed from a checkpoint taken at step 2.
"""

import os
import sys
import time

from ddp_tutorial.envvars import restart_attempt
from ddp_tutorial.runfolder import MetricsWriter, rank_run_dir, report

attempt, rank = restart_attempt(), int(os.environ["RANK"])
run_dir = rank_run_dir()
writer = MetricsWriter(run_dir, rank, fresh=attempt == 0)
for step in (range(0, 4) if attempt == 0 else range(2, 6)):
    writer.write({"kind": "step", "rank": rank, "step": step})
if attempt == 0:
    writer._file.write('{"kind": "step", "rank": %d, "st' % rank)  # dies mid-record
    writer._file.flush()
    open(os.path.join(run_dir, f"torn{rank}"), "w").close()
    # Fail only once both ranks have torn their line, so neither is stopped before.
    deadline = time.monotonic() + 30
    while not all(os.path.exists(os.path.join(run_dir, f"torn{r}")) for r in range(2)):
        if time.monotonic() > deadline:
            sys.exit("the other rank never tore its line")
        time.sleep(0.01)
    os._exit(1)
writer.write({"kind": "summary", "rank": rank})
writer.close()
report({"attempt": attempt})
